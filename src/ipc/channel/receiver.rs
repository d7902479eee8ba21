//! The consuming end of a channel.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_schema::{ArrowError, SchemaRef};

use crate::array::DeviceRecordBatch;
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result};
use crate::ipc::channel::protocol::{Frame, Link};
use crate::ipc::descriptor::{BatchDescriptor, Mapping};
use crate::ipc::event::{IpcEvent, IpcEventHandle};
use crate::ipc::handle::HANDLE_BYTES;
use crate::ipc::io_error;
use crate::ipc::message::decode_schema;
use crate::ipc::wire::{self, FrameReader, RecvError};

/// How a [`Receiver`] behaves.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    /// How long [`Receiver::connect`] waits for the socket to appear and the schema to arrive.
    pub connect_timeout: Duration,
    /// How long [`Receiver::recv`] waits for the next frame (`None`: until it comes or the sender's
    /// connection ends). A timeout is an [`std::io::ErrorKind::TimedOut`] error after which the
    /// receiver can try again.
    pub recv_timeout: Option<Duration>,
    /// The largest frame accepted from the sender.
    pub max_frame_bytes: usize,
    /// Keep every region this receiver opened mapped until it is dropped, so that a sender that
    /// resends the same memory costs no further opens. Off by default, and only for senders that
    /// keep their memory for as long as this receiver lives: a retained mapping stays open after
    /// its batches were acknowledged, and CUDA leaves it undefined what happens when the exporter
    /// frees memory that another process still has open. Without it a mapping lives exactly as
    /// long as a batch uses it, and is closed before that batch is acknowledged.
    pub retain_mappings: bool,
    /// How long sending an acknowledgement may block.
    pub ack_timeout: Duration,
    /// How long [`Receiver::recv`] polls the socket, on a busy core, before it sleeps until the
    /// next frame arrives (default zero: it sleeps at once). Waking a sleeping thread costs tens of
    /// microseconds, and on virtual machines up to a few hundred; a receiver that expects the
    /// next batch soon and cares about latency can spend a core to save that.
    pub poll: Duration,
}

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            connect_timeout: Duration::from_secs(10),
            recv_timeout: None,
            max_frame_bytes: 64 << 20,
            retain_mappings: false,
            ack_timeout: Duration::from_secs(5),
            poll: Duration::ZERO,
        }
    }
}

/// Owned by every buffer of a received batch: acknowledges the batch when the last one drops.
struct Acknowledge {
    id: u64,
    link: Arc<Link>,
}

impl Drop for Acknowledge {
    fn drop(&mut self) {
        // Nothing can be reported from Drop: a sender that is gone reclaims everything anyway.
        let _ = self.link.send(&Frame::Ack(self.id));
    }
}

enum State {
    Open,
    Ended,
    Broken(String),
}

/// The consuming end of a channel: connects to a [`Sender`](crate::ipc::Sender)'s socket and
/// receives its batches as views of the sender's memory.
///
/// Each batch is acknowledged when the last view of it (every buffer, slice and clone) drops; only
/// then may the sender free or reuse its memory. Work on the device that reads a batch must have
/// finished before its views drop. CUDA batches that the sender was still writing are ordered after
/// those writes through an IPC event that the receiver's stream waits on;
/// [`DeviceRecordBatch::ready`] completes after it.
pub struct Receiver {
    link: Arc<Link>,
    reader: FrameReader,
    schema: SchemaRef,
    options: ReceiverOptions,
    state: State,
    streams: HashMap<usize, Stream>,
    events: HashMap<[u8; HANDLE_BYTES], IpcEvent>,
    retained: Vec<Mapping>,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Receiver({} fields)", self.schema.fields().len())
    }
}

/// Opened events kept per receiver; past this many (a sender cycling through new events), the
/// cache starts over.
const MAX_EVENTS: usize = 1024;

