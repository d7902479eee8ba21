//! [`DeviceStageExec`]: the execution plan node of a device stage.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use ::datafusion::common::DataFusionError;
use ::datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use ::datafusion::execution::TaskContext;
use ::datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use ::datafusion::physical_expr::expressions::UnKnownColumn;
use ::datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use ::datafusion::physical_plan::execution_plan::reset_plan_states;
use ::datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use ::datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder, MetricsSet, Time};
use ::datafusion::physical_plan::repartition::BatchPartitioner;
use ::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use ::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties, SendableRecordBatchStream,
};
use arrow_array::RecordBatch;
use arrow_schema::{SchemaRef, SortOptions};
use arrow_select::concat::concat_batches;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

use super::super::error::DfResult;
use super::super::predicate::Predicate;
use super::build::{BuildRows, build_sides};
use super::device::DeviceStage;
use super::host::HostStage;
use super::layout::{Groups, JoinKind, StagePlan, Step};
use super::narrow::{Narrowing, Top, narrow_on_host, state_columns, top_key_supported};
use super::output::{final_batch, state_batch};
use super::{Outcome, StageResult};
use crate::array::DeviceRecordBatch;
use crate::device::{Device, Stream};

/// A device stage: a GPU table's scan, its filters, joins, computed projections and an aggregation,
/// run where the table lives (or, for a rows stage, the scan, filters and computed projections,
/// whose kept rows it emits, partitioned as the node it replaced). When it covers the whole
/// aggregation it emits the aggregate's final rows, partitioned as the `Final` aggregate it replaced partitioned them; when DataFusion's `Final`
/// aggregate stays above it, it emits DataFusion's partial aggregate state in as many partitions
/// as the partial aggregate it replaced (each partition a share of the groups, merged above in
/// parallel). The stage runs once, shared by its partitions. When the device cannot finish (a
/// group key string longer than the key words hold, device memory exhausted) it gives the work
/// back: the original DataFusion plan runs instead, partition by partition, and the answer is the
/// same.
pub struct DeviceStageExec {
    plan: Arc<StagePlan>,
    output: Output,
    /// The plan this stage replaced, run when the stage gives its work back.
    original: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
    /// The stage's one run, shared by its partitions; started by the first partition executed.
    /// The table is immutable, so a later execution of the same plan shares it too.
    shared: Mutex<Option<SharedRun>>,
    /// Why the run gave its work back, once it has: `EXPLAIN ANALYZE` says it.
    given_back: Arc<Mutex<Option<String>>>,
}

/// What a stage emits.
#[derive(Clone, Debug)]
pub(crate) enum Output {
    /// DataFusion's partial aggregate state (the plan's schema), for a `Final` aggregate above.
    Partial,
    /// The final rows of these aggregates (DataFusion's own accumulators merge the stage's
    /// state), with this schema: the stage replaced the whole aggregation.
    Final {
        aggr: Vec<Arc<AggregateFunctionExpr>>,
        schema: SchemaRef,
        having: Option<Having>,
        /// The top-k cut of a sort with a limit above the stage (which stays there).
        top: Option<Top>,
    },
    /// The rows the pipeline keeps, with the columns of the projection or filter the stage
    /// replaced (a rows stage: no aggregate above the pipeline).
    Rows,
}

impl Output {
    /// Which of a device's groups the stage emits, where one device holds them all.
    fn narrowing(&self) -> Option<Narrowing> {
        match self {
            Output::Final { having, top, .. } if having.is_some() || top.is_some() => Some(Narrowing {
                having: having.as_ref().map(|h| h.on_state.clone()),
                top: top.clone(),
            }),
            _ => None,
        }
    }
}

/// A `HAVING` filter over a stage's final rows (the `FilterExec` above the aggregate it replaced).
#[derive(Clone, Debug)]
pub(crate) struct Having {
    /// The predicate, over the final rows.
    pub(crate) predicate: Arc<dyn PhysicalExpr>,
    /// The same predicate over the state batch, whose state columns hold the values of the
    /// aggregates it reads (`SUM`, `COUNT`, `MIN`, `MAX`): where one device holds every group,
    /// its state is the final rows, and the groups it drops are never split, merged or copied
    /// to the host.
    pub(crate) on_state: Predicate,
    /// The columns of the filtered rows the filter emits, where it projects them.
    pub(crate) projection: Option<Vec<usize>>,
}

