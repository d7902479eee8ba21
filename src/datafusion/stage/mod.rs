//! Device stages; see the [`datafusion`](super) module docs for what they run and where the rule sits.

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
