//! The consuming end of a channel.

use std::collections::HashMap;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow_schema::{ArrowError, SchemaRef};

use crate::array::DeviceRecordBatch;
use crate::device::{Device, DeviceUuid, Event, Stream};
use crate::error::{Error, Result};
use crate::ipc::channel::access::{check_peer, peer_pid};
use crate::ipc::channel::protocol::{Frame, KEPT_REGIONS, Link};
use crate::ipc::channel::ring::{Entry, RingReader, Woken};
use crate::ipc::descriptor::{BatchDescriptor, Mapping};
use crate::ipc::event::{IpcEvent, IpcEventHandle, wait_local};
use crate::ipc::handle::HANDLE_BYTES;
use crate::ipc::message::decode_schema;
use crate::ipc::wire::{self, FrameReader, RecvError};
use crate::memory::SharedDeviceHandle;
use crate::memory::fence::Fence;
use crate::memory::shared_device::OpenedRegions;
use crate::trace::Laps;

/// How a [`Receiver`] behaves.
#[derive(Clone, Debug)]
pub struct ReceiverOptions {
    /// How long [`Receiver::connect`] waits for the socket to appear and the schema to arrive.
    pub connect_timeout: Duration,
    /// How long [`Receiver::recv`] waits for the next frame: 60 seconds by default, so that a
    /// sender that goes silent without closing its connection (stopped, or stuck) cannot hold the
    /// receiver forever; `None` waits until a frame comes or the sender's connection ends. A timeout
    /// is an [`Error::Io`] of kind [`std::io::ErrorKind::TimedOut`] ("waiting for a batch: none came
    /// within 60s"), after which the receiver can try again. A receiver whose sender may rightly
    /// pause longer between batches sets a longer limit, or `None`.
    pub recv_timeout: Option<Duration>,
    /// The largest frame accepted from the sender.
    pub max_frame_bytes: usize,
    /// Keep every region this receiver opened mapped until it is dropped, so that a sender that
    /// resends the same memory costs no further opens. Off by default, and only for senders that
    /// keep their memory for as long as this receiver lives: a retained mapping stays open after
    /// its batches were acknowledged, and CUDA leaves it undefined what happens when the exporter
    /// frees memory that another process still has open. Without it a mapping lives exactly as
    /// long as a batch uses it, and is closed before that batch is acknowledged. (Regions of shared
    /// device memory, which outlive their sender, are kept either way: those the sender used
    /// most recently, up to 256 MiB, stay mapped until the sender lets them go or the receiver
    /// drops, and the sender names them by id alone.)
    pub retain_mappings: bool,
    /// How long sending an acknowledgement may block.
    pub ack_timeout: Duration,
    /// The users whose sender this receiver accepts, told by the kernel (`SO_PEERCRED`: the user of
    /// the process that listens on the socket); `None` (the default): only this process's own
    /// user. Anyone who can create the socket path can otherwise pose as the sender.
    pub allowed_uids: Option<Vec<u32>>,
    /// How long [`Receiver::recv`] polls for the next frame, on a busy core, before it sleeps until
    /// the frame arrives (default zero: it sleeps at once). Frames arrive through shared memory, so
    /// polling costs no system call; waking a sleeping thread costs tens of microseconds, and on
    /// virtual machines up to a few hundred. A receiver that expects the next batch soon and cares
    /// about latency can spend a core to save that. A sender that dies while a receiver polls is
    /// noticed when the polling ends. Whatever this is, a sender wakes a sleeping receiver as it
    /// begins a send, and the receiver then polls for that frame for up to 200 µs before it
    /// sleeps again: its thread wakes while the sender describes the batch.
    pub poll: Duration,
}

/// How long a receiver woken ahead of a frame polls for it before it sleeps again: longer than a
/// send takes from its start to its frame (a few to a few tens of microseconds, with a copy into a
/// message), so that only a send that fails or waits for credit leaves the receiver to sleep again.
const WOKEN_AHEAD_POLL: Duration = Duration::from_micros(200);