impl Receiver {
    /// Connects to the sender at `path`, waiting up to [`ReceiverOptions::connect_timeout`] for the
    /// socket to appear and the schema to arrive.
    pub fn connect(path: impl AsRef<Path>, options: ReceiverOptions) -> Result<Receiver> {
        let path = path.as_ref();
        let deadline = Instant::now() + options.connect_timeout;
        let socket = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused)
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(io_error(&format!("connecting to {}", path.display()), e)),
            }
        };
        socket
            .set_write_timeout(Some(options.ack_timeout))
            .map_err(|e| io_error("configuring the channel socket", e))?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        // Kept for the receiver's life: a read may take frames after the schema too.
        let mut reader = FrameReader::new(options.max_frame_bytes);
        let hello = reader
            .recv(socket.as_fd(), Some(wait))
            .map_err(RecvError::into_error)?
            .ok_or_else(|| io_error("reading the schema", io::ErrorKind::UnexpectedEof.into()))?;
        let schema = match Frame::decode(hello)? {
            Frame::Hello { schema } => decode_schema(&schema)?,
            other => return Err(Error::InvalidData(format!("a channel that starts with {other:?}"))),
        };
        Ok(Receiver {
            link: Arc::new(Link::new(socket)),
            reader,
            schema,
            options,
            state: State::Open,
            streams: HashMap::new(),
            events: HashMap::new(),
            retained: Vec::new(),
        })
    }

    /// The schema of every batch.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The next batch, or `None` once the sender has ended the stream. Errors: the sender's abort
    /// ([`ArrowError::IpcError`]), a connection that ended without an end of stream (the sender
    /// died; [`std::io::ErrorKind::UnexpectedEof`]), a timeout, malformed frames
    /// ([`Error::InvalidData`]). After a malformed batch frame the receiver can go on receiving;
    /// after a broken connection every call fails.
    pub fn recv(&mut self) -> Result<Option<DeviceRecordBatch>> {
        match &self.state {
            State::Open => {}
            State::Ended => return Ok(None),
            State::Broken(why) => return Err(Error::Arrow(ArrowError::IpcError(why.clone()))),
        }
        if !self.options.poll.is_zero() {
            wire::poll_readable(self.link.socket.as_fd(), self.options.poll);
        }
        let frame = match self.reader.recv(self.link.socket.as_fd(), self.options.recv_timeout) {
            Ok(Some(f)) => f,
            Ok(None) => {
                self.state = State::Broken("the sender's connection ended before the end of the stream".into());
                return Err(io_error(
                    "the sender's connection ended before the end of the stream",
                    io::ErrorKind::UnexpectedEof.into(),
                ));
            }
            Err(RecvError::Idle(e)) => return Err(io_error("waiting for a batch", e)),
            Err(RecvError::Broken(e)) => {
                self.state = State::Broken(e.to_string());
                return Err(e);
            }
        };
        match Frame::decode(frame)? {
            Frame::Batch { id, event, descriptor } => self.import(id, event, descriptor).map(Some),
            Frame::BadBatch { id, error } => {
                drop(Acknowledge {
                    id,
                    link: self.link.clone(),
                });
                Err(error)
            }
            Frame::End => {
                self.state = State::Ended;
                Ok(None)
            }
            Frame::Abort(reason) => {
                let why = format!("the sender aborted the stream: {reason}");
                self.state = State::Broken(why.clone());
                Err(Error::Arrow(ArrowError::IpcError(why)))
            }
            other => Err(Error::InvalidData(format!("a sender sent {other:?}"))),
        }
    }

    fn import(
        &mut self,
        id: u64,
        event: Option<IpcEventHandle>,
        descriptor: BatchDescriptor,
    ) -> Result<DeviceRecordBatch> {
        let owner = Acknowledge {
            id,
            link: self.link.clone(),
        };
        // Without an event the sender's writes had finished before it sent the batch.
        let ready = match (descriptor.device, event) {
            (Device::Cuda(o), Some(h)) => {
                let stream = self.stream(o)?;
                self.event(&h, o)?.wait_on(&stream)?;
                stream.record()?
            }
            _ => Event::completed(),
        };
        let (batch, mappings) = descriptor.import_retaining(&self.schema, ready, owner)?;
        if self.options.retain_mappings {
            for m in mappings {
                if !self.retained.iter().any(|r| r.same_as(&m)) {
                    self.retained.push(m);
                }
            }
        }
        Ok(batch)
    }

    fn stream(&mut self, ordinal: usize) -> Result<Stream> {
        if let Some(s) = self.streams.get(&ordinal) {
            return Ok(s.clone());
        }
        let s = Stream::new(Device::Cuda(ordinal))?;
        self.streams.insert(ordinal, s.clone());
        Ok(s)
    }

    fn event(&mut self, handle: &IpcEventHandle, ordinal: usize) -> Result<&IpcEvent> {
        if !self.events.contains_key(&handle.0) {
            if self.events.len() >= MAX_EVENTS {
                self.events.clear();
            }
            self.events.insert(handle.0, IpcEvent::open(handle, ordinal)?);
        }
        Ok(&self.events[&handle.0])
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Tells the sender to send nothing more; batches still held are acknowledged as they drop.
        if !matches!(self.state, State::Broken(_)) {
            let _ = self.link.send(&Frame::Detach);
        }
    }
}
