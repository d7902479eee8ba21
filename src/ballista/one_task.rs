//! [`OneTaskExec`] and [`OneTaskRule`]: GPU scans and device stages run in one Ballista task each.
//!
//! Ballista runs a stage of its plan as tasks, each over some of the stage's partitions, and
//! narrows each task's copy of the plan to its partitions by rewriting the leaves it knows (file
//! scans, in-memory scans, shuffle readers). A GPU scan or a device stage is not among them: each
//! task would run all of its partitions, and the rows would come back once per task. So the rule
//! puts each of them under a [`OneTaskExec`], one partition that runs all of its input's, which
//! Ballista runs as one task, and restores the partitioning above it with a `RepartitionExec`
//! (Ballista turns a hash repartitioning into a shuffle and drops the others). A device stage then
//! runs once per query, on one executor, as it runs once in one process.

use std::fmt;
use std::sync::Arc;

use ::datafusion::common::DataFusionError;
use ::datafusion::common::config::ConfigOptions;
use ::datafusion::common::tree_node::{Transformed, TreeNode, TreeNodeRecursion};
use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::TaskContext;
use ::datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use ::datafusion::physical_optimizer::PhysicalOptimizerRule;
use ::datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use ::datafusion::physical_plan::repartition::RepartitionExec;
use ::datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use ::datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, Distribution, ExecutionPlan, InputDistributionRequirements, PlanProperties,
    SendableRecordBatchStream,
};

use crate::datafusion::{DeviceStageExec, GpuScan};

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

/// Puts each GPU scan and device stage of more than one partition under a [`OneTaskExec`],
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
    fn optimize(&self, plan: Arc<dyn ExecutionPlan>, _config: &ConfigOptions) -> DfResult<Arc<dyn ExecutionPlan>> {
        let out = plan.transform_down(|node| {
            if node.downcast_ref::<OneTaskExec>().is_some() {
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
            if node.properties().partitioning.partition_count() > 1 {
                Ok(Transformed::new(Self::wrap(node)?, true, TreeNodeRecursion::Jump))
            } else {
                Ok(Transformed::new(node, false, TreeNodeRecursion::Jump))
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