/// The rows of `batch` where `predicate` is true.
fn filtered(batch: &RecordBatch, predicate: &Arc<dyn PhysicalExpr>) -> DfResult<RecordBatch> {
    let mask = predicate.evaluate(batch)?.into_array(batch.num_rows())?;
    let mask = mask
        .as_any()
        .downcast_ref::<arrow_array::BooleanArray>()
        .ok_or_else(|| DataFusionError::Internal("a HAVING predicate that is not boolean".into()))?;
    Ok(arrow_select::filter::filter_record_batch(batch, mask)?)
}

/// What the stage's run produced: each partition's batches, or the work given back to a fresh
/// copy of the replaced plan (its join build sides may have run already, and some of
/// DataFusion's operators run only once).
#[derive(Clone)]
enum Produced {
    Partitions(Arc<Vec<Vec<RecordBatch>>>),
    GivenBack(Arc<dyn ExecutionPlan>),
}

type SharedRun = Shared<BoxFuture<'static, Result<Produced, Arc<DataFusionError>>>>;

impl fmt::Debug for DeviceStageExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceStageExec").field("plan", &self.plan).finish()
    }
}

impl DeviceStageExec {
    /// A stage that runs `plan` in place of `original`, which emits `output`.
    pub(crate) fn new(plan: StagePlan, output: Output, original: Arc<dyn ExecutionPlan>) -> Self {
        let properties = match &output {
            // Unordered, partitioned as the aggregate or the rows it replaced; by the hash of
            // columns only where the stage can compute it: a partitioning by columns a projection
            // dropped (DataFusion's `UnKnownColumn`) promises nothing a parent can use.
            Output::Final { .. } | Output::Rows => {
                let properties = original.properties().as_ref().clone();
                match &properties.partitioning {
                    Partitioning::Hash(exprs, n) if !exprs.iter().all(computable) => {
                        let n = *n;
                        properties.with_partitioning(Partitioning::UnknownPartitioning(n))
                    }
                    _ => properties,
                }
            }
            Output::Partial => PlanProperties::new(
                EquivalenceProperties::new(plan.schema.clone()),
                Partitioning::UnknownPartitioning(original.properties().partitioning.partition_count()),
                EmissionType::Final,
                Boundedness::Bounded,
            ),
        };
        DeviceStageExec {
            plan: Arc::new(plan),
            output,
            original,
            properties: Arc::new(properties),
            metrics: ExecutionPlanMetricsSet::new(),
            shared: Mutex::new(None),
            given_back: Arc::default(),
        }
    }

    /// The stage's run, started on first use (with the context of the first partition executed).
    fn shared_run(&self, context: Arc<TaskContext>) -> SharedRun {
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        shared
            .get_or_insert_with(|| {
                let plan = self.plan.clone();
                let metrics = Metrics::new(&self.metrics);
                let emit = self.emitter();
                let original = self.original.clone();
                let given_back = self.given_back.clone();
                let narrowing = self.output.narrowing();
                async move {
                    let emitted = run(plan, narrowing, &metrics, context).await.and_then(|states| {
                        let _timer = metrics.partition_time.timer();
                        Ok(emit(states)?)
                    });
                    match emitted {
                        Ok(partitions) => Ok(Produced::Partitions(Arc::new(partitions))),
                        Err(Outcome::GiveBack(why)) => {
                            log::info!("arrow-cuda: a device stage gives its work back to DataFusion: {why}");
                            metrics.given_back.add(1);
                            *given_back.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
                            Ok(Produced::GivenBack(reset_plan_states(original).map_err(Arc::new)?))
                        }
                        Err(Outcome::Fail(e)) => Err(Arc::new(e)),
                    }
                }
                .boxed()
                .shared()
            })
            .clone()
    }

