//! The crate's one error type.

use arrow_schema::ArrowError;
use cudarc::driver::DriverError;
use cudarc::driver::sys::cudaError_enum;

use crate::device::Device;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Collects results into a vector allocated once for all of them, or returns the first error.
/// (`collect::<Result<Vec<_>>>()` cannot know the length and grows its vector step by step, which
/// moves every element built so far each time: for a hundred columns, more than the building.)
pub(crate) fn try_collect<T>(items: impl ExactSizeIterator<Item = Result<T>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        out.push(item?);
    }
    Ok(out)
}

/// Everything that can go wrong in arrow-cuda.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library could not be loaded.
    #[error("no CUDA driver: the driver library could not be loaded (tried {looked_for})")]
    NoDriver {
        /// The library names that were tried.
        looked_for: String,
    },
    /// The driver loaded but reports no usable GPU.
    #[error("no CUDA device: {reason}")]
    NoDevice {
        /// What the driver said.
        reason: String,
    },
    /// The driver lacks an entry point this crate needs (it is older than CUDA 12.8).
    #[error("the CUDA driver is too old: it has no `{symbol}` (CUDA 12.8 or newer is needed)")]
    DriverTooOld {
        /// The missing entry point.
        symbol: &'static str,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        /// The driver function that failed.
        call: &'static str,
        /// The driver's error code.
        source: DriverError,
    },
    /// An allocation did not fit.
    #[error("out of memory on {device}: {requested} bytes requested")]
    OutOfMemory {
        /// Where the allocation was attempted.
        device: Device,
        /// The size that was asked for.
        requested: usize,
    },
    /// A range does not lie inside a buffer.
    #[error("range {offset}..{end} is out of bounds of a buffer of {size} bytes", end = *offset as u128 + *len as u128)]
    OutOfBounds {
        /// Start of the range, in bytes.
        offset: usize,
        /// Length of the range, in bytes.
        len: usize,
        /// Size of the buffer, in bytes.
        size: usize,
    },
    /// Two sizes that must agree do not.
    #[error("size mismatch in {what}: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        /// The operation.
        what: &'static str,
        /// The size that was needed.
        expected: usize,
        /// The size that was given.
        actual: usize,
    },
    /// An operation was asked of memory or a device that cannot serve it.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Data that crossed a C interface or a process boundary is malformed.
    #[error("invalid data: {0}")]
    InvalidData(String),
    /// An error from arrow-rs.
    #[error(transparent)]
    Arrow(#[from] ArrowError),
}

impl Error {
    /// Wraps a driver error, naming the call that produced it.
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }

    /// Wraps a failed allocation: out-of-memory codes become [`Error::OutOfMemory`].
    pub(crate) fn alloc(call: &'static str, device: Device, requested: usize) -> impl FnOnce(DriverError) -> Error {
        move |source| match source.0 {
            cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { device, requested },
            _ => Error::Driver { call, source },
        }
    }
}

impl From<Error> for ArrowError {
    fn from(e: Error) -> Self {
        match e {
            Error::Arrow(e) => e,
            other => ArrowError::ExternalError(Box::new(other)),
        }
    }
}
