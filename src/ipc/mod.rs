//! Arrow IPC between processes with bodies that stay in device memory.
//!
//! - [`message`]: a batch as one encapsulated Arrow IPC message in one device allocation, laid out
//!   as Arrow C++'s `arrow::cuda::SerializeRecordBatch` lays it out, and read back as views of it.
//! - [`handle`] and [`event`]: CUDA IPC memory and event handles; opened mappings are cached per
//!   process. [`shm`]: shared host memory (memfd), which stands in for CUDA IPC on the CPU device.
//! - [`descriptor`]: zero-copy descriptors of batches already in exportable memory (Arrow's
//!   "Dissociated IPC"): metadata plus `(region, offset, length)` per buffer.
//! - [`channel`]: a sender and receivers in different processes over a Unix socket and a
//!   shared-memory ring per receiver, with acknowledgements, back-pressure and recovery from a
//!   peer's death.
//!
//! What crosses the process boundary is host metadata; the bodies never pass through host memory
//! (on the CPU device they are shared memory). Linux only.

pub(crate) mod cache;
pub mod channel;
pub(crate) mod decode;
pub mod descriptor;
pub mod event;
pub mod handle;
pub(crate) mod layout;
pub mod message;
pub mod shm;
pub(crate) mod wire;

pub use channel::{Receiver, ReceiverOptions, Sender, SenderEvent, SenderOptions, SenderStatus};
pub use descriptor::{BatchDescriptor, BufferLocation, RegionHandle};
pub use event::{IpcEvent, IpcEventHandle};
pub use handle::{IpcMemHandle, OpenedHandle};
pub use layout::needs_normalising;
pub use message::{
    DeviceMessage, decode_schema, default_message_resource, encode_schema, read_message, write_message,
    write_message_to,
};
pub use shm::{SharedMapping, SharedMemHandle};

use arrow_schema::ArrowError;

use crate::error::Error;

/// An I/O error as the crate's error: [`Error::Arrow`] holding [`ArrowError::IoError`], whose
/// [`std::io::ErrorKind`] says what happened ([`std::io::ErrorKind::TimedOut`] for timeouts).
pub(crate) fn io_error(context: &str, e: std::io::Error) -> Error {
    Error::Arrow(ArrowError::IoError(format!("{context}: {e}"), e))
}

/// The [`std::io::ErrorKind`] of an I/O error from this module, if `e` is one.
pub fn io_error_kind(e: &Error) -> Option<std::io::ErrorKind> {
    match e {
        Error::Arrow(ArrowError::IoError(_, io)) => Some(io.kind()),
        _ => None,
    }
}