impl Default for ReceiverOptions {
    fn default() -> Self {
        ReceiverOptions {
            connect_timeout: Duration::from_secs(10),
            recv_timeout: Some(Duration::from_secs(60)),
            max_frame_bytes: 64 << 20,
            retain_mappings: false,
            ack_timeout: Duration::from_secs(5),
            allowed_uids: None,
            poll: Duration::ZERO,
        }
    }
}

/// The fence of the memory a receiver's sender lent (see `crate::memory::fence`): it may be read
/// until the sender's end of the connection has closed. A sender keeps what it lent until this
/// receiver acknowledges it or the connection ends, even once it has ended the stream, been
/// dropped, or dropped this receiver (all of which only shut down its writing half); the
/// connection closes when the sender process dies or exits, or when the sender reclaims what this
/// receiver held. Once the kernel reports the close (`POLLHUP`), every check fails.
struct Lender {
    link: Arc<Link>,
    /// Who the sender is, for the error: its socket path and process id.
    name: String,
    /// The close was seen: later checks need not ask the kernel.
    gone: AtomicBool,
}

impl Fence for Lender {
    fn check(&self) -> Result<()> {
        if !self.gone.load(Ordering::Acquire) {
            if !wire::hung_up(self.link.socket.as_fd()) {
                return Ok(());
            }
            self.gone.store(true, Ordering::Release);
        }
        Err(Error::SenderGone {
            sender: self.name.clone(),
        })
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
    /// The fence of every CUDA batch received (CPU batches stay readable: shared memory outlives
    /// its sender), and of CPU batches too once `fence_host` is set.
    lender: Arc<Lender>,
    fence_host: bool,
    /// The sender runs in this process, where CUDA opens none of its interprocess events
    /// (`cuIpcOpenEventHandle` refuses a handle of the process that made it): its events are
    /// found by their handles in the process's list.
    local_sender: bool,
    /// Frames from the socket: the greeting, and frames the ring announces there.
    reader: FrameReader,
    ring: RingReader,
    /// The ring announced a frame on the socket that is still to be read.
    on_socket: bool,
    schema: SchemaRef,
    options: ReceiverOptions,
    state: State,
    streams: HashMap<usize, Stream>,
    events: HashMap<[u8; HANDLE_BYTES], IpcEvent>,
    retained: Vec<Mapping>,
    /// The regions of shared device memory mapped from the sender and kept, by its ids.
    opened: OpenedRegions,
}

impl std::fmt::Debug for Receiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Receiver({} fields)", self.schema.fields().len())
    }
}

/// The error of a connection that ended before the end of the stream.
fn ended() -> Error {
    Error::io(
        "the sender's connection ended before the end of the stream",
        io::ErrorKind::UnexpectedEof.into(),
    )
}

/// Opened events kept per receiver; past this many (a sender cycling through new events), the
/// cache starts over.
const MAX_EVENTS: usize = 1024;