    /// What splits the stage's batches (a state batch per device, or a rows stage's batches)
    /// into each partition's: a share of the rows of each batch, or, for output partitioned by
    /// the hash of columns, the rows of that partition (a final aggregate's partitions then merge
    /// their own groups, in parallel); one partition merges every group of an otherwise
    /// partitioned final aggregate.
    fn emitter(&self) -> impl FnOnce(Vec<RecordBatch>) -> DfResult<Vec<Vec<RecordBatch>>> + Send + 'static {
        let partitioning = self.properties.partitioning.clone();
        let output = self.output.clone();
        move |batches| {
            let n = partitioning.partition_count();
            match (output, partitioning) {
                (Output::Partial, _) => Ok(shares(&batches, n)),
                (_, partitioning @ Partitioning::Hash(..)) => {
                    let mut out = vec![Vec::new(); n];
                    for batch in batches {
                        for (p, b) in hash_split(&partitioning, batch)?.into_iter().enumerate() {
                            out[p].push(b);
                        }
                    }
                    Ok(out)
                }
                (Output::Rows, _) => Ok(shares(&batches, n)),
                (Output::Final { .. }, _) => {
                    let mut out = vec![Vec::new(); n];
                    out[0] = batches;
                    Ok(out)
                }
            }
        }
    }

    /// This stage, emitting of its groups only the candidates of the first `k` rows of an order
    /// (`options`) whose first key is column `column` of its output; why not where it cannot.
    pub(crate) fn with_top(&self, column: usize, k: usize, options: SortOptions) -> Result<DeviceStageExec, String> {
        let Output::Final {
            aggr,
            schema,
            having,
            top: None,
        } = &self.output
        else {
            return Err("not a stage of final rows without a cut".into());
        };
        let keys = self.plan.keys.len();
        if keys == 0 || k == 0 || self.plan.table.single_device().is_none() {
            return Err("no groups to cut, or groups on several devices".into());
        }
        let output = column;
        let column = match having.as_ref().and_then(|h| h.projection.as_ref()) {
            Some(p) => p.get(column).copied().ok_or("a sort key outside the stage's output")?,
            None => column,
        };
        let state = state_columns(aggr, keys)
            .get(column)
            .copied()
            .flatten()
            .ok_or("a sort key whose state is not its value")?;
        let dt = self.plan.schema.field(state).data_type();
        if !top_key_supported(dt) {
            return Err(format!("a first sort key of {dt}"));
        }
        let output = Output::Final {
            aggr: aggr.clone(),
            schema: schema.clone(),
            having: having.clone(),
            top: Some(Top {
                column: state,
                output,
                k,
                options,
            }),
        };
        Ok(DeviceStageExec::new(
            self.plan.as_ref().clone(),
            output,
            self.original.clone(),
        ))
    }

    /// The stage's top-k cut, where it has one: the output column of its first sort key, `k`
    /// and the order (what [`with_top`](Self::with_top) took).
    #[cfg(feature = "ballista")]
    pub(crate) fn top(&self) -> Option<(usize, usize, SortOptions)> {
        match &self.output {
            Output::Final { top: Some(t), .. } => Some((t.output, t.k, t.options)),
            _ => None,
        }
    }

    /// The plan the stage replaced.
    #[cfg(feature = "ballista")]
    pub(crate) fn original(&self) -> &Arc<dyn ExecutionPlan> {
        &self.original
    }

    /// What the stage runs.
    pub(crate) fn stage_plan(&self) -> &StagePlan {
        &self.plan
    }

    /// `, given back: WHY` once the stage has given its work back (shown by `EXPLAIN ANALYZE`).
    fn fmt_given_back(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &*self.given_back.lock().unwrap_or_else(PoisonError::into_inner) {
            Some(why) => write!(f, ", given back: {why}"),
            None => Ok(()),
        }
    }
}

