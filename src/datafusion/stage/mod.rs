//! Device stages: the part of a query plan over a GPU table that runs where the table lives.
//!
//! [`DeviceStageRule`] is a DataFusion physical optimizer rule. Installed with
//! [`with_device_stages`], it finds each partial aggregate (`AggregateExec` in `Partial` mode)
//! whose input is a [`GpuScan`](super::GpuScan) through projections, filters and round-robin
//! repartitioning, and replaces that whole subtree with one [`DeviceStageExec`]. The
//! stage evaluates the scan's pushed-down predicate, the filters, the computed projections, the
//! group keys and the aggregates on the device in one or two passes over the columns (see
//! `codegen.rs`), keeps its groups and accumulators in device memory, and copies only the groups'
//! partial state to the host: a batch with exactly the schema of DataFusion's partial aggregate,
//! which DataFusion's `Final` aggregate above merges as it would merge its own.
//!
//! # Where the rule sits
//!
//! The rule is appended after DataFusion's own physical optimizer rules. Only then is the plan's
//! shape final: `EnforceDistribution` has split aggregates into `Partial` and `Final` with the
//! repartitioning between them, projections and filters have been pushed down as far as they go,
//! and repartitioning has been placed. A stage replaces a subtree that produces the partial state
//! in one partition: every node above it (the repartitioning, the `Final` aggregate, sorts) accepts
//! any number of input partitions, so the plan stays valid and its schema does not change.
//!
//! # What a stage runs
//!
//! - expressions: see `expr.rs` (arithmetic on integers, floats and `Decimal128` with DataFusion's
//!   types, precision and overflow errors; comparisons; three-valued `AND`/`OR`/`NOT`; `IS [NOT]
//!   NULL`; `CASE WHEN`; `CAST` between integer, float and decimal types; `IN` lists; `LIKE` with `%`
//!   and `_`; `date_part` of year and month);
//! - group keys of integers, dates, booleans, decimals and strings of at most 15 bytes (a longer
//!   string found while running makes the stage give its work back);
//! - `COUNT`, `SUM` and `AVG` of integers, decimals (exact, 128-bit) and floats, `MIN` and `MAX`
//!   of integers and dates, each with an optional `FILTER (WHERE ...)`.
//!
//! Anything else stays with DataFusion, unchanged. Without NVRTC or a GPU the rule leaves every
//! plan alone and logs one line saying why.
//!
//! # The CPU device
//!
//! A stage over a table on the CPU device runs its host implementation (`host.rs`, DataFusion's
//! own expression evaluation and the same group and accumulator layout as the kernels). The rule
//! places such stages only when asked ([`DeviceStageRule::with_host_stages`]): the tests do, so
//! that CI proves the plan rewrite, the partial state and DataFusion's merge of it without a GPU.

mod codegen;
mod device;
mod exec;
mod expr;
mod host;
mod layout;
mod output;
mod rule;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use ::datafusion::common::DataFusionError;
use ::datafusion::execution::SessionStateBuilder;
use arrow_schema::ArrowError;

pub use exec::DeviceStageExec;
pub use rule::DeviceStageRule;

use crate::error::Error;

/// Adds [`DeviceStageRule`] to a session's physical optimizer rules, after DataFusion's own:
///
/// ```no_run
/// use datafusion::execution::SessionStateBuilder;
/// use datafusion::prelude::SessionContext;
///
/// let state = arrow_cuda::datafusion::with_device_stages(SessionStateBuilder::new().with_default_features()).build();
/// let ctx = SessionContext::new_with_state(state);
/// ```
pub fn with_device_stages(builder: SessionStateBuilder) -> SessionStateBuilder {
    builder.with_physical_optimizer_rule(Arc::new(DeviceStageRule::new()))
}

/// Why a stage did not produce its output.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The device cannot finish this work; DataFusion's own plan runs it instead.
    GiveBack(String),
    /// An error DataFusion would also report (overflow, division by zero) or a failure.
    Fail(DataFusionError),
}

/// The result of a stage's steps.
pub(crate) type StageResult<T> = std::result::Result<T, Outcome>;

impl From<Error> for Outcome {
    fn from(e: Error) -> Self {
        match e {
            Error::OutOfMemory { .. } => Outcome::GiveBack(e.to_string()),
            other => Outcome::Fail(other.into()),
        }
    }
}

impl From<DataFusionError> for Outcome {
    fn from(e: DataFusionError) -> Self {
        Outcome::Fail(e)
    }
}

impl From<ArrowError> for Outcome {
    fn from(e: ArrowError) -> Self {
        Outcome::Fail(e.into())
    }
}
