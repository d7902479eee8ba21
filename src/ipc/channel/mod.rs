//! A channel of device record batches between processes on one machine, over a Unix socket.
//!
//! A [`Sender`] binds a socket path; [`Receiver`]s connect to it. Frames are length-prefixed
//! (see `protocol.rs`): the schema first, then batches, each with an id, its device (by UUID: the
//! receiver finds its own ordinal of the device, whatever its `CUDA_VISIBLE_DEVICES`), its metadata, the
//! handles of the memory regions its buffers lie in (CUDA IPC handles; memfds passed with
//! `SCM_RIGHTS` for CPU batches, so the whole channel runs without a GPU) and, for CUDA batches, an
//! IPC event to wait on (a receiver in the sender's own process, where CUDA opens none of its
//! interprocess events, finds the event by its handle in the process); then the end of the stream, or an
//! error. After the schema, a sender's
//! frames reach each receiver through a ring in shared memory (`ring.rs`), which costs no system
//! call when the receiver polls; acknowledgements go on the socket.
//!
//! The receiver builds each batch as views of the mapped regions and acknowledges it when the
//! last view drops; the sender keeps every batch it lent alive until each receiver it went to has
//! acknowledged it, and bounds the bytes in flight (back-pressure). Faults:
//!
//! - a receiver that dies: its socket ends, the sender's reader thread for it notices at once and
//!   reclaims everything it held ([`SenderEvent::Lost`], [`SenderStatus::lost`]);
//! - a receiver that stops acknowledging or reading: it holds up sends for at most
//!   [`SenderOptions::send_timeout`], out of its own credit or room, and is then dropped
//!   ([`SenderEvent::Dropped`]); the others never wait for it again. Connections are limited
//!   ([`SenderOptions::max_receivers`]) and each is greeted on its own thread, so one that never
//!   reads its greeting holds up nobody;
//! - a sender that dies: the receiver's next receive reads the end of the connection and fails
//!   ([`std::io::ErrorKind::UnexpectedEof`]); a sender that goes silent makes a receive time out
//!   ([`std::io::ErrorKind::TimedOut`], after [`ReceiverOptions::recv_timeout`]: 60 s by default).
//!   Batches still held from a dead sender: on the CPU they stay valid until dropped (shared memory
//!   lives as long as any process maps it). On a GPU the sender's death frees its memory: such
//!   batches are fenced, and every later read of them through this crate fails with
//!   [`Error::SenderGone`](crate::error::Error::SenderGone) (see the `ipc` module's documentation,
//!   "When the sender dies", for what the fence covers and what it cannot);
//! - truncated, oversized or corrupt frames: errors on either side, never a crash; a corrupt batch is
//!   acknowledged so its memory is reclaimed.

mod access;
mod peers;
mod protocol;
mod receiver;
mod ring;
mod sender;

pub use access::private_socket_path;
pub use peers::{SenderEvent, SenderStatus};
pub(crate) use protocol::Frame;
pub use receiver::{Receiver, ReceiverOptions};
pub use sender::{Sender, SenderOptions};
