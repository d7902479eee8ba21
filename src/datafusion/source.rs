//! [`GpuScan`]: the [`DataSource`] of a [`GpuTable`](super::GpuTable) scan.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;

use ::datafusion::common::tree_node::TreeNodeRecursion;
use ::datafusion::common::{DataFusionError, Statistics, project_schema};
use ::datafusion::datasource::source::DataSource;
use ::datafusion::execution::TaskContext;
use ::datafusion::logical_expr::Expr;
use ::datafusion::physical_expr::projection::ProjectionExprs;
use ::datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use ::datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, Time};
use ::datafusion::physical_plan::projection::{all_alias_free_columns, new_projections_for_columns};
use ::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use ::datafusion::physical_plan::{DisplayFormatType, SendableRecordBatchStream};
use arrow_array::{Array, RecordBatch, RecordBatchOptions};
use arrow_schema::SchemaRef;

use super::device_filter::Filtered;
use super::error::DfResult;
use super::predicate::Predicate;
use super::table::TableData;
use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};
use crate::transfer::PendingBatch;

/// The scan of a GPU table: which partitions, which columns, which pushed-down filters, how many
/// rows. Filters apply first, then the limit, then the projection; a column read only by a filter
/// never leaves the device.
#[derive(Clone)]
pub struct GpuScan {
    table: Arc<TableData>,
    projection: Option<Vec<usize>>,
    projected_schema: SchemaRef,
    filters: Vec<Expr>,
    predicate: Option<Arc<Predicate>>,
    fetch: Option<usize>,
    /// Rows and bytes copied to the host, and where the time went (see [`ScanMetrics`]).
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for GpuScan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuScan")
            .field("partitions", &self.table.partitions.len())
            .field("projection", &self.projection)
            .field("filters", &self.filters)
            .field("fetch", &self.fetch)
            .finish()
    }
}

