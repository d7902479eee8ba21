//! The frames a sender and its receivers exchange.
//!
//! Sender to receiver: `Hello` (magic, protocol version, the schema as an IPC schema message) and
//! `Ring` (the ring's size, with its memfd and doorbell attached) on the socket; then, through the
//! ring (`ring.rs`), any number of `Batch` frames (an id, the IPC event to wait on for CUDA batches,
//! and the batch's descriptor, with the host regions' descriptors attached), then `End`, or `Abort`
//! with a reason. Receiver to sender, on the socket: `Ack` with a batch id when the last view of
//! that batch has dropped, and `Detach` when the receiver stops receiving (it may still hold
//! batches).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::ipc::channel::ring::{CAPACITY, RingWriter};
use crate::ipc::descriptor::BatchDescriptor;
use crate::ipc::event::IpcEventHandle;
use crate::ipc::handle::HANDLE_BYTES;
use crate::ipc::wire::{self, Reader, Writer};

const MAGIC: &[u8; 8] = b"ACUDAIPC";
/// 4: devices by UUID in batch descriptors (issue #23, finding 8). 5: regions of shared device
/// memory, by file descriptor (the default for messages on a GPU).
const VERSION: u32 = 5;

const HELLO: u8 = 1;
const BATCH: u8 = 2;
const END: u8 = 3;
const ABORT: u8 = 4;
const RING: u8 = 5;
const ACK: u8 = 16;
const DETACH: u8 = 17;

/// One frame of the protocol.
#[derive(Debug)]
pub(crate) enum Frame {
    Hello {
        schema: Vec<u8>,
    },
    Ring {
        capacity: u64,
        memory: OwnedFd,
        bell: OwnedFd,
    },
    Batch {
        id: u64,
        event: Option<IpcEventHandle>,
        descriptor: BatchDescriptor,
    },
    /// A batch frame whose id could be read but whose rest is malformed.
    BadBatch {
        id: u64,
        error: Error,
    },
    End,
    Abort(String),
    Ack(u64),
    Detach,
}

impl Frame {
    /// The frame that hands a receiver `ring`.
    pub fn ring(ring: &RingWriter) -> io::Result<Frame> {
        Ok(Frame::Ring {
            capacity: CAPACITY as u64,
            memory: ring.memory().try_clone_to_owned()?,
            bell: ring.bell().try_clone_to_owned()?,
        })
    }

    /// The payload, and the descriptors to attach.
    pub fn encode(&self) -> (Vec<u8>, Vec<BorrowedFd<'_>>) {
        let mut w = match self {
            Frame::Batch { descriptor, .. } => Writer::with_capacity(80 + descriptor.encoded_len()),
            _ => Writer::default(),
        };
        let mut fds = Vec::new();
        match self {
            Frame::Hello { schema } => {
                w.u8(HELLO);
                w.raw(MAGIC);
                w.u32(VERSION);
                w.bytes(schema);
            }
            Frame::Ring { capacity, memory, bell } => {
                w.u8(RING);
                w.u64(*capacity);
                fds.extend([memory.as_fd(), bell.as_fd()]);
            }
            Frame::Batch { id, event, descriptor } => {
                w.u8(BATCH);
                w.u64(*id);
                match event {
                    Some(h) => {
                        w.u8(1);
                        w.raw(&h.0);
                    }
                    None => w.u8(0),
                }
                descriptor.encode(&mut w, &mut fds);
            }
            Frame::BadBatch { .. } => unreachable!("never sent"),
            Frame::End => w.u8(END),
            Frame::Abort(reason) => {
                w.u8(ABORT);
                w.bytes(reason.as_bytes());
            }
            Frame::Ack(id) => {
                w.u8(ACK);
                w.u64(*id);
            }
            Frame::Detach => w.u8(DETACH),
        }
        (w.buf, fds)
    }

    /// Reads a frame; every byte must be used and every descriptor claimed.
    pub fn decode(frame: wire::Frame) -> Result<Frame> {
        let mut r = Reader::new(frame.payload);
        let mut fds = frame.fds.into_iter();
        let out = match r.u8()? {
            HELLO => {
                if &r.array::<8>()? != MAGIC {
                    return Err(Error::InvalidData("not an arrow-cuda IPC channel (bad magic)".into()));
                }
                let version = r.u32()?;
                if version != VERSION {
                    return Err(Error::Unsupported(format!(
                        "channel protocol version {version}; this build speaks {VERSION}"
                    )));
                }
                Frame::Hello {
                    schema: r.bytes()?.to_vec(),
                }
            }
            RING => {
                let capacity = r.u64()?;
                match (fds.next(), fds.next()) {
                    (Some(memory), Some(bell)) => Frame::Ring { capacity, memory, bell },
                    _ => return Err(Error::InvalidData("a ring frame without its two descriptors".into())),
                }
            }
            BATCH => {
                let id = r.u64()?;
                let rest = (|| {
                    let event = match r.u8()? {
                        0 => None,
                        1 => Some(IpcEventHandle(r.array::<HANDLE_BYTES>()?)),
                        k => return Err(Error::InvalidData(format!("event flag {k}"))),
                    };
                    let descriptor = BatchDescriptor::decode(&mut r, &mut fds)?;
                    finish(&r, &mut fds)?;
                    Ok((event, descriptor))
                })();
                return Ok(match rest {
                    Ok((event, descriptor)) => Frame::Batch { id, event, descriptor },
                    Err(error) => Frame::BadBatch { id, error },
                });
            }
            END => Frame::End,
            ABORT => Frame::Abort(String::from_utf8_lossy(r.bytes()?).into_owned()),
            ACK => Frame::Ack(r.u64()?),
            DETACH => Frame::Detach,
            k => return Err(Error::InvalidData(format!("unknown frame kind {k}"))),
        };
        finish(&r, &mut fds)?;
        Ok(out)
    }
}

/// Checks that every byte and every descriptor of a frame was used.
fn finish(r: &Reader<'_>, fds: &mut impl Iterator) -> Result<()> {
    r.finish()?;
    match fds.next() {
        Some(_) => Err(Error::InvalidData("a frame with more descriptors than it names".into())),
        None => Ok(()),
    }
}

/// One end of a connection: the socket, and on a sender's side the ring its frames go through,
/// with writes of whole frames serialised.
pub(crate) struct Link {
    pub socket: UnixStream,
    /// The way frames leave: the socket alone until a sender attaches its receiver's ring.
    out: Mutex<Option<RingWriter>>,
}

impl Link {
    pub fn new(socket: UnixStream) -> Link {
        Link {
            socket,
            out: Mutex::new(None),
        }
    }

    /// Sends every later frame through `ring` (announced to the receiver already).
    pub fn attach(&self, ring: RingWriter) {
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) = Some(ring);
    }

    /// Sends one frame; concurrent senders never interleave. Through a ring, a frame with
    /// descriptors or too large for it goes on the socket, announced in the ring first.
    pub fn send(&self, frame: &Frame) -> io::Result<()> {
        let (payload, fds) = frame.encode();
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        match out.as_mut() {
            Some(ring) if fds.is_empty() && ring.fits(payload.len()) => ring.push(Some(&payload), &self.socket),
            Some(ring) => {
                ring.push(None, &self.socket)?;
                wire::send_frame(self.socket.as_fd(), &payload, &fds)
            }
            None => wire::send_frame(self.socket.as_fd(), &payload, &fds),
        }
    }
}