impl DisplayAs for DeviceStageExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.plan;
        let list = |v: &[Arc<dyn PhysicalExpr>]| v.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(", ");
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(f, "DeviceStageExec: scan={} columns", p.columns.len())?;
                if p.predicate.is_some() {
                    write!(f, ", pushed predicate")?;
                }
                let steps: Vec<String> = p
                    .steps
                    .iter()
                    .map(|s| match s {
                        Step::Filter(e) => format!("filter({e})"),
                        Step::Join(j) => {
                            let filter = j.filter.as_ref().map(|e| format!(" if {e}")).unwrap_or_default();
                            format!("{:?} join({}){filter}", j.kind, list(&j.probe)).to_lowercase()
                        }
                    })
                    .collect();
                if !steps.is_empty() {
                    write!(f, ", steps=[{}]", steps.join(", "))?;
                }
                if let Some(rows) = &p.rows {
                    write!(f, ", rows=[{}]", list(rows))?;
                    return self.fmt_given_back(f);
                }
                write!(f, ", group_by=[{}]", list(&p.keys))?;
                let aggs: Vec<&str> = p.aggs.iter().map(|a| a.name.as_str()).collect();
                let output = match self.output {
                    Output::Final { .. } => "final",
                    Output::Partial | Output::Rows => "partial",
                };
                write!(f, ", aggr=[{}], output={output}", aggs.join(", "))?;
                if let Output::Final { having, top, .. } = &self.output {
                    if let Some(h) = having {
                        write!(f, ", having={}", h.predicate)?;
                    }
                    if let Some(t) = top {
                        let order = if t.options.descending { "desc" } else { "asc" };
                        let schema = self.schema();
                        let key = schema.field(t.output).name();
                        write!(f, ", top={} by {key} {order}", t.k)?;
                    }
                }
                self.fmt_given_back(f)
            }
            DisplayFormatType::TreeRender => match &p.rows {
                Some(rows) => write!(f, "rows={}", rows.len()),
                None => write!(f, "group_by={}\naggr={}", p.keys.len(), p.aggs.len()),
            },
        }
    }
}

/// Whether `expr` reads only columns that exist (no `UnKnownColumn`).
fn computable(expr: &Arc<dyn PhysicalExpr>) -> bool {
    !expr
        .exists(|e| Ok(e.downcast_ref::<UnKnownColumn>().is_some()))
        .unwrap_or(true)
}

/// The rows of `batch` in each partition of `partitioning` (a hash partitioning), split as
/// DataFusion's `RepartitionExec` splits them, by several threads for a large batch.
fn hash_split(partitioning: &Partitioning, batch: RecordBatch) -> DfResult<Vec<RecordBatch>> {
    let (n, rows) = (partitioning.partition_count(), batch.num_rows());
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(rows.div_ceil(MIN_SPLIT_ROWS))
        .max(1);
    let split = |chunk: RecordBatch| -> DfResult<Vec<Vec<RecordBatch>>> {
        let mut out = vec![Vec::new(); n];
        let mut partitioner = BatchPartitioner::try_new(partitioning.clone(), Time::new(), 0, 1)?;
        partitioner.partition(chunk, |p, b| {
            out[p].push(b);
            Ok(())
        })?;
        Ok(out)
    };
    let schema = batch.schema();
    if threads == 1 {
        return split(batch)?
            .into_iter()
            .map(|p| Ok(concat_batches(&schema, &p)?))
            .collect();
    }
    let panicked = || DataFusionError::Internal("a thread splitting a device stage's rows panicked".into());
    let pieces = std::thread::scope(|s| {
        let running: Vec<_> = (0..threads)
            .map(|t| {
                let (start, end) = (rows * t / threads, rows * (t + 1) / threads);
                let chunk = batch.slice(start, end - start);
                s.spawn(move || split(chunk))
            })
            .collect();
        running
            .into_iter()
            .map(|h| h.join().map_err(|_| panicked())?)
            .collect::<DfResult<Vec<_>>>()
    })?;
    // Each partition's pieces in one batch: a device's groups, each once.
    std::thread::scope(|s| {
        let running: Vec<_> = (0..n)
            .map(|p| {
                let (pieces, schema) = (&pieces, &schema);
                s.spawn(move || concat_batches(schema, pieces.iter().flat_map(|t| &t[p])))
            })
            .collect();
        running
            .into_iter()
            .map(|h| Ok(h.join().map_err(|_| panicked())??))
            .collect()
    })
}

/// Rows a thread splits at least.
const MIN_SPLIT_ROWS: usize = 1 << 16;

/// Each of `n` partitions' share of the rows of `batches`.
fn shares(batches: &[RecordBatch], n: usize) -> Vec<Vec<RecordBatch>> {
    (0..n)
        .map(|p| {
            batches
                .iter()
                .map(|b| {
                    let (start, end) = (b.num_rows() * p / n, b.num_rows() * (p + 1) / n);
                    b.slice(start, end - start)
                })
                .collect()
        })
        .collect()
}

