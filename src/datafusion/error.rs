//! The crate's errors as DataFusion's.

use ::datafusion::common::DataFusionError;

use crate::error::Error;

/// Result with DataFusion's error.
pub(crate) type DfResult<T> = ::datafusion::common::Result<T>;

impl From<Error> for DataFusionError {
    /// Allocation failures become [`DataFusionError::ResourcesExhausted`], arrow errors stay arrow
    /// errors, I/O errors become arrow I/O errors (as [`ArrowError`](arrow_schema::ArrowError)'s
    /// conversion makes them), and everything else is [`DataFusionError::External`].
    fn from(e: Error) -> Self {
        match e {
            Error::OutOfMemory { .. } => DataFusionError::ResourcesExhausted(e.to_string()),
            Error::Arrow(e) => DataFusionError::ArrowError(Box::new(e), None),
            e @ Error::Io { .. } => DataFusionError::ArrowError(Box::new(e.into()), None),
            other => DataFusionError::External(Box::new(other)),
        }
    }
}