impl Receiver {
    /// Connects to the sender at `path`, waiting up to [`ReceiverOptions::connect_timeout`] for the
    /// socket to appear and the schema to arrive. A sender of a user that
    /// [`ReceiverOptions::allowed_uids`] does not allow, or one that refuses this process's user, is
    /// an [`Error::Io`] of kind [`std::io::ErrorKind::PermissionDenied`].
    pub fn connect(path: impl AsRef<Path>, options: ReceiverOptions) -> Result<Receiver> {
        let path = path.as_ref();
        let deadline = wire::deadline(options.connect_timeout);
        // Room for the descriptors of the regions it may keep, and as many more for the rest of
        // the process, made before the sender can count this receiver: growing the table may
        // take milliseconds, which no batch then waits for.
        wire::reserve_descriptors(2 * KEPT_REGIONS);
        let socket = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e)
                    if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused)
                        && deadline.is_none_or(|d| Instant::now() < d) =>
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(Error::io(format!("connecting to {}", path.display()), e)),
            }
        };
        check_peer(&socket, options.allowed_uids.as_deref())
            .map_err(|e| Error::io(format!("connecting to {}", path.display()), e))?;
        socket
            .set_write_timeout(Some(options.ack_timeout))
            .map_err(|e| Error::io("configuring the channel socket", e))?;
        // Kept for the receiver's life: a read may take frames after the greeting too.
        let mut reader = FrameReader::new(options.max_frame_bytes);
        let mut greeting = |what: &str| {
            let left = deadline.map(|d| {
                d.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1))
            });
            let frame = reader
                .recv(socket.as_fd(), left)
                .map_err(RecvError::into_error)?
                .ok_or_else(|| Error::io(what, io::ErrorKind::UnexpectedEof.into()))?;
            Frame::decode(frame, None)
        };
        let schema = match greeting("reading the schema")? {
            Frame::Hello { schema } => decode_schema(&schema)?,
            // A sender says so when it refuses this process's user.
            Frame::Abort(reason) => {
                return Err(Error::io(
                    format!("connecting to {}", path.display()),
                    io::Error::new(io::ErrorKind::PermissionDenied, reason),
                ));
            }
            other => return Err(Error::InvalidData(format!("a channel that starts with {other:?}"))),
        };
        let ring = match greeting("reading the ring")? {
            Frame::Ring { capacity, memory, bell } => {
                RingReader::open(memory, bell, capacity, options.max_frame_bytes)?
            }
            other => return Err(Error::InvalidData(format!("a ring expected, {other:?} sent"))),
        };
        let pid = peer_pid(&socket).ok();
        let name = match pid {
            Some(pid) => format!("at {} (pid {pid})", path.display()),
            None => format!("at {}", path.display()),
        };
        let local_sender = pid.is_some_and(|pid| u32::try_from(pid).is_ok_and(|pid| pid == std::process::id()));
        let link = Arc::new(Link::new(socket));
        Ok(Receiver {
            lender: Arc::new(Lender {
                link: link.clone(),
                name,
                gone: AtomicBool::new(false),
            }),
            fence_host: false,
            local_sender,
            link,
            reader,
            ring,
            on_socket: false,
            schema,
            options,
            state: State::Open,
            streams: HashMap::new(),
            events: HashMap::new(),
            retained: Vec::new(),
            opened: OpenedRegions::default(),
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
    /// after a broken connection every call fails. A receive waits at most
    /// [`ReceiverOptions::recv_timeout`] (60 seconds unless set otherwise); while it waits, it maps
    /// the regions a sender announces ([`SenderOptions::announce_regions`](crate::ipc::SenderOptions::announce_regions)).
    pub fn recv(&mut self) -> Result<Option<DeviceRecordBatch>> {
        match &self.state {
            State::Open => {}
            State::Ended => return Ok(None),
            State::Broken(why) => return Err(Error::Arrow(ArrowError::IpcError(why.clone()))),
        }
        let mut laps = Laps::start();
        let start = Instant::now();
        let frame = loop {
            match self.next_frame(start, &mut laps) {
                Ok(Ok(Frame::Regions(regions))) => {
                    self.map_ahead(regions);
                    laps.lap("recv.ahead");
                }
                other => break other,
            }
        };
        let frame = match frame {
            Ok(decoded) => decoded?,
            Err(RecvError::Idle(_)) => {
                // Only a limit ends a wait with nothing read.
                let limit = self.options.recv_timeout.unwrap_or_default();
                return Err(Error::io(
                    "waiting for a batch",
                    io::Error::new(io::ErrorKind::TimedOut, format!("none came within {limit:?}")),
                ));
            }
            Err(RecvError::Broken(e)) => {
                // A sender that dies with acknowledgements of ours unread resets the connection
                // rather than ending it: the same death, reported as one (found by the fault runs
                // of tests/ipc.rs).
                let e = match e.io_kind() {
                    Some(io::ErrorKind::ConnectionReset) => ended(),
                    _ => e,
                };
                return Err(self.broken(e));
            }
        };
        laps.lap("recv.decode");
        match frame {
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

    /// Maps regions the sender announced as they were made, ahead of the batches that will name
    /// them (they are kept already: see [`Frame::decode`]). A region that fails to map, or is on a
    /// device this process does not see, is tried again by the first batch that names it, which
    /// reports the error.
    fn map_ahead(&mut self, regions: Vec<(DeviceUuid, SharedDeviceHandle)>) {
        for (uuid, handle) in regions {
            if let Ok(ordinal) = uuid.ordinal() {
                let _ = self.opened.open(handle, ordinal);
            }
        }
    }

    /// The next frame from the ring, or from the socket where the ring announces one: polling
    /// until [`ReceiverOptions::poll`] has passed since `start`, then asleep until
    /// [`ReceiverOptions::recv_timeout`] has. The inner error is a malformed frame, after which
    /// the stream is still in step. The wait, counted from the call (so with any time before the
    /// sender sent), is the step `recv.wait` of `laps`.
    fn next_frame(&mut self, start: Instant, laps: &mut Laps) -> std::result::Result<Result<Frame>, RecvError> {
        let left = |timeout: Option<Duration>| timeout.map(|t| t.saturating_sub(start.elapsed()));
        let socket = self.link.socket.as_fd();
        // Polls until then (`None`: for ever): the end of `options.poll`, or a while after the
        // sender rang ahead.
        let mut poll_until = start.checked_add(self.options.poll);
        let polling = |until: Option<Instant>| until.is_none_or(|t| Instant::now() < t);
        while !self.on_socket {
            match self.ring.pop().map_err(RecvError::Broken)? {
                Some(Entry::Frame(payload)) => {
                    laps.lap("recv.wait");
                    let frame = wire::Frame {
                        payload,
                        fds: Vec::new(),
                    };
                    return Ok(Frame::decode(frame, Some(&mut self.opened)));
                }
                Some(Entry::OnSocket) => self.on_socket = true,
                None if polling(poll_until) => std::hint::spin_loop(),
                None => match self.ring.sleep(socket, left(self.options.recv_timeout)) {
                    // Rung ahead of a frame still being made.
                    Ok(Some(Woken::Ring)) if self.ring.is_empty() => {
                        poll_until = Instant::now().checked_add(WOKEN_AHEAD_POLL);
                    }
                    Ok(Some(Woken::Socket)) if self.ring.is_empty() => {
                        // Nothing was announced: the connection has ended, or the sender broke
                        // the protocol.
                        return Err(RecvError::Broken(
                            match self.reader.recv(socket, Some(Duration::ZERO)) {
                                Ok(None) => ended(),
                                Ok(Some(_)) => {
                                    Error::InvalidData("a frame on the socket that the ring did not announce".into())
                                }
                                Err(RecvError::Idle(_)) => continue,
                                Err(RecvError::Broken(e)) => e,
                            },
                        ));
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        return Err(RecvError::Idle(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no frame came",
                        )));
                    }
                    Err(e) => return Err(RecvError::Broken(Error::io("waiting for a frame", e))),
                },
            }
        }
        // The sender announces a frame before it writes it: a polling receiver polls the socket too
        // (unless an earlier read brought the frame's bytes already).
        while self.reader.is_empty()
            && polling(poll_until)
            && wire::wait_readable([socket], Some(Duration::ZERO)).is_ok_and(|r| r.is_none())
        {
            std::hint::spin_loop();
        }
        match self.reader.recv(socket, left(self.options.recv_timeout))? {
            Some(frame) => {
                laps.lap("recv.wait");
                self.on_socket = false;
                Ok(Frame::decode(frame, Some(&mut self.opened)))
            }
            None => Err(RecvError::Broken(ended())),
        }
    }

    fn import(
        &mut self,
        id: u64,
        event: Option<IpcEventHandle>,
        descriptor: BatchDescriptor,
    ) -> Result<DeviceRecordBatch> {
        let mut laps = Laps::start();
        let owner = Acknowledge {
            id,
            link: self.link.clone(),
        };
        // Without an event the sender's writes had finished before it sent the batch.
        let ready = match (descriptor.device, event) {
            (Device::Cuda(o), Some(h)) => {
                let stream = self.stream(o)?;
                if !self.local_sender {
                    // The event dies with its sender, and waiting on it then is undefined (a
                    // stream of this process could fault): a batch whose event came from a
                    // sender that is gone by now (its frame was still in the ring) is not
                    // received, as if the connection had ended before it.
                    if self.lender.check().is_err() {
                        return Err(self.broken(ended()));
                    }
                    self.event(&h, o)?.wait_on(&stream)?;
                } else if !wait_local(&h, &stream)? {
                    // The sender's event is gone (with its sender). It issued its writes to the
                    // context this process has for the device (one per device and process) before
                    // it sent the batch: the context's work so far includes them.
                    let ctx = crate::device::context(o)?;
                    ctx.synchronize().map_err(Error::driver("cuCtxSynchronize"))?;
                }
                stream.record()?
            }
            _ => Event::completed(),
        };
        let fence = match (descriptor.device, self.fence_host) {
            (Device::Cpu, false) => None,
            _ => Some(self.lender.clone() as Arc<dyn Fence>),
        };
        laps.lap("recv.event");
        // Its steps: recv.open, recv.parse, recv.build.
        let opened = Some(&mut self.opened);
        let (batch, mappings) = descriptor.import_retaining(&self.schema, ready, owner, fence, opened)?;
        let mut laps = Laps::start();
        if self.options.retain_mappings {
            // Shared device regions are kept by `opened` already.
            for m in mappings.into_iter().filter(|m| !matches!(m, Mapping::SharedCuda(_))) {
                if !self.retained.iter().any(|r| r.same_as(&m)) {
                    self.retained.push(m);
                }
            }
        }
        laps.lap("recv.retain");
        Ok(batch)
    }

    /// Fences the CPU batches received from now on as CUDA batches are fenced, though shared
    /// memory outlives its sender: a hook for tests of the fence on machines without a GPU
    /// (`crate::ipc::testing::fence_host_batches`).
    pub(crate) fn fence_host_batches(&mut self) {
        self.fence_host = true;
    }

    /// The regions of shared device memory it keeps for its sender: how many, and their bytes (a
    /// hook for tests: `crate::ipc::testing::kept_regions`).
    pub(crate) fn kept_regions(&self) -> (usize, usize) {
        (self.opened.len(), self.opened.bytes())
    }

    /// Marks the receiver broken by `e`, which it returns: every later `recv` fails with it.
    fn broken(&mut self, e: Error) -> Error {
        self.state = State::Broken(e.to_string());
        e
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

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch};

    use super::*;
    use crate::ipc::channel::ring::RingWriter;
    use crate::ipc::message::encode_schema;
    use crate::memory::MemoryResource;

    fn batch(rows: i64) -> RecordBatch {
        let ints: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows));
        RecordBatch::try_from_iter([("ints", ints)]).unwrap()
    }

    /// A fake sender: greets one receiver (frames of at most 1000 bytes) with its ring, then runs
    /// `script` with the ring and the socket in a thread of its own while the receiver is returned.
    fn fake_sender(
        name: &str,
        script: impl FnOnce(&mut RingWriter, &mut UnixStream) + Send + 'static,
    ) -> (Receiver, std::thread::JoinHandle<()>) {
        let path = std::env::temp_dir().join(format!("acipc-unit-{}-{name}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let schema = batch(0).schema();
        let fake = std::thread::spawn(move || {
            let (socket, _) = listener.accept().unwrap();
            let link = Link::new(socket);
            let mut ring = RingWriter::create().unwrap();
            link.send(&Frame::Hello {
                schema: encode_schema(&schema),
            })
            .unwrap();
            link.send(&Frame::ring(&ring).unwrap()).unwrap();
            let mut socket = link.socket;
            script(&mut ring, &mut socket);
        });
        let options = ReceiverOptions {
            recv_timeout: Some(Duration::from_secs(10)),
            max_frame_bytes: 1000,
            ..ReceiverOptions::default()
        };
        let r = Receiver::connect(&path, options).unwrap();
        let _ = std::fs::remove_file(&path);
        (r, fake)
    }

    fn is_invalid_data(r: Result<Option<DeviceRecordBatch>>) -> bool {
        matches!(r, Err(Error::InvalidData(_)))
    }

    fn raw_frame(payload: &[u8]) -> Vec<u8> {
        let mut out = (payload.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(payload);
        out
    }

    /// A receiver knows a sender of its own process (the kernel's credentials of the socket), whose
    /// interprocess events it cannot open.
    #[test]
    fn a_sender_of_this_process_is_known_as_local() {
        let (r, fake) = fake_sender("local", |_, _| {});
        assert!(r.local_sender);
        drop(r);
        fake.join().unwrap();
    }

    #[test]
    fn broken_streams_are_errors() {
        // Oversized: the receiver refuses it and is broken from then on.
        let (mut r, fake) = fake_sender("oversized", |ring, s| {
            ring.push(Some(&[4; 1001]), s).unwrap();
        });
        assert!(is_invalid_data(r.recv()));
        assert!(r.recv().is_err());
        fake.join().unwrap();

        // Truncated: the stream ends inside a frame the ring announced on the socket.
        let (mut r, fake) = fake_sender("truncated", |ring, s| {
            ring.push(None, s).unwrap();
            s.write_all(&100u32.to_le_bytes()).unwrap();
            s.write_all(&[2; 10]).unwrap();
        });
        fake.join().unwrap();
        assert!(is_invalid_data(r.recv()));

        // A frame on the socket that the ring did not announce.
        let (mut r, fake) = fake_sender("unannounced", |_, s| s.write_all(&raw_frame(&[3])).unwrap());
        fake.join().unwrap();
        assert!(is_invalid_data(r.recv()));
        assert!(r.recv().is_err(), "the receiver is broken from then on");

        // Ended without an end of stream, asleep and polling.
        for poll in [Duration::ZERO, Duration::from_millis(5)] {
            let (mut r, fake) = fake_sender("eof", |_, _| {});
            r.options.poll = poll;
            fake.join().unwrap();
            let e = r.recv().unwrap_err();
            assert_eq!(e.io_kind(), Some(io::ErrorKind::UnexpectedEof), "{e}");
        }

        // Ended with an acknowledgement unread, which resets the connection instead: the same.
        let (acked, ack_sent) = mpsc::channel::<()>();
        let (mut r, fake) = fake_sender("reset", move |_, _| ack_sent.recv().unwrap());
        r.link.send(&Frame::Ack(1)).unwrap();
        acked.send(()).unwrap();
        fake.join().unwrap();
        let e = r.recv().unwrap_err();
        assert_eq!(e.io_kind(), Some(io::ErrorKind::UnexpectedEof), "{e}");
        assert!(r.recv().is_err(), "the receiver is broken from then on");

        // Nothing comes: a timeout, after which the receiver goes on.
        let (tx, rx) = mpsc::channel::<()>();
        let (mut r, fake) = fake_sender("slow", move |ring, s| {
            rx.recv().unwrap();
            ring.push(Some(&[3]), s).unwrap();
        });
        r.options.recv_timeout = Some(Duration::from_millis(20));
        let e = r.recv().unwrap_err();
        assert_eq!(e.io_kind(), Some(io::ErrorKind::TimedOut), "{e}");
        tx.send(()).unwrap();
        fake.join().unwrap();
        r.options.recv_timeout = Some(Duration::from_secs(10));
        assert!(r.recv().unwrap().is_none(), "the end of the stream");
    }

    /// A receiver woken ahead of a frame that does not come polls for a while only, then sleeps
    /// again, and still takes the frame when it comes.
    #[test]
    fn a_receiver_woken_ahead_for_nothing_sleeps_again() {
        let wait_until_asleep = |ring: &RingWriter| {
            let start = Instant::now();
            while !ring.receiver_sleeps() {
                assert!(start.elapsed() < Duration::from_secs(10), "the receiver never slept");
                std::thread::yield_now();
            }
        };
        let (mut r, fake) = fake_sender("ahead", move |ring, s| {
            wait_until_asleep(ring);
            ring.wake();
            wait_until_asleep(ring);
            ring.push(Some(&[3]), s).unwrap();
        });
        assert_eq!(r.options.poll, Duration::ZERO);
        assert!(r.recv().unwrap().is_none(), "the end of the stream");
        fake.join().unwrap();
    }

    /// A batch naming a region by an id its receiver does not keep (never sent, or let go of) is
    /// refused and acknowledged, and the stream goes on. The region names the first GPU; without
    /// one, the device is what is refused (a device this process does not see is told first).
    #[test]
    fn a_region_named_by_an_id_not_kept_is_refused() {
        let gpu = crate::device::DeviceUuid::of(0).ok();
        let stream = Stream::cpu();
        let empty = crate::transfer::htod_async(&batch(0), MemoryResource::SharedHost, &stream).unwrap();
        let descriptor = BatchDescriptor::describe(&empty).unwrap().to_bytes().0;
        let (acks_tx, acks_rx) = mpsc::channel();
        let (mut r, fake) = fake_sender("not-kept", move |ring, s| {
            let mut frame = vec![2u8];
            frame.extend_from_slice(&42u64.to_le_bytes());
            frame.extend_from_slice(&0u32.to_le_bytes());
            frame.push(0);
            // The descriptor's tag and device, then one region: shared device memory by id 7.
            frame.extend_from_slice(&descriptor[..32]);
            frame.extend_from_slice(&1u32.to_le_bytes());
            frame.push(5);
            frame.extend_from_slice(&gpu.unwrap_or_default().0);
            frame.extend_from_slice(&7u64.to_le_bytes());
            ring.push(Some(&frame), s).unwrap();
            ring.push(Some(&[3]), s).unwrap();
            let mut ack = [0u8; 13];
            s.read_exact(&mut ack).unwrap();
            acks_tx.send(u64::from_le_bytes(ack[5..].try_into().unwrap())).unwrap();
        });
        let e = r.recv().unwrap_err();
        match gpu {
            Some(_) => assert!(
                matches!(&e, Error::InvalidData(m) if m.contains("id 7, which this receiver does not keep")),
                "{e}"
            ),
            None => assert!(matches!(&e, Error::UnknownDevice { .. }), "{e}"),
        }
        assert!(r.recv().unwrap().is_none(), "the end of the stream");
        assert_eq!(acks_rx.recv_timeout(Duration::from_secs(10)).unwrap(), 42);
        fake.join().unwrap();
    }

    #[test]
    fn corrupt_frames_keep_the_stream_in_step() {
        // A malformed batch (acknowledged all the same) and an unknown kind through the ring; then
        // a valid empty batch on the socket, with its descriptor, and an abort through the ring.
        let (acks_tx, acks_rx) = mpsc::channel();
        let stream = Stream::cpu();
        let empty = crate::transfer::htod_async(&batch(0), MemoryResource::SharedHost, &stream).unwrap();
        let descriptor = BatchDescriptor::describe(&empty).unwrap().to_bytes().0;
        let (mut r, fake) = fake_sender("corrupt", move |ring, s| {
            let mut bad = vec![2u8];
            bad.extend_from_slice(&42u64.to_le_bytes());
            bad.extend_from_slice(&[0, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]);
            ring.push(Some(&bad), s).unwrap();
            ring.push(Some(&[99, 1, 2, 3]), s).unwrap();
            let mut good = vec![2u8];
            good.extend_from_slice(&44u64.to_le_bytes());
            good.extend_from_slice(&0u32.to_le_bytes());
            good.push(0);
            good.extend_from_slice(&descriptor);
            ring.push(None, s).unwrap();
            s.write_all(&raw_frame(&good)).unwrap();
            ring.push(Some(&[4, 5, 0, 0, 0, b'b', b'y', b'e', b'!', b'!']), s)
                .unwrap();
            // The acknowledgements of batches 42 and 44.
            let mut acks = Vec::new();
            for _ in 0..2 {
                let mut frame = [0u8; 13];
                s.read_exact(&mut frame).unwrap();
                assert_eq!(&frame[..5], &[9, 0, 0, 0, 16]);
                acks.push(u64::from_le_bytes(frame[5..].try_into().unwrap()));
            }
            acks_tx.send(acks).unwrap();
        });
        assert!(is_invalid_data(r.recv()), "a malformed batch");
        assert!(is_invalid_data(r.recv()), "an unknown frame");
        let got = r.recv().unwrap().unwrap();
        assert_eq!(got.num_rows(), 0);
        drop(got);
        let e = r.recv().unwrap_err();
        assert!(
            matches!(&e, Error::Arrow(ArrowError::IpcError(m)) if m.contains("bye!!")),
            "{e}"
        );
        assert!(r.recv().is_err(), "an aborted stream stays aborted");
        assert_eq!(acks_rx.recv_timeout(Duration::from_secs(10)).unwrap(), vec![42, 44]);
        fake.join().unwrap();
    }
}
