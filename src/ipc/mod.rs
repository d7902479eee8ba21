//! Arrow IPC between processes with bodies that stay in device memory.
//!
//! - Messages ([`DeviceMessage`], [`write_message`], [`read_message`]): a batch as one encapsulated
//!   Arrow IPC message in one device allocation, laid out as Arrow C++'s
//!   `arrow::cuda::SerializeRecordBatch` lays it out, and read back as views of it.
//! - Handles ([`IpcMemHandle`], [`IpcEvent`]): CUDA IPC memory and event handles; opened mappings
//!   are cached per process. Shared device memory ([`crate::memory::SharedDeviceHandle`]) is GPU
//!   memory that travels as a file descriptor and that a receiver keeps; shared host memory
//!   ([`crate::memory::SharedMemHandle`]) stands in for both on the CPU device.
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
//!
//! # Which device
//!
//! Processes may see different GPUs, in a different order: each numbers the devices its
//! `CUDA_VISIBLE_DEVICES` shows it from 0. So a device never crosses the process boundary by its
//! ordinal: descriptors and the channel's batch frames carry the device's 16-byte UUID
//! ([`DeviceUuid`](crate::device::DeviceUuid), `cuDeviceGetUuid`), and the receiving process opens
//! memory and events on the device of its own with that UUID; its batches report that device
//! ([`Device::Cuda`](crate::device::Device::Cuda) with its own ordinal). A UUID the receiver does
//! not see (a `CUDA_VISIBLE_DEVICES` that leaves the sender's GPU out) is
//! [`Error::UnknownDevice`](crate::error::Error::UnknownDevice), naming it; through the channel that
//! batch is refused (and acknowledged) and the stream goes on. [`IpcMemHandle::open`] and
//! [`IpcEvent::open`] take an ordinal of the opening process: callers that pass handles
//! themselves send the UUID along and look the ordinal up with
//! [`DeviceUuid::ordinal`](crate::device::DeviceUuid::ordinal).
//!
//! # Who can reach the memory
//!
//! A CUDA IPC memory handle is a capability: any process of the same user (and root) that learns
//! its 64 bytes can map the whole allocation it names, read it and write it, for as long as the
//! exporter keeps it; the driver does not ask how the handle was obtained. Shared device memory
//! travels as a file descriptor, the same capability for whoever holds the descriptor (it can map
//! the memory read-write). Shared host memory on the CPU device travels as a file descriptor,
//! which is the same capability for reading (the memfd is sealed against writes by anyone but its
//! creator). So whoever receives a batch's handles can read its memory, on a GPU write it too,
//! and a process that poses as a sender can feed a receiver any data. Received batches are
//! validated when copied to the host, and a batch whose memory was handed out is validated from
//! then on in the sender too (its bytes may have changed). The channel trusts exactly the users it
//! is told to:
//!
//! - each end asks the kernel who the other is (`SO_PEERCRED`) and, unless
//!   [`SenderOptions::allowed_uids`] / [`ReceiverOptions::allowed_uids`] name other users, accepts
//!   only processes of its own user; a refused receiver is disconnected before it sees the schema
//!   ([`SenderEvent::Refused`]) and a receiver that refuses its sender fails to connect, both with
//!   [`std::io::ErrorKind::PermissionDenied`];
//! - a sender neither replaces nor uses a socket file of another user. A socket path in a directory
//!   that others can write (`/tmp`) can still be taken first by another user, who then makes the
//!   peer checks fail rather than succeed; [`private_socket_path`] gives a path in a directory of
//!   mode 0700 (under `XDG_RUNTIME_DIR` when set), where no one else can;
//! - the checks keep other users out. They cannot separate processes of one user: those can read
//!   each other's memory anyway (through `/proc`, `ptrace` or the handles themselves), and so can
//!   root. Processes that must not see each other's data run as different users.
//!
//! # When the sender dies
//!
//! A [`Receiver`] notices its sender's death once it has received the batches sent before it: the
//! next receive fails, the connection having ended before the end of the stream
//! ([`std::io::ErrorKind::UnexpectedEof`]), and so does every one after it. A batch that was still
//! being written on a GPU when it was sent comes with the sender's interprocess event, which dies
//! with the sender, and waiting on a dead event is undefined (CUDA's `cuIpcOpenEventHandle`): the
//! receiver checks the sender first, and if it has died the receive fails as above instead.
//! Batches it received before stay in its hands, and what they are worth depends on the device:
//!
//! - **CPU**: their memory is shared memory, which lives as long as any process maps it. They stay
//!   valid until dropped, whatever happened to the sender.
//! - **CUDA, shared device memory**: on a GPU that has it, everything a [`Sender`] sends: batches
//!   lent from [`crate::memory::MemoryResource::SharedDevice`], and the messages it copies every
//!   other batch into (by default, [`crate::memory::MemoryResource::shared_for`]; batches in CUDA
//!   IPC memory are copied too rather than lent). The receiver maps the physical memory itself
//!   (`cuMemImportFromShareableHandle`), and the driver keeps it while any process maps it: they
//!   stay valid until dropped, whatever happened to the sender, as on the CPU.
//! - **CUDA IPC memory**: on a GPU or driver without shared device memory, batches lent from
//!   [`crate::memory::MemoryResource::Device`] and messages (and whatever a sender told to write
//!   its messages there, [`SenderOptions::message_resource`], sends). Their memory is a CUDA IPC
//!   mapping of the sender's allocations, which its death frees; CUDA leaves reads of it
//!   undefined. Such batches are *fenced*: every read of their
//!   memory through this crate first checks that the sender's end of the connection is still open,
//!   and once it has closed fails with [`Error::SenderGone`](crate::error::Error::SenderGone),
//!   naming the sender (its socket path and process id). The check guards downloads
//!   ([`crate::transfer::dtoh`] and its variants), copies of buffers and strided views, exports
//!   through the C Device Data Interface ([`crate::ffi::export_batch`], [`crate::ffi::export_array`],
//!   streams), conversions to arrow-rs data ([`crate::array::DeviceArrayData::to_array_data_unchecked`]),
//!   messages and descriptors ([`write_message`], [`BatchDescriptor::describe`], a [`Sender`]
//!   passing the batch on) and [`crate::memory::DeviceBuffer::device_pointer`]. (DataFusion's GPU
//!   tables hold only batches they staged themselves.)
//!   [`crate::array::DeviceRecordBatch::check_readable`] asks the same question directly. The
//!   batch itself stays safe to hold and to drop.
//!
//! The connection closes when the sender process dies or exits, and when the sender reclaims what
//! this receiver held (its connection from the receiver broke). It does not close when the sender
//! ends the stream, is dropped, or drops this receiver for being slow while its process lives on:
//! the sender keeps what it lent until it is acknowledged, and the batches stay readable.
//!
//! What the fence cannot do (which is why the channel's messages are shared device memory where
//! the GPU has it):
//!
//! - it guards the start of each read, not its course: a copy or kernel already issued when the
//!   sender dies reads whatever the driver leaves there, and so may one issued in the moment
//!   between the sender's memory being freed and its socket being closed (a dying process's files
//!   close in turn); a receive that found the sender alive waits on its event even if it dies
//!   in that moment;
//! - a pointer already handed on is beyond reach: an `ArrowDeviceArray` exported to a C consumer
//!   before the death, an address taken with [`crate::memory::DeviceBuffer::address`] or
//!   [`crate::memory::DeviceBuffer::into_raw_parts`] (code that hands addresses on itself calls
//!   `check_readable` first, and drops the batch on an error);
//! - batches built by [`BatchDescriptor::import`] outside a channel have no connection to watch
//!   and are not fenced: whoever passes descriptors keeps their senders alive.

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

pub use channel::{Receiver, ReceiverOptions, Sender, SenderEvent, SenderOptions, SenderStatus, private_socket_path};
pub use descriptor::{BatchDescriptor, BufferLocation, RegionHandle};
pub use event::{IpcEvent, IpcEventHandle};
pub use handle::{HANDLE_BYTES, IpcMemHandle, OpenedHandle};
pub use layout::needs_normalising;
pub use message::{
    DeviceMessage, decode_schema, default_message_resource, encode_schema, read_message, write_message,
    write_message_to,
};
