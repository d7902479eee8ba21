//! How GPU scans and device stages run in Ballista's tasks: [`ShareExec`] splits one's partitions
//! between the tasks of its stage, [`OneTaskExec`] runs all of them in one task, and
//! [`OneTaskRule`] puts each under one or the other.
//!
//! Ballista runs a stage of its plan as tasks, each over some of the stage's partitions, and
//! narrows each task's copy of the plan to its partitions by rewriting the leaves it knows (file
//! scans, in-memory scans, shuffle readers). A GPU scan or a device stage is not among them: each
//! task would run all of its partitions, and the rows would come back once per task.
//!
//! - A GPU scan, or a device stage whose plan works partition by partition (filters,
//!   projections, a partial aggregate; no join, no final aggregate), over Parquet files, goes
//!   under a [`ShareExec`]; a stage that would also finish the aggregation is first split into
//!   such a stage and DataFusion's final aggregate. The node's one child is an in-memory scan
//!   with a row per partition naming it, which Ballista narrows like any other; the executor that
//!   decodes the task reads from it which partitions are the task's, and stages only those (see
//!   [`GpuTableCache`](super::GpuTableCache)). A table's partitions are so split between the
//!   executors that run the stage's tasks.
//! - Anything else (a stage with joins, whose build sides it reads whole; a table staged from
//!   CSV) goes under a [`OneTaskExec`], one partition that runs all of its input's, which
//!   Ballista runs as one task, and the partitioning is restored above it with a
//!   `RepartitionExec` (Ballista turns a hash repartitioning into a shuffle and drops the
//!   others). Such a stage runs once per query, on one executor, as it runs once in one process.

use std::fmt;
use std::sync::Arc;

use ::datafusion::arrow::array::UInt32Array;
use ::datafusion::arrow::datatypes::{DataType, Field, Schema};
use ::datafusion::catalog::memory::MemorySourceConfig;
use ::datafusion::common::DataFusionError;
use ::datafusion::common::config::ConfigOptions;
use ::datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::TaskContext;
use ::datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use ::datafusion::physical_optimizer::PhysicalOptimizerRule;
use ::datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use ::datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use ::datafusion::physical_plan::execution_plan::{
    Boundedness, ChildrenPropertiesMode, EmissionType, ReplaceChildrenOptions,
};
use ::datafusion::physical_plan::filter::FilterExec;
use ::datafusion::physical_plan::projection::ProjectionExec;
use ::datafusion::physical_plan::repartition::RepartitionExec;
use ::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use ::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, InputDistributionRequirements, PlanProperties,
    SendableRecordBatchStream, displayable,
};
use arrow_array::RecordBatch;

use crate::datafusion::{DeviceStageExec, DeviceStageRule, GpuScan};

type DfResult<T> = Result<T, DataFusionError>;

/// One partition holding the rows of every partition of its input, which it runs in the same
/// task. It requires its input as a single partition, so Ballista gives the plan under it whole to
/// that task rather than narrowing it to a share of the partitions.
#[derive(Debug)]
pub(crate) struct OneTaskExec {
    input: Arc<dyn ExecutionPlan>,
    properties: Arc<PlanProperties>,
}

impl OneTaskExec {
    /// One partition over all of `input`'s.
    pub(crate) fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        let properties = PlanProperties::new(
            EquivalenceProperties::new(input.schema()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        OneTaskExec {
            input,
            properties: Arc::new(properties),
        }
    }
}

impl DisplayAs for OneTaskExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OneTaskExec")
    }
}

impl ExecutionPlan for OneTaskExec {
    fn name(&self) -> &str {
        "OneTaskExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        InputDistributionRequirements::new(vec![Distribution::SinglePartition])
    }

    fn with_new_children(self: Arc<Self>, children: Vec<Arc<dyn ExecutionPlan>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        match <[_; 1]>::try_from(children) {
            Ok([input]) => Ok(Arc::new(OneTaskExec::new(input))),
            Err(children) => Err(DataFusionError::Internal(format!(
                "OneTaskExec has one input, not {}",
                children.len()
            ))),
        }
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> DfResult<SendableRecordBatchStream> {
        if partition != 0 {
            return Err(DataFusionError::Internal(format!(
                "OneTaskExec has one partition, not {partition}"
            )));
        }
        let n = self.input.properties().partitioning.partition_count();
        let streams = (0..n)
            .map(|p| self.input.execute(p, context.clone()))
            .collect::<DfResult<Vec<_>>>()?;
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            futures::stream::select_all(streams),
        )))
    }
}

/// A GPU scan or a device stage whose partitions the tasks of a Ballista stage share: its one
/// child, which Ballista narrows to each task's share, is an in-memory scan with one row per
/// partition of the node (its number), and the node runs its inner plan's partitions on the
/// partitions it has (the inner plan is not a child: Ballista neither narrows nor cuts it).
///
/// The executor that decodes a task stages only the task's partitions of the inner plan's table
/// (see [`GpuPhysicalCodec`](super::GpuPhysicalCodec)); the inner plan's other partitions are
/// empty there, and so the node runs all of them: partition `j` of the node runs the inner
/// partitions `p` with `p % partitions == j`.
#[derive(Debug)]
pub(crate) struct ShareExec {
    inner: Arc<dyn ExecutionPlan>,
    shares: Arc<dyn ExecutionPlan>,
    /// The inner partitions the node has, read from `shares`.
    partitions: Vec<usize>,
    properties: Arc<PlanProperties>,
}

