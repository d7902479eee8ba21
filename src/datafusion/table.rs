//! [`GpuTable`]: a DataFusion [`TableProvider`] whose columns live in device memory.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use ::datafusion::catalog::{Session, TableProvider};
use ::datafusion::common::{DataFusionError, Statistics};
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::context::SessionContext;
use ::datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use ::datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use ::datafusion::prelude::CsvReadOptions;
use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use async_trait::async_trait;
use futures::StreamExt;

use super::error::DfResult;
use super::files::GpuTableSource;
use super::lanes::DeviceLane;
use super::options::LoadOptions;
use super::options::{DEFAULT_BATCH_ROWS, MAX_GATHERED_BYTES};
use super::predicate::{Predicate, supports_filter};
use super::source::GpuScan;
use super::staging::{Place, Stager, batches, gather, host_bytes, prepare, redistribute, sized, stage_parallel};
use crate::array::DeviceRecordBatch;
use crate::device::Device;
use crate::transfer::times::{StagingStep, timed};

/// What a table holds: device batches per partition, where each partition lives, statistics.
#[derive(Debug)]
pub(crate) struct TableData {
    pub(crate) schema: SchemaRef,
    pub(crate) partitions: Vec<Vec<DeviceRecordBatch>>,
    pub(crate) partition_devices: Vec<Device>,
    pub(crate) partition_stats: Vec<Statistics>,
    pub(crate) stats: Statistics,
    /// The longest value of each string column, in bytes (`None` for other columns).
    pub(crate) longest_strings: Vec<Option<usize>>,
    /// The host bytes of each column as staged (view columns compacted), as
    /// `get_array_memory_size` counts them, per partition.
    pub(crate) column_bytes: Vec<Vec<usize>>,
    pub(crate) lanes: HashMap<Device, Arc<DeviceLane>>,
    /// The files the table was staged from, when it was (see [`GpuTable::source`]).
    pub(crate) source: Option<GpuTableSource>,
}

impl TableData {
    /// The device holding every partition, when one does.
    pub(crate) fn single_device(&self) -> Option<Device> {
        let first = *self.partition_devices.first()?;
        self.partition_devices.iter().all(|d| *d == first).then_some(first)
    }
}

/// A DataFusion table whose columns live in device memory.
///
/// Build it from host batches ([`GpuTable::try_new`]), from any other provider
/// ([`GpuTable::from_provider`]) or from Parquet and CSV files ([`GpuTable::from_parquet`],
/// [`GpuTable::from_csv`]), then register it with `SessionContext::register_table`; or let SQL
/// make it (`CREATE EXTERNAL TABLE ... STORED AS GPU`, see [`with_gpu_tables`](super::with_gpu_tables)).
#[derive(Debug, Clone)]
pub struct GpuTable {
    pub(crate) data: Arc<TableData>,
}

impl GpuTable {
    /// Stages `partitions` of host batches (all of `schema`) on the devices of `options`,
    /// partition `i` on device `i % devices`. Checks beforehand that every device has room for its
    /// share and fails with [`DataFusionError::ResourcesExhausted`] when one has not (naming the
    /// table, the bytes it takes and the bytes free); the same error ends a load whose allocation
    /// fails, and frees what was staged.
    ///
    /// View columns (`Utf8View`, `BinaryView`) whose data buffers hold more bytes than their views
    /// reference (buffers shared between batches, as DataFusion's Parquet reader makes them) are
    /// compacted first, so the table takes device memory in proportion to its values.
    pub fn try_new(schema: SchemaRef, partitions: Vec<Vec<RecordBatch>>, options: &LoadOptions) -> DfResult<Self> {
        let times = options.staging_times.clone();
        let (mut stager, units) = timed(times.as_deref(), StagingStep::Setup, || {
            Self::units(schema, partitions, options)
        })?;
        stage_parallel(&mut stager, units, |batches| Ok((std::iter::once(Ok(batches)), None)))?;
        stager.finish()
    }

    /// The stager of [`GpuTable::try_new`] and its units: the runs of host batches that make each
    /// device batch, with their partitions, once every device was found to have room for them.
    #[allow(clippy::type_complexity)]
    fn units(
        schema: SchemaRef,
        partitions: Vec<Vec<RecordBatch>>,
        options: &LoadOptions,
    ) -> DfResult<(Stager, Vec<(Place, Vec<RecordBatch>)>)> {
        let partitions = sized(redistribute(partitions, options.partitions));
        let total_rows = partitions.iter().flatten().map(|(b, _)| b.num_rows() as u64).sum();
        let total_bytes = partitions.iter().flatten().map(|(_, bytes)| bytes).sum();
        let stager = Stager::new(schema, partitions.len(), options, Some(total_rows), Some(total_bytes))?;
        // Check each device's share before copying anything.
        let mut need: HashMap<Device, u64> = HashMap::new();
        for (i, p) in partitions.iter().enumerate() {
            *need.entry(stager.device_of(i)).or_default() += p.iter().map(|(_, bytes)| bytes).sum::<u64>();
        }
        for (device, bytes) in need {
            stager.check_room(device, bytes)?;
        }
        let rows = options.batch_rows.unwrap_or(DEFAULT_BATCH_ROWS);
        let mut units = Vec::new();
        for (i, p) in partitions.into_iter().enumerate() {
            for run in gather(p, rows) {
                units.extend(stager.units(i, units.len(), batches(run)));
            }
        }
        Ok((stager, units))
    }

