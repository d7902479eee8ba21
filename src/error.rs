//! The crate's one error type.

use arrow_schema::ArrowError;
use cudarc::driver::DriverError;

use crate::device::{Device, DeviceUuid};
use crate::driver::CUresult;

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
    /// Another process named a CUDA device (by its UUID) that this process does not see: it runs
    /// with another `CUDA_VISIBLE_DEVICES`, or has no GPU.
    #[error("CUDA device {uuid} is not visible in this process ({reason}); check CUDA_VISIBLE_DEVICES")]
    UnknownDevice {
        /// The UUID asked for.
        uuid: DeviceUuid,
        /// What this process sees instead, or why it sees no device.
        reason: String,
    },
    /// A batch received from another process can no longer be read: its sender's connection has
    /// closed (the sender died, or ended and exited, or took back what this receiver held), and
    /// the memory it lent may be freed. The batch must be dropped. See the `ipc` module's
    /// documentation, "When the sender dies".
    #[error(
        "the sender {sender} has gone (its connection closed), and the memory of the batches it lent with it: \
         this batch can no longer be read; drop it"
    )]
    SenderGone {
        /// The sender: its socket path and process id.
        sender: String,
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
    /// An I/O operation failed: a socket, shared memory, a wait that timed out. [`Error::io_kind`]
    /// says what happened ([`std::io::ErrorKind::TimedOut`] for timeouts).
    #[error("I/O error: {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// An error from arrow-rs.
    #[error(transparent)]
    Arrow(#[from] ArrowError),
}

impl Error {
    /// An I/O failure while doing `context`.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The [`std::io::ErrorKind`] of an I/O error ([`Error::Io`], or an arrow-rs I/O error), if
    /// `self` is one.
    pub fn io_kind(&self) -> Option<std::io::ErrorKind> {
        match self {
            Error::Io { source, .. } => Some(source.kind()),
            Error::Arrow(ArrowError::IoError(_, source)) => Some(source.kind()),
            _ => None,
        }
    }

    /// Wraps a driver error, naming the call that produced it.
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
        move |source| Error::Driver { call, source }
    }

    /// Maps the error of a failed allocation: the driver's out-of-memory code becomes
    /// [`Error::OutOfMemory`], anything else stays as it is.
    pub(crate) fn alloc(device: Device, requested: usize) -> impl FnOnce(Error) -> Error {
        move |e| match e {
            Error::Driver { source, .. } if source.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Error::OutOfMemory { device, requested }
            }
            other => other,
        }
    }
}

impl From<Error> for ArrowError {
    fn from(e: Error) -> Self {
        match e {
            Error::Arrow(e) => e,
            Error::Io { context, source } => ArrowError::IoError(format!("{context}: {source}"), source),
            other => ArrowError::ExternalError(Box::new(other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use super::*;

    #[test]
    fn io_errors_keep_their_kind_through_arrow() {
        let e = Error::io("waiting for a frame", ErrorKind::TimedOut.into());
        assert_eq!(e.io_kind(), Some(ErrorKind::TimedOut));
        assert!(e.to_string().contains("waiting for a frame"), "{e}");
        match ArrowError::from(e) {
            ArrowError::IoError(message, source) => {
                assert_eq!(source.kind(), ErrorKind::TimedOut);
                assert!(message.starts_with("waiting for a frame: "), "{message}");
            }
            other => panic!("not an I/O error: {other:?}"),
        }
        let arrow = Error::Arrow(ArrowError::IoError("x".into(), ErrorKind::UnexpectedEof.into()));
        assert_eq!(arrow.io_kind(), Some(ErrorKind::UnexpectedEof));
        assert_eq!(Error::InvalidData("x".into()).io_kind(), None);
    }

    #[cfg(feature = "datafusion")]
    #[test]
    fn io_errors_reach_datafusion_as_arrow_io_errors() {
        use ::datafusion::common::DataFusionError;
        let e = DataFusionError::from(Error::io("binding a socket", ErrorKind::AddrInUse.into()));
        match e {
            DataFusionError::ArrowError(a, _) => {
                assert!(
                    matches!(*a, ArrowError::IoError(_, ref s) if s.kind() == ErrorKind::AddrInUse),
                    "{a:?}"
                )
            }
            other => panic!("not an arrow I/O error: {other:?}"),
        }
    }
}