impl ShareExec {
    /// The node over every partition of `inner`.
    pub(crate) fn new(inner: Arc<dyn ExecutionPlan>) -> DfResult<Self> {
        let n = inner.properties().partitioning.partition_count();
        let schema = Arc::new(Schema::new(vec![Field::new("partition", DataType::UInt32, false)]));
        let rows = (0..n)
            .map(|p| {
                let column = UInt32Array::from(vec![p as u32]);
                Ok(vec![RecordBatch::try_new(schema.clone(), vec![Arc::new(column)])?])
            })
            .collect::<DfResult<Vec<_>>>()?;
        let shares = MemorySourceConfig::try_new_exec(&rows, schema, None)?;
        Self::with_shares(inner, shares)
    }

    /// The node over the partitions of `inner` that `shares` (an in-memory scan as
    /// [`ShareExec::new`] makes it, narrowed or not) names.
    pub(crate) fn with_shares(inner: Arc<dyn ExecutionPlan>, shares: Arc<dyn ExecutionPlan>) -> DfResult<Self> {
        let partitions = shared_partitions(&shares)?;
        let properties = PlanProperties::new(
            EquivalenceProperties::new(inner.schema()),
            Partitioning::UnknownPartitioning(partitions.len()),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Ok(ShareExec {
            inner,
            shares,
            partitions,
            properties: Arc::new(properties),
        })
    }

    /// The plan whose partitions are shared.
    pub(crate) fn inner(&self) -> &Arc<dyn ExecutionPlan> {
        &self.inner
    }
}

/// The partitions that `shares` (the child of a [`ShareExec`]) names.
pub(crate) fn shared_partitions(shares: &Arc<dyn ExecutionPlan>) -> DfResult<Vec<usize>> {
    let not_shares = || DataFusionError::Internal("a ShareExec's child is not its list of partitions".into());
    let memory = shares
        .downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<MemorySourceConfig>())
        .ok_or_else(not_shares)?;
    let mut partitions = Vec::new();
    for batch in memory.partitions().iter().flatten() {
        let column = batch
            .column(0)
            .as_any()
            .downcast_ref::<UInt32Array>()
            .ok_or_else(not_shares)?;
        partitions.extend(column.values().iter().map(|&p| p as usize));
    }
    Ok(partitions)
}

impl DisplayAs for ShareExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShareExec: partitions={:?}, over ", self.partitions)?;
        let inner = displayable(self.inner.as_ref()).indent(false).to_string();
        write!(f, "{}", inner.trim_end().replace('\n', " <- "))
    }
}

impl ExecutionPlan for ShareExec {
    fn name(&self) -> &str {
        "ShareExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.shares]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> DfResult<TreeNodeRecursion>,
    ) -> DfResult<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(self: Arc<Self>, children: Vec<Arc<dyn ExecutionPlan>>) -> DfResult<Arc<dyn ExecutionPlan>> {
        match <[_; 1]>::try_from(children) {
            Ok([shares]) => Ok(Arc::new(ShareExec::with_shares(self.inner.clone(), shares)?)),
            Err(children) => Err(DataFusionError::Internal(format!(
                "ShareExec has one input, not {}",
                children.len()
            ))),
        }
    }

    fn execute(&self, partition: usize, context: Arc<TaskContext>) -> DfResult<SendableRecordBatchStream> {
        let k = self.partitions.len();
        if partition >= k {
            return Err(DataFusionError::Internal(format!(
                "ShareExec has {k} partitions, not {partition}"
            )));
        }
        let n = self.inner.properties().partitioning.partition_count();
        let streams = (partition..n)
            .step_by(k)
            .map(|p| self.inner.execute(p, context.clone()))
            .collect::<DfResult<Vec<_>>>()?;
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema(),
            futures::stream::select_all(streams),
        )))
    }
}

/// Whether each partition of `plan` (a device stage's replaced plan) depends on the same
/// partition of its GPU scans only, and they are staged from Parquet files: filters,
/// projections and partial aggregates over such scans. Such a plan over a share of its tables'
/// partitions gives that share of its rows (or of its partial aggregate states).
fn shareable(plan: &Arc<dyn ExecutionPlan>) -> bool {
    let local = plan.downcast_ref::<FilterExec>().is_some()
        || plan.downcast_ref::<ProjectionExec>().is_some()
        || plan
            .downcast_ref::<AggregateExec>()
            .is_some_and(|a| *a.mode() == AggregateMode::Partial);
    if local {
        return plan.children().into_iter().all(shareable);
    }
    plan.downcast_ref::<DataSourceExec>()
        .and_then(|s| s.data_source().downcast_ref::<GpuScan>())
        .and_then(|scan| scan.table().source.as_ref())
        .is_some_and(|source| source.format().eq_ignore_ascii_case("parquet"))
}