/// The stage's metrics for one execution.
struct Metrics {
    rows_in: Count,
    device_time: Time,
    compile_time: Time,
    bytes_to_host: Count,
    /// Making the state batch on the device and copying it to the host (part of `device_time`).
    emit_time: Time,
    /// Splitting the state batches into partitions.
    partition_time: Time,
    /// 1 when the stage gave its work back to DataFusion's operators.
    given_back: Count,
}

impl Metrics {
    fn new(set: &ExecutionPlanMetricsSet) -> Self {
        Metrics {
            rows_in: MetricBuilder::new(set).counter("rows_in", 0),
            device_time: MetricBuilder::new(set).elapsed_compute(0),
            compile_time: MetricBuilder::new(set).subset_time("kernel_compile_time", 0),
            bytes_to_host: MetricBuilder::new(set).counter("bytes_to_host", 0),
            emit_time: MetricBuilder::new(set).subset_time("emit_time", 0),
            partition_time: MetricBuilder::new(set).subset_time("partition_time", 0),
            given_back: MetricBuilder::new(set).counter("given_back", 0),
        }
    }
}

/// The build sides for a stage on the host: every one's rows there.
fn host_builds(builds: &[BuildRows]) -> StageResult<Vec<RecordBatch>> {
    builds
        .iter()
        .map(|b| match b {
            BuildRows::Host(b) => Ok(b.clone()),
            BuildRows::Device(_) => Err(Outcome::GiveBack("a build side on a device".into())),
        })
        .collect()
}

/// A rows stage's output over `batches`, those of one device: a batch for each input batch of
/// which the pipeline keeps rows.
fn rows_of<'a>(
    plan: &StagePlan,
    device: Device,
    stream: &Stream,
    batches: impl Iterator<Item = &'a DeviceRecordBatch>,
    builds: &[BuildRows],
    metrics: &Metrics,
) -> StageResult<Vec<RecordBatch>> {
    let mut out = Vec::new();
    if device.is_host_accessible() {
        let stage = HostStage::new(plan, &host_builds(builds)?)?;
        for b in batches {
            metrics.rows_in.add(b.num_rows());
            out.extend(stage.rows(b, stream)?);
        }
        return Ok(out);
    }
    let batches: Vec<_> = batches.collect();
    let mut stage = DeviceStage::new(plan, device, stream, &batches, builds)?;
    metrics.compile_time.add_duration(stage.compile_time);
    for b in batches {
        metrics.rows_in.add(b.num_rows());
        if let Some((rows, bytes)) = stage.rows(b)? {
            metrics.bytes_to_host.add(bytes as usize);
            out.push(rows);
        }
    }
    Ok(out)
}

/// Runs the stage over every partition of the table: one state batch per device (narrowed by
/// `narrowing` where one device holds every group), or a rows stage's batches.
async fn run(
    plan: Arc<StagePlan>,
    narrowing: Option<Narrowing>,
    metrics: &Metrics,
    context: Arc<TaskContext>,
) -> StageResult<Vec<RecordBatch>> {
    let table = &plan.table;
    let mut devices: Vec<Device> = table.partition_devices.clone();
    devices.sort();
    devices.dedup();
    let narrowing = narrowing.filter(|_| devices.len() == 1);
    // Build sides stay on the device only for a stage on one device.
    let build_device = table.single_device().unwrap_or(Device::Cpu);
    let builds = build_sides(&plan, build_device, context).await?;
    // An inner or semi join with nothing to match keeps no row.
    let none_kept = plan
        .joins()
        .zip(&builds)
        .any(|(j, b)| b.num_rows() == 0 && matches!(j.kind, JoinKind::Inner | JoinKind::Semi));
    let mut out = Vec::with_capacity(devices.len());
    for device in devices {
        let lease = table.lanes[&device].acquire().await?;
        let stream = lease.stream();
        let started = Instant::now();
        let batches = table
            .partitions
            .iter()
            .zip(&table.partition_devices)
            .filter(|(_, d)| **d == device)
            .flat_map(|(p, _)| p.iter());
        if plan.rows.is_some() {
            if !none_kept {
                out.extend(rows_of(&plan, device, stream, batches, &builds, metrics)?);
            }
            metrics.device_time.add_duration(started.elapsed());
            continue;
        }
        // Without keys there is always one group, as DataFusion's partial aggregate emits.
        let host_state = |groups: Groups| {
            let groups = if plan.keys.is_empty() && groups.count == 0 {
                plan.initial_groups(1)
            } else {
                groups
            };
            let state = state_batch(&plan, &groups)?;
            Ok::<_, Outcome>(match &narrowing {
                Some(n) => narrow_on_host(state, n)?,
                None => state,
            })
        };
        let batch = if none_kept {
            host_state(plan.initial_groups(0))?
        } else if device.is_host_accessible() {
            let mut stage = HostStage::new(&plan, &host_builds(&builds)?)?;
            for b in batches {
                metrics.rows_in.add(b.num_rows());
                stage.add(b, stream)?;
            }
            host_state(stage.finish()?)?
        } else {
            let batches: Vec<_> = batches.collect();
            let mut stage = DeviceStage::new(&plan, device, stream, &batches, &builds)?;
            metrics.compile_time.add_duration(stage.compile_time);
            for b in batches {
                metrics.rows_in.add(b.num_rows());
                stage.add(b)?;
            }
            let emitting = Instant::now();
            let (batch, bytes) = stage.finish(narrowing.as_ref())?;
            metrics.emit_time.add_duration(emitting.elapsed());
            metrics.bytes_to_host.add(bytes as usize);
            batch
        };
        metrics.device_time.add_duration(started.elapsed());
        out.push(batch);
    }
    Ok(out)
}