impl GpuScan {
    pub(crate) fn new(table: Arc<TableData>) -> Self {
        GpuScan {
            projected_schema: table.schema.clone(),
            table,
            projection: None,
            filters: vec![],
            predicate: None,
            fetch: None,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// Keeps only the table columns at `projection` (all of them for `None`).
    pub fn with_projection(mut self, projection: Option<Vec<usize>>) -> DfResult<Self> {
        self.projected_schema = project_schema(&self.table.schema, projection.as_ref())?;
        self.projection = projection;
        Ok(self)
    }

    pub(crate) fn with_filters(mut self, filters: Vec<Expr>, predicates: Vec<Predicate>) -> Self {
        self.filters = filters;
        self.predicate = Predicate::conjunction(predicates).map(Arc::new);
        self
    }

    /// Stops after `limit` rows in each partition.
    pub fn with_limit(mut self, limit: Option<usize>) -> Self {
        self.fetch = limit;
        self
    }

    /// The pushed-down filters, as DataFusion gave them.
    pub fn filters(&self) -> &[Expr] {
        &self.filters
    }

    /// The projected table columns, if any projection was pushed down.
    pub fn projection(&self) -> Option<&[usize]> {
        self.projection.as_deref()
    }

    /// The table scanned.
    pub(crate) fn table(&self) -> &Arc<TableData> {
        &self.table
    }

    /// The conjunction of the pushed-down filters.
    pub(crate) fn predicate(&self) -> Option<&Arc<Predicate>> {
        self.predicate.as_ref()
    }

    /// The limit, if any.
    pub(crate) fn limit(&self) -> Option<usize> {
        self.fetch
    }

    /// The scan's rows on its table's device, filtered and projected there without a copy to
    /// the host (for a device stage that hashes them as a join's build side); `None` when a
    /// filtered batch's columns can only be compacted on the host. The scan must have no limit.
    pub(crate) fn device_batches(&self, stream: &Stream) -> crate::error::Result<Option<Vec<DeviceRecordBatch>>> {
        let output = self.output_columns();
        let mut out = Vec::new();
        for batch in self.table.partitions.iter().flatten() {
            match &self.predicate {
                None => out.push(batch.project(&output)?),
                Some(p) => match super::device_filter::filter_compact(batch, p, &output, usize::MAX, stream)? {
                    Filtered::Empty => {}
                    Filtered::Device(b) => out.push(b),
                    Filtered::Host(_) => return Ok(None),
                },
            }
        }
        Ok(Some(out))
    }

    pub(crate) fn output_columns(&self) -> Vec<usize> {
        match &self.projection {
            Some(p) => p.clone(),
            None => (0..self.table.schema.fields().len()).collect(),
        }
    }
}

impl DataSource for GpuScan {
    fn open(&self, partition: usize, context: Arc<TaskContext>) -> DfResult<SendableRecordBatchStream> {
        let batches = self
            .table
            .partitions
            .get(partition)
            .cloned()
            .ok_or_else(|| DataFusionError::Internal(format!("GPU table has no partition {partition}")))?;
        let device = self.table.partition_devices[partition];
        let lane = self.table.lanes[&device].clone();
        let plan = Arc::new(ScanPlan {
            output: self.output_columns(),
            schema: self.projected_schema.clone(),
            predicate: self.predicate.clone(),
        });
        // Device batches are large (millions of rows, for few and large copies); DataFusion's
        // operators work best on batches of the session's batch size, so each host batch is handed
        // on in slices of that many rows (no copy).
        let batch_size = context.session_config().batch_size().max(1);
        let metrics = ScanMetrics::new(&self.metrics, partition);
        let state = (batches.into_iter(), self.fetch, VecDeque::new());
        let stream = futures::stream::unfold(state, move |(mut batches, mut remaining, mut ready)| {
            let lane = lane.clone();
            let plan = plan.clone();
            let metrics = metrics.clone();
            async move {
                loop {
                    if let Some(out) = ready.pop_front() {
                        return Some((Ok(out), (batches, remaining, ready)));
                    }
                    if remaining == Some(0) {
                        return None;
                    }
                    let batch = batches.next()?;
                    // The stream is held while the device works; the host waits for the copy and
                    // validates the arrays without it.
                    let result = match lane.acquire().await {
                        Ok(lease) => {
                            let _device = metrics.device_time.timer();
                            scan_batch(&batch, &plan, remaining, lease.stream())
                        }
                        Err(e) => Err(e),
                    };
                    let copying = metrics.copy_time.timer();
                    let finished = result.and_then(|s| s.map(|s| s.finish(&plan)).transpose());
                    copying.done();
                    match finished {
                        Ok(Some(out)) => {
                            metrics.record(&out);
                            remaining = remaining.map(|r| r.saturating_sub(out.num_rows()));
                            ready.extend(slices(&out, batch_size));
                        }
                        Ok(None) => continue,
                        Err(e) => return Some((Err(e), (batches, Some(0), VecDeque::new()))),
                    }
                }
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.projected_schema.clone(),
            stream,
        )))
    }

    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let devices: BTreeSet<String> = self.table.partition_devices.iter().map(Device::to_string).collect();
        let devices: Vec<String> = devices.into_iter().collect();
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(
                    f,
                    "GpuTableScan: partitions={}, devices=[{}]",
                    self.table.partitions.len(),
                    devices.join(", ")
                )?;
                if let Some(p) = &self.projection {
                    let names: Vec<&str> = p.iter().map(|&i| self.table.schema.field(i).name().as_str()).collect();
                    write!(f, ", projection=[{}]", names.join(", "))?;
                }
                if !self.filters.is_empty() {
                    let filters: Vec<String> = self.filters.iter().map(|e| e.to_string()).collect();
                    write!(f, ", filters=[{}]", filters.join(", "))?;
                }
                if let Some(n) = self.fetch {
                    write!(f, ", fetch={n}")?;
                }
                Ok(())
            }
            DisplayFormatType::TreeRender => {
                writeln!(f, "format=gpu")?;
                writeln!(f, "devices={}", devices.join(","))?;
                if !self.filters.is_empty() {
                    let filters: Vec<String> = self.filters.iter().map(|e| e.to_string()).collect();
                    writeln!(f, "filters={}", filters.join(" AND "))?;
                }
                Ok(())
            }
        }
    }

    fn output_partitioning(&self) -> Partitioning {
        Partitioning::UnknownPartitioning(self.table.partitions.len())
    }

    fn eq_properties(&self) -> EquivalenceProperties {
        EquivalenceProperties::new(self.projected_schema.clone())
    }

    fn partition_statistics(&self, partition: Option<usize>) -> DfResult<Arc<Statistics>> {
        let mut stats = match partition {
            Some(p) => match self.table.partition_stats.get(p) {
                Some(s) => s.clone(),
                None => return Ok(Arc::new(Statistics::new_unknown(&self.projected_schema))),
            },
            None => self.table.stats.clone(),
        };
        // The bytes of the columns the scan returns (DataFusion's join selection compares them).
        let columns = self.output_columns();
        let bytes = |p: &Vec<usize>| columns.iter().map(|&c| p[c]).sum::<usize>();
        let projected_bytes = match partition {
            Some(p) => self.table.column_bytes.get(p).map_or(0, bytes),
            None => self.table.column_bytes.iter().map(bytes).sum(),
        };
        stats.total_byte_size = ::datafusion::common::stats::Precision::Inexact(projected_bytes);
        // Filters remove an unknown number of rows: what is left is an upper bound.
        let stats = if self.predicate.is_some() {
            stats.to_inexact()
        } else {
            stats
        };
        let stats = stats.project(self.projection.as_ref());
        let n = if partition.is_some() {
            1
        } else {
            self.table.partitions.len().max(1)
        };
        Ok(Arc::new(stats.with_fetch(self.fetch, 0, n)?))
    }

    fn with_fetch(&self, limit: Option<usize>) -> Option<Arc<dyn DataSource>> {
        Some(Arc::new(self.clone().with_limit(limit)))
    }

    fn fetch(&self) -> Option<usize> {
        self.fetch
    }

    fn metrics(&self) -> ExecutionPlanMetricsSet {
        self.metrics.clone()
    }

    fn try_swapping_with_projection(&self, projection: &ProjectionExprs) -> DfResult<Option<Arc<dyn DataSource>>> {
        let exprs: Vec<_> = projection.iter().cloned().collect();
        if !all_alias_free_columns(&exprs) {
            return Ok(None);
        }
        let current = self.output_columns();
        let new_projection = new_projections_for_columns(&exprs, &current);
        let scan = self.clone().with_projection(Some(new_projection))?;
        Ok(Some(Arc::new(scan)))
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }
}