/// `stage`, a device stage that finishes an aggregation over the partial aggregate of a plan that
/// [works partition by partition](shareable), as DataFusion's final aggregate (and the exchange
/// under it) over a device stage of the partial aggregate alone, whose partitions the tasks of its
/// Ballista stage share: each executor aggregates its share of the table on its device, and the
/// partial states meet after Ballista's shuffle. `None` for any other stage.
fn with_partial_stage(stage: &DeviceStageExec, config: &ConfigOptions) -> DfResult<Option<Arc<dyn ExecutionPlan>>> {
    let original = stage.original();
    let is_final = original
        .downcast_ref::<AggregateExec>()
        .is_some_and(|a| matches!(a.mode(), AggregateMode::Final | AggregateMode::FinalPartitioned));
    let [exchange] = original.children()[..] else {
        return Ok(None);
    };
    let exchanged = exchange
        .downcast_ref::<RepartitionExec>()
        .is_some_and(|r| matches!(r.partitioning(), Partitioning::Hash(..)))
        || exchange.downcast_ref::<CoalescePartitionsExec>().is_some();
    let [partial] = exchange.children()[..] else {
        return Ok(None);
    };
    let is_partial = partial
        .downcast_ref::<AggregateExec>()
        .is_some_and(|a| *a.mode() == AggregateMode::Partial);
    if !(stage.children().is_empty() && is_final && exchanged && is_partial && shareable(partial)) {
        return Ok(None);
    }
    let lowered = DeviceStageRule::new()
        .with_host_stages(true)
        .optimize(partial.clone(), config)?;
    if lowered.downcast_ref::<DeviceStageExec>().is_none() {
        return Ok(None);
    }
    let recompute = || ReplaceChildrenOptions::new(ChildrenPropertiesMode::Recompute);
    let exchange = exchange
        .clone()
        .replace_children(vec![Arc::new(ShareExec::new(lowered)?)], recompute())?;
    Ok(Some(original.clone().replace_children(vec![exchange], recompute())?))
}

/// Puts each GPU scan and device stage of more than one partition under a [`ShareExec`] where its
/// partitions can be split between tasks (a scan, or a stage that [works partition by
/// partition](shareable), over Parquet files; a stage that finishes such a stage's aggregation is
/// first [split in two](with_partial_stage)), and under a [`OneTaskExec`] otherwise,
/// repartitioned above it as it was (by the same hash, or round-robin into as many partitions);
/// the plans under a stage (its joins' build sides) stay as they are, run by the stage's task.
/// Runs after every other physical optimizer rule, [`DeviceStageRule`](crate::datafusion::DeviceStageRule) included.
#[derive(Debug, Default)]
pub(crate) struct OneTaskRule;

impl OneTaskRule {
    fn wrap(node: Arc<dyn ExecutionPlan>) -> DfResult<Arc<dyn ExecutionPlan>> {
        let partitioning = node.properties().partitioning.clone();
        let n = partitioning.partition_count();
        let one = Arc::new(OneTaskExec::new(node));
        let partitioning = match partitioning {
            hash @ Partitioning::Hash(..) => hash,
            _ => Partitioning::RoundRobinBatch(n),
        };
        Ok(Arc::new(RepartitionExec::try_new(one, partitioning)?))
    }
}

impl PhysicalOptimizerRule for OneTaskRule {
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, config: &ConfigOptions) -> DfResult<Arc<dyn ExecutionPlan>> {
        let out = plan.transform_down(|node| {
            if node.downcast_ref::<OneTaskExec>().is_some() || node.downcast_ref::<ShareExec>().is_some() {
                return Ok(Transformed::new(node, false, TreeNodeRecursion::Jump));
            }
            let stage = node.downcast_ref::<DeviceStageExec>().is_some();
            let scan = node
                .downcast_ref::<DataSourceExec>()
                .is_some_and(|s| s.data_source().downcast_ref::<GpuScan>().is_some());
            if !(stage || scan) {
                return Ok(Transformed::no(node));
            }
            // A stage's build sides run in its task, whole.
            if node.properties().partitioning.partition_count() <= 1 {
                return Ok(Transformed::new(node, false, TreeNodeRecursion::Jump));
            }
            if let Some(split) = node
                .downcast_ref::<DeviceStageExec>()
                .map(|stage| with_partial_stage(stage, config))
                .transpose()?
                .flatten()
            {
                return Ok(Transformed::new(split, true, TreeNodeRecursion::Jump));
            }
            let shared = match node.downcast_ref::<DeviceStageExec>() {
                Some(stage) => stage.children().is_empty() && shareable(stage.original()),
                None => shareable(&node),
            };
            if shared {
                Ok(Transformed::new(
                    Arc::new(ShareExec::new(node)?),
                    true,
                    TreeNodeRecursion::Jump,
                ))
            } else {
                Ok(Transformed::new(Self::wrap(node)?, true, TreeNodeRecursion::Jump))
            }
        })?;
        Ok(out.data)
    }

    fn name(&self) -> &str {
        "arrow_cuda_ballista_one_task"
    }

    fn schema_check(&self) -> bool {
        true
    }
}