impl ExecutionPlan for DeviceStageExec {
    fn name(&self) -> &str {
        "DeviceStageExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    /// The build sides of the stage's hash joins, which DataFusion's plans produce.
    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.plan.joins().map(|j| &j.build).collect()
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        for e in self.plan.expressions() {
            if f(e)? == TreeNodeRecursion::Stop {
                return Ok(TreeNodeRecursion::Stop);
            }
        }
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(self: Arc<Self>, children: Vec<Arc<dyn ExecutionPlan>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        let same = self.children().len() == children.len()
            && self.children().iter().zip(&children).all(|(a, b)| Arc::ptr_eq(a, b));
        if same {
            return Ok(self);
        }
        let mut plan = self.plan.as_ref().clone();
        let mut children = children.into_iter();
        for step in &mut plan.steps {
            if let Step::Join(j) = step {
                j.build = children
                    .next()
                    .ok_or_else(|| DataFusionError::Internal("a device stage lost a join's build side".into()))?;
            }
        }
        Ok(Arc::new(DeviceStageExec::new(
            plan,
            self.output.clone(),
            self.original.clone(),
        )))
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> DfResult<SendableRecordBatchStream> {
        let partitions = self.properties.partitioning.partition_count();
        if partition >= partitions {
            return Err(DataFusionError::Internal(format!(
                "a device stage of {partitions} partitions has no partition {partition}"
            )));
        }
        let run = self.shared_run(context.clone());
        let rows = MetricBuilder::new(&self.metrics).output_rows(partition);
        let merge_time = MetricBuilder::new(&self.metrics).subset_time("merge_time", partition);
        let last = match &self.output {
            Output::Partial | Output::Rows => None,
            Output::Final {
                aggr, schema, having, ..
            } => Some((aggr.clone(), schema.clone(), self.plan.keys.len(), having.clone())),
        };
        let fut = async move {
            let stream: BoxStream<'static, DfResult<RecordBatch>> = match run.await.map_err(DataFusionError::Shared)? {
                Produced::Partitions(batches) => {
                    let states = &batches[partition];
                    let out = match last {
                        None => states.clone(),
                        Some((_, _, keys, _)) if keys > 0 && states.iter().all(|b| b.num_rows() == 0) => vec![],
                        Some((aggr, schema, keys, having)) => {
                            let _timer = merge_time.timer();
                            let rows = final_batch(&aggr, keys, &schema, states)?;
                            vec![match having {
                                Some(h) => {
                                    let kept = filtered(&rows, &h.predicate)?;
                                    match &h.projection {
                                        Some(p) => kept.project(p)?,
                                        None => kept,
                                    }
                                }
                                None => rows,
                            }]
                        }
                    };
                    out.iter().for_each(|b| rows.add(b.num_rows()));
                    futures::stream::iter(out.into_iter().map(Ok)).boxed()
                }
                Produced::GivenBack(original) => original.execute(partition, context)?.boxed(),
            };
            DfResult::Ok(stream)
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            futures::stream::once(fut).try_flatten(),
        )))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }
}