    /// Stages host batches as one partition per batch.
    pub fn from_batches(schema: SchemaRef, batches: Vec<RecordBatch>, options: &LoadOptions) -> DfResult<Self> {
        let partitions = batches.into_iter().map(|b| vec![b]).collect();
        Self::try_new(schema, partitions, options)
    }

    /// Scans `provider` through a fresh `SessionContext` and stages its batches as they arrive,
    /// keeping its partitioning (or the one of [`LoadOptions::with_partitions`]).
    pub async fn from_provider(provider: Arc<dyn TableProvider>, options: &LoadOptions) -> DfResult<Self> {
        let ctx = SessionContext::new();
        let df = ctx.read_table(provider)?;
        let streams = df.execute_stream_partitioned().await?;
        Self::from_streams(streams, options).await
    }

    /// Stages Parquet files (a file, a directory or a glob, as `SessionContext::read_parquet`
    /// takes them; local files only) with the types DataFusion reads them as. Row groups are
    /// decoded on every core, straight into device batches of about
    /// [`LoadOptions::with_batch_rows`] rows, each copied to its device as soon as it is decoded;
    /// runs of consecutive row groups make the partitions (one per core unless
    /// [`LoadOptions::with_partitions`] says otherwise).
    pub async fn from_parquet(path: impl AsRef<Path>, options: &LoadOptions) -> DfResult<Self> {
        let options = named(options, path.as_ref());
        let ctx = SessionContext::new();
        let location = path_str(path.as_ref())?.to_string();
        super::files::load(&ctx.state(), &[location], "PARQUET", HashMap::new(), options).await
    }

    /// Reads CSV files with DataFusion's reader (`csv` says how: header, delimiter, schema...)
    /// and stages the batches as they arrive.
    pub async fn from_csv(path: impl AsRef<Path>, csv: CsvReadOptions<'_>, options: &LoadOptions) -> DfResult<Self> {
        let options = &named(options, path.as_ref());
        let ctx = SessionContext::new();
        let df = ctx.read_csv(path_str(path.as_ref())?, csv).await?;
        Self::from_streams(df.execute_stream_partitioned().await?, options).await
    }

    async fn from_streams(streams: Vec<SendableRecordBatchStream>, options: &LoadOptions) -> DfResult<Self> {
        let schema = match streams.first() {
            Some(s) => s.schema(),
            None => {
                return Err(DataFusionError::Plan("the source has no partitions".into()));
            }
        };
        let n_out = options.partitions.unwrap_or(streams.len()).max(1);
        let rows = options.batch_rows.unwrap_or(DEFAULT_BATCH_ROWS);
        let mut stager = Stager::new(schema.clone(), n_out, options, None, None)?;
        // Each partition's batches not staged yet (with their sizes), and their bytes.
        let mut pending: Vec<Vec<(RecordBatch, u64)>> = vec![Vec::new(); n_out];
        let mut pending_bytes = vec![0u64; n_out];
        let mut order = 0;
        let times = options.staging_times.clone();
        let mut put = |stager: &mut Stager, partition: usize, run: Vec<(RecordBatch, u64)>| {
            order += 1;
            for (place, unit) in stager.units(partition, order, batches(run)) {
                let device = stager.device_of(place.partition);
                let prepared = timed(times.as_deref(), StagingStep::Prepare, || {
                    prepare(&schema, unit, None, device)
                })?;
                stager.decoded(prepared.bytes());
                stager.put(place, prepared)?;
            }
            Ok::<_, DataFusionError>(())
        };
        let mut next = 0usize;
        for (i, mut s) in streams.into_iter().enumerate() {
            loop {
                let decoding = std::time::Instant::now();
                let Some(batch) = s.next().await else {
                    break;
                };
                if let Some(times) = &options.staging_times {
                    times.add(StagingStep::Decode, decoding.elapsed());
                }
                let batch = batch?;
                if batch.num_rows() == 0 {
                    continue;
                }
                let target = match options.partitions {
                    None => i,
                    Some(n) => {
                        next += 1;
                        (next - 1) % n
                    }
                };
                let bytes = host_bytes(&batch);
                pending[target].push((batch, bytes));
                pending_bytes[target] += bytes;
                let held = pending[target].iter().map(|(b, _)| b.num_rows()).sum::<usize>();
                if held < rows && pending_bytes[target] < MAX_GATHERED_BYTES {
                    continue;
                }
                // Full runs are staged; the last, if it has room left, waits for more batches.
                let mut runs = gather(std::mem::take(&mut pending[target]), rows);
                pending_bytes[target] = 0;
                if let Some(last) = runs.pop_if(|r| r.iter().map(|(b, _)| b.num_rows()).sum::<usize>() < rows) {
                    pending_bytes[target] = last.iter().map(|(_, bytes)| bytes).sum();
                    pending[target] = last;
                }
                for run in runs {
                    put(&mut stager, target, run)?;
                }
            }
        }
        for (target, rest) in pending.into_iter().enumerate() {
            for run in gather(rest, rows) {
                put(&mut stager, target, run)?;
            }
        }
        stager.finish()
    }