/// What every batch of a scan goes through.
#[derive(Debug)]
struct ScanPlan {
    /// Table columns to return, in order.
    output: Vec<usize>,
    /// Their schema.
    schema: SchemaRef,
    predicate: Option<Arc<Predicate>>,
}

/// What a scanned batch becomes: a host batch, or a copy to the host still in flight.
enum Scanned {
    Host(RecordBatch),
    Copying(PendingBatch),
}

impl Scanned {
    /// The host batch, with the scan's schema.
    fn finish(self, plan: &ScanPlan) -> DfResult<RecordBatch> {
        let batch = match self {
            Scanned::Host(b) => b,
            Scanned::Copying(pending) => pending.wait()?,
        };
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        Ok(RecordBatch::try_new_with_options(
            plan.schema.clone(),
            batch.columns().to_vec(),
            &options,
        )?)
    }
}

/// A scan partition's metrics, in `EXPLAIN ANALYZE`.
#[derive(Clone)]
struct ScanMetrics {
    output_rows: Count,
    /// The bytes of the batches copied to the host (their buffers' used ranges).
    bytes_to_host: Count,
    /// Filtering and compacting on the device and issuing the copies (`elapsed_compute`).
    device_time: Time,
    /// Waiting for the copies to the host and building arrow arrays of them.
    copy_time: Time,
}

impl ScanMetrics {
    fn new(set: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        ScanMetrics {
            output_rows: MetricBuilder::new(set).output_rows(partition),
            bytes_to_host: MetricBuilder::new(set).counter("bytes_to_host", partition),
            device_time: MetricBuilder::new(set).elapsed_compute(partition),
            copy_time: MetricBuilder::new(set).subset_time("copy_time", partition),
        }
    }

