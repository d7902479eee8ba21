//! How a stage ends when it does not produce its output: it gives the work back to DataFusion's
//! own plan, or fails as DataFusion would.

use ::datafusion::common::DataFusionError;
use arrow_schema::ArrowError;

use crate::error::Error;

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
