//! The build sides of a stage's hash joins: a GPU table scan on the stage's device is filtered,
//! projected and concatenated there ([`device_batches`](GpuScan::device_batches),
//! [`concat_batches`]) and never leaves it, and so are the rows a rows stage keeps over such a
//! table ([`DeviceStage::device_rows`]); any other build side is a DataFusion plan whose rows the
//! stage collects on the host (and copies to the device when it runs there).

use std::sync::Arc;

use ::datafusion::datasource::source::DataSourceExec;
use ::datafusion::execution::TaskContext;
use ::datafusion::physical_plan::{ExecutionPlan, collect};
use arrow_array::RecordBatch;
use arrow_select::concat::concat_batches as concat_host;

use super::super::device_concat::{concat_batches, concatenable};
use super::super::source::GpuScan;
use super::device::DeviceStage;
use super::exec::DeviceStageExec;
use super::layout::StagePlan;
use super::{Outcome, StageResult};
use crate::array::DeviceRecordBatch;
use crate::device::Device;

/// A join's build side, all its rows in one batch.
pub(crate) enum BuildRows {
    Host(RecordBatch),
    Device(DeviceRecordBatch),
}

impl BuildRows {
    pub(crate) fn num_rows(&self) -> usize {
        match self {
            BuildRows::Host(b) => b.num_rows(),
            BuildRows::Device(b) => b.num_rows(),
        }
    }
}

/// The GPU table scan that `build` is, when its rows can stay on `device` (holding the whole
/// table) for a stage there: no limit, and columns [`concat_batches`] takes. (A stage on the CPU
/// device reads such a scan's rows where they are, through DataFusion.)
pub(crate) fn device_scan(build: &Arc<dyn ExecutionPlan>, device: Device) -> Option<&GpuScan> {
    let scan = build
        .downcast_ref::<DataSourceExec>()?
        .data_source()
        .downcast_ref::<GpuScan>()?;
    let table = scan.table();
    let here = table.partition_devices.iter().all(|d| *d == device);
    let types = build.schema().fields().iter().all(|f| concatenable(f.data_type()));
    (here && types && scan.limit().is_none()).then_some(scan)
}

/// The rows stage that `build` is, when it runs on `device` (holding its whole table) and its
/// kept rows can stay there for a stage on that device: no joins of its own, and output columns
/// [`concat_batches`] takes.
pub(crate) fn device_rows(build: &Arc<dyn ExecutionPlan>, device: Device) -> Option<&StagePlan> {
    let plan = build.downcast_ref::<DeviceStageExec>()?.stage_plan();
    let here = plan.table.partition_devices.iter().all(|d| *d == device);
    let types = build.schema().fields().iter().all(|f| concatenable(f.data_type()));
    (plan.rows.is_some() && plan.joins().next().is_none() && here && types).then_some(plan)
}

/// Whether `build`'s rows stay on `device` for a stage there (see [`device_scan`] and
/// [`device_rows`]).
pub(crate) fn stays_on(build: &Arc<dyn ExecutionPlan>, device: Device) -> bool {
    device_scan(build, device).is_some() || device_rows(build, device).is_some()
}

/// The rows of each join's build side of `plan`, for a stage on `device`: those of GPU scans
/// there stay on the device; the others DataFusion runs (all at once).
pub(crate) async fn build_sides(
    plan: &StagePlan,
    device: Device,
    context: Arc<TaskContext>,
) -> StageResult<Vec<BuildRows>> {
    let runs = plan.joins().map(|j| {
        let (build, context) = (j.build.clone(), context.clone());
        async move {
            let rows = match on_device(&build, device).await? {
                Some(rows) => rows,
                None => {
                    let batches = collect(build.clone(), context).await?;
                    BuildRows::Host(concat_host(&build.schema(), &batches)?)
                }
            };
            // A match is a 32-bit row index.
            if rows.num_rows() >= u32::MAX as usize {
                return Err(Outcome::GiveBack(format!(
                    "a join's build side of {} rows",
                    rows.num_rows()
                )));
            }
            Ok(rows)
        }
    });
    futures::future::try_join_all(runs).await
}

/// The rows of `build` concatenated on `device`, when it is a GPU scan there (see
/// [`device_scan`]) whose filtered columns the device compacts, or a rows stage there (see
/// [`device_rows`]); an empty build side comes as an empty host batch.
async fn on_device(build: &Arc<dyn ExecutionPlan>, device: Device) -> StageResult<Option<BuildRows>> {
    if !matches!(device, Device::Cuda(_)) {
        return Ok(None);
    }
    let batches = if let Some(scan) = device_scan(build, device) {
        let lease = scan.table().lanes[&device].acquire().await?;
        let stream = lease.stream();
        let Some(batches) = scan.device_batches(stream)? else {
            return Ok(None);
        };
        concatenated(build, batches, device, stream)?
    } else if let Some(plan) = device_rows(build, device) {
        let lease = plan.table.lanes[&device].acquire().await?;
        let stream = lease.stream();
        let table: Vec<&DeviceRecordBatch> = plan.table.partitions.iter().flatten().collect();
        let mut stage = DeviceStage::new(plan, device, stream, &table, &[])?;
        let mut kept = Vec::new();
        for b in table {
            kept.extend(stage.device_rows(b)?);
        }
        concatenated(build, kept, device, stream)?
    } else {
        return Ok(None);
    };
    Ok(Some(batches))
}

/// `batches` (of `build`'s schema, on `device`) as one batch there; an empty host batch when they
/// hold no row.
fn concatenated(
    build: &Arc<dyn ExecutionPlan>,
    batches: Vec<DeviceRecordBatch>,
    device: Device,
    stream: &crate::device::Stream,
) -> StageResult<BuildRows> {
    if batches.iter().all(|b| b.num_rows() == 0) {
        return Ok(BuildRows::Host(RecordBatch::new_empty(build.schema())));
    }
    Ok(BuildRows::Device(concat_batches(
        build.schema(),
        &batches,
        device,
        stream,
    )?))
}