    /// The table's schema.
    pub fn schema_ref(&self) -> &SchemaRef {
        &self.data.schema
    }

    /// The device batches of each partition.
    pub fn partitions(&self) -> &[Vec<DeviceRecordBatch>] {
        &self.data.partitions
    }

    /// The device each partition lives on.
    pub fn partition_devices(&self) -> &[Device] {
        &self.data.partition_devices
    }

    /// The number of rows.
    pub fn num_rows(&self) -> usize {
        self.data
            .partitions
            .iter()
            .flatten()
            .map(DeviceRecordBatch::num_rows)
            .sum()
    }

    /// The bytes of device memory the table holds: the size of every allocation its batches view,
    /// each counted once (with the padding that aligns their buffers).
    pub fn size_in_bytes(&self) -> usize {
        let mut seen = HashSet::new();
        self.data
            .partitions
            .iter()
            .flatten()
            .flat_map(|b| b.columns().iter())
            .flat_map(|c| c.all_buffers())
            .map(|b| b.parent().unwrap_or_else(|| b.clone()))
            .filter(|whole| seen.insert((whole.device(), whole.address())))
            .map(|whole| whole.len())
            .sum()
    }

    /// Exact statistics computed on the host batches while staging: row count, and per column
    /// the null count and (for the types DataFusion's `MIN`/`MAX` handle) the minimum and maximum.
    pub fn statistics_ref(&self) -> &Statistics {
        &self.data.stats
    }

    /// A scan of the whole table with no projection, filter or limit; see [`GpuScan`].
    pub fn scan_source(&self) -> GpuScan {
        GpuScan::new(self.data.clone())
    }

    /// The files the table was staged from, their format and how they were staged: what a
    /// distributed engine sends to the machines that stage the table again (the `ballista`
    /// feature's codecs do). `None` for a table staged from batches or
    /// another provider ([`GpuTable::try_new`], [`GpuTable::from_provider`],
    /// [`GpuTable::from_csv`]), whose rows exist only here.
    pub fn source(&self) -> Option<&GpuTableSource> {
        self.data.source.as_ref()
    }

    /// The table, remembering that it was staged from `source`.
    pub(crate) fn with_source(mut self, source: GpuTableSource) -> DfResult<Self> {
        let data = Arc::get_mut(&mut self.data)
            .ok_or_else(|| DataFusionError::Internal("a GPU table is shared before its source is set".into()))?;
        data.source = Some(source);
        Ok(self)
    }

    /// The plan that scans the table: `filters` (each one [`supports_filter`] accepts) on the
    /// device, then `limit` rows, then the columns of `projection`.
    pub(crate) fn scan_plan(
        &self,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        let mut predicates = Vec::with_capacity(filters.len());
        for f in filters {
            match Predicate::from_expr(f, &self.data.schema) {
                Some(p) => predicates.push(p),
                None => {
                    return Err(DataFusionError::Plan(format!(
                        "filter {f} was not accepted for pushdown into a GPU table"
                    )));
                }
            }
        }
        let source = GpuScan::new(self.data.clone())
            .with_projection(projection.cloned())?
            .with_filters(filters.to_vec(), predicates)
            .with_limit(limit);
        Ok(DataSourceExec::from_data_source(source))
    }
}

/// `options`, naming the table by `path` unless they name it.
fn named(options: &LoadOptions, path: &Path) -> LoadOptions {
    let mut options = options.clone();
    options.name.get_or_insert_with(|| path.display().to_string());
    options
}

fn path_str(p: &Path) -> DfResult<&str> {
    p.to_str()
        .ok_or_else(|| DataFusionError::Plan(format!("path {} is not UTF-8", p.display())))
}

#[async_trait]
impl TableProvider for GpuTable {
    fn schema(&self) -> SchemaRef {
        self.data.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DfResult<Arc<dyn ExecutionPlan>> {
        self.scan_plan(projection, filters, limit)
    }

    fn supports_filters_pushdown(&self, filters: &[&Expr]) -> DfResult<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if supports_filter(f, &self.data.schema) {
                    TableProviderFilterPushDown::Exact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    fn statistics(&self) -> Option<Statistics> {
        Some(self.data.stats.clone())
    }
}