    fn record(&self, batch: &RecordBatch) {
        self.output_rows.add(batch.num_rows());
        let bytes = batch
            .columns()
            .iter()
            .map(|c| {
                c.to_data()
                    .get_slice_memory_size()
                    .unwrap_or_else(|_| c.get_array_memory_size())
            })
            .sum();
        self.bytes_to_host.add(bytes);
    }
}

/// `batch` in slices of at most `rows` rows (views of its buffers).
fn slices(batch: &RecordBatch, rows: usize) -> impl Iterator<Item = RecordBatch> + '_ {
    (0..batch.num_rows())
        .step_by(rows)
        .map(move |start| batch.slice(start, rows.min(batch.num_rows() - start)))
}

/// Filters, limits and projects one device batch and starts copying the result to the host;
/// `None` when no row is left.
fn scan_batch(
    batch: &DeviceRecordBatch,
    plan: &ScanPlan,
    remaining: Option<usize>,
    stream: &Stream,
) -> DfResult<Option<Scanned>> {
    let limit = remaining.unwrap_or(usize::MAX);
    let out = match &plan.predicate {
        None => {
            let n = batch.num_rows().min(limit);
            if n == 0 {
                return Ok(None);
            }
            let mut projected = batch.project(&plan.output)?;
            if n < batch.num_rows() {
                projected = projected.slice(0, n)?;
            }
            download(&projected, n, plan, stream)?
        }
        Some(predicate) if batch.device().is_host_accessible() => {
            Scanned::Host(host_filter(batch, predicate, plan, limit, stream)?)
        }
        Some(predicate) => match super::device_filter::filter_compact(batch, predicate, &plan.output, limit, stream)? {
            Filtered::Empty => return Ok(None),
            Filtered::Device(compacted) => download(&compacted, compacted.num_rows(), plan, stream)?,
            Filtered::Host(host) => Scanned::Host(super::device_filter::host_batch(host, plan.schema.clone())?),
        },
    };
    let rows = match &out {
        Scanned::Host(b) => b.num_rows(),
        Scanned::Copying(p) => p.num_rows(),
    };
    Ok((rows > 0).then_some(out))
}

/// Starts copying a projected device batch of `rows` rows to the host.
fn download(batch: &DeviceRecordBatch, rows: usize, plan: &ScanPlan, stream: &Stream) -> DfResult<Scanned> {
    if batch.num_columns() == 0 {
        let options = RecordBatchOptions::new().with_row_count(Some(rows));
        let empty = RecordBatch::try_new_with_options(plan.schema.clone(), vec![], &options)?;
        return Ok(Scanned::Host(empty));
    }
    Ok(Scanned::Copying(crate::transfer::dtoh_async(batch, stream)?))
}

/// The CPU device's filter: copies the columns the predicate and the projection need, evaluates
/// the predicate with arrow-rs kernels, filters, limits, projects.
fn host_filter(
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    plan: &ScanPlan,
    limit: usize,
    stream: &Stream,
) -> DfResult<RecordBatch> {
    let mut needed = BTreeSet::new();
    predicate.columns(&mut needed);
    needed.extend(plan.output.iter().copied());
    let needed: Vec<usize> = needed.into_iter().collect();
    let position = |c: usize| needed.binary_search(&c).unwrap_or(0);
    let host = crate::transfer::dtoh(&batch.project(&needed)?, stream)?;
    let mask = predicate.evaluate(&host, &position)?;
    // Unknown (null) is not true: those rows go.
    let mask = if mask.nulls().is_some() {
        arrow_select::filter::prep_null_mask_filter(&mask)
    } else {
        mask
    };
    let filtered = arrow_select::filter::filter_record_batch(&host, &mask)?;
    let n = filtered.num_rows().min(limit);
    let filtered = filtered.slice(0, n);
    let columns = plan
        .output
        .iter()
        .map(|&c| filtered.column(position(c)).clone())
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(n));
    Ok(RecordBatch::try_new_with_options(
        plan.schema.clone(),
        columns,
        &options,
    )?)
}
