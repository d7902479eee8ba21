//! Arrow IPC between processes with bodies that stay in device memory.
//!
//! - Messages ([`DeviceMessage`], [`write_message`], [`read_message`]): a batch as one encapsulated
//!   Arrow IPC message in one device allocation, laid out as Arrow C++'s
//!   `arrow::cuda::SerializeRecordBatch` lays it out, and read back as views of it.
//! - Handles ([`IpcMemHandle`], [`IpcEvent`]): CUDA IPC memory and event handles; opened mappings
//!   are cached per process. Shared host memory ([`crate::memory::SharedMemHandle`]) stands in for
//!   CUDA IPC on the CPU device.
//! - Descriptors ([`BatchDescriptor`]): zero-copy descriptors of batches already in exportable
//!   memory (Arrow's "Dissociated IPC"): metadata plus `(region, offset, length)` per buffer.
//! - The channel ([`Sender`], [`Receiver`]): a sender and receivers in different processes over a
//!   Unix socket and a shared-memory ring per receiver, with acknowledgements, back-pressure and
//!   recovery from a peer's death.
//!
//! What crosses the process boundary is host metadata; the bodies never pass through host memory
//! (on the CPU device they are shared memory). Linux only. I/O failures are
//! [`Error::Io`](crate::error::Error::Io); [`Error::io_kind`](crate::error::Error::io_kind) says
//! what happened ([`std::io::ErrorKind::TimedOut`] for timeouts).

mod channel;
mod decode;
mod descriptor;
mod event;
mod handle;
mod layout;
mod message;
#[doc(hidden)]
pub mod testing;
mod wire;

pub use channel::{Receiver, ReceiverOptions, Sender, SenderEvent, SenderOptions, SenderStatus};
pub use descriptor::{BatchDescriptor, BufferLocation, RegionHandle};
pub use event::{IpcEvent, IpcEventHandle};
pub use handle::{HANDLE_BYTES, IpcMemHandle, OpenedHandle};
pub use layout::needs_normalising;
pub use message::{
    DeviceMessage, decode_schema, default_message_resource, encode_schema, read_message, write_message,
    write_message_to,
};
