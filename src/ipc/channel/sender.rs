//! The producing end of a channel.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_schema::SchemaRef;

use crate::array::DeviceRecordBatch;
use crate::device::{Device, Event, Stream};
use crate::error::{Error, Result};
use crate::ipc::channel::protocol::{Frame, Link};
use crate::ipc::channel::ring::RingWriter;
use crate::ipc::descriptor::BatchDescriptor;
use crate::ipc::event::{IpcEvent, IpcEventHandle};
use crate::ipc::io_error;
use crate::ipc::message::{default_message_resource, encode_schema, write_message_to};
use crate::ipc::wire::FrameReader;
use crate::memory::MemoryResource;

/// How a [`Sender`] behaves.
#[derive(Clone, Debug)]
pub struct SenderOptions {
    /// The most body bytes lent to receivers at once: [`Sender::send`] waits for acknowledgements
    /// to free room (a single larger batch is sent when nothing else is in flight).
    pub max_in_flight_bytes: u64,
    /// How long [`Sender::send`] waits for room, and how long one socket write may block, before
    /// failing with [`std::io::ErrorKind::TimedOut`].
    pub send_timeout: Duration,
    /// Send batches whose memory is exportable as they are, without a copy. When false, or when a
    /// batch is not exportable, it is copied into one message first.
    pub zero_copy: bool,
    /// Where messages are written; by default memory another process can open
    /// ([`default_message_resource`]).
    pub message_resource: Option<MemoryResource>,
    /// The largest frame accepted from a receiver.
    pub max_frame_bytes: usize,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            max_in_flight_bytes: 4 << 30,
            send_timeout: Duration::from_secs(30),
            zero_copy: true,
            message_resource: None,
            max_frame_bytes: 1 << 20,
        }
    }
}

/// Something that happened to a sender's receivers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SenderEvent {
    /// A receiver connected.
    Joined {
        /// The receiver's number.
        receiver: u64,
    },
    /// A receiver closed its connection holding nothing, after detaching or after the end.
    Left {
        /// The receiver's number.
        receiver: u64,
    },
    /// A receiver's connection ended while it held batches, failed, or broke the protocol; what it
    /// held was reclaimed.
    Lost {
        /// The receiver's number.
        receiver: u64,
        /// How many batches it held.
        reclaimed: usize,
        /// What happened.
        reason: String,
    },
}

/// A snapshot of a sender's state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SenderStatus {
    /// Receivers connected now (detached ones included until they close).
    pub receivers: usize,
    /// Receivers that joined so far.
    pub joined: u64,
    /// Receivers that left cleanly.
    pub left: u64,
    /// Receivers lost (see [`SenderEvent::Lost`]).
    pub lost: u64,
    /// Batches sent to at least one receiver.
    pub sent: u64,
    /// Batches some receiver still holds.
    pub in_flight_batches: usize,
    /// The body bytes of those batches.
    pub in_flight_bytes: u64,
}

struct Peer {
    link: Arc<Link>,
    detached: bool,
}

/// A batch lent to receivers.
struct InFlight {
    pending: BTreeSet<u64>,
    bytes: u64,
    /// Keeps the memory alive (and unreused) until every receiver is done.
    _lease: Box<dyn Any + Send>,
    event: Option<(IpcEvent, IpcEventHandle)>,
}

#[derive(Default)]
struct State {
    peers: BTreeMap<u64, Peer>,
    in_flight: HashMap<u64, InFlight>,
    in_flight_bytes: u64,
    next_peer: u64,
    status: SenderStatus,
    events: Vec<SenderEvent>,
    /// The last frame, once sent (`End` or `Abort`): late receivers get it after `Hello`.
    last: Option<Frame>,
    /// Interprocess events no batch uses now, by device ordinal, oldest first.
    event_pool: HashMap<usize, VecDeque<(IpcEvent, IpcEventHandle)>>,
}

impl State {
    /// Releases a batch every receiver is done with: its memory is freed (or given back to its
    /// owner) before the lock is released, so a status that no longer counts it means it is gone;
    /// its event goes back to the pool.
    fn complete(&mut self, id: u64) {
        if let Some(mut done) = self.in_flight.remove(&id) {
            self.in_flight_bytes -= done.bytes;
            if let Some(e) = done.event.take() {
                self.recycle(e);
            }
        }
    }

    /// Keeps an event no batch uses for the next batch on its device.
    fn recycle(&mut self, event: (IpcEvent, IpcEventHandle)) {
        let ordinal = event.0.device().ordinal().unwrap_or(0);
        self.event_pool.entry(ordinal).or_default().push_back(event);
    }
}

/// Released interprocess events kept resting before one is recorded again.
const SPARE_EVENTS: usize = 4;

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    closed: AtomicBool,
    hello: Frame,
    max_frame: usize,
    write_timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Greets a new receiver, hands it its ring and starts reading its acknowledgements.
    fn add_peer(self: &Arc<Self>, socket: UnixStream) {
        if socket.set_nonblocking(false).is_err() || socket.set_write_timeout(Some(self.write_timeout)).is_err() {
            return;
        }
        let Ok(reader) = socket.try_clone() else { return };
        let Ok(ring) = RingWriter::create() else {
            return;
        };
        let Ok(handover) = Frame::ring(&ring) else { return };
        let link = Arc::new(Link::new(socket));
        let id = {
            let mut st = self.lock();
            // Under the lock, so that a concurrent finish cannot slip between the greeting and the
            // registration; a fresh socket's buffer takes these small frames without blocking.
            if link.send(&self.hello).is_err() || link.send(&handover).is_err() {
                return;
            }
            link.attach(ring);
            if let Some(last) = &st.last
                && link.send(last).is_err()
            {
                return;
            }
            let id = st.next_peer;
            st.next_peer += 1;
            st.peers.insert(id, Peer { link, detached: false });
            st.status.joined += 1;
            st.events.push(SenderEvent::Joined { receiver: id });
            id
        };
        self.changed.notify_all();
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("arrow-cuda-ipc-peer-{id}"))
            .spawn(move || shared.read_peer(id, reader));
        if let Err(e) = spawned {
            self.disconnect(id, Some(format!("could not start its reader thread: {e}")));
        }
    }

    /// Reads one receiver's frames until its connection ends.
    fn read_peer(&self, id: u64, socket: UnixStream) {
        let mut reader = FrameReader::new(self.max_frame);
        let reason = loop {
            match reader.recv(socket.as_fd(), None) {
                Ok(None) => break None,
                Ok(Some(frame)) => match Frame::decode(frame) {
                    Ok(Frame::Ack(batch)) => self.ack(id, batch),
                    Ok(Frame::Detach) => self.detach(id),
                    Ok(other) => break Some(format!("protocol violation: a receiver sent {other:?}")),
                    Err(e) => break Some(format!("protocol violation: {e}")),
                },
                Err(e) => break Some(e.into_error().to_string()),
            }
        };
        self.disconnect(id, reason);
    }

    fn ack(&self, peer: u64, batch: u64) {
        let mut st = self.lock();
        let last = st
            .in_flight
            .get_mut(&batch)
            .is_some_and(|f| f.pending.remove(&peer) && f.pending.is_empty());
        if last {
            st.complete(batch);
            drop(st);
            self.changed.notify_all();
        }
    }

    fn detach(&self, peer: u64) {
        if let Some(p) = self.lock().peers.get_mut(&peer) {
            p.detached = true;
        }
        self.changed.notify_all();
    }

    /// Removes a receiver and reclaims every batch it held.
    fn disconnect(&self, peer: u64, reason: Option<String>) {
        {
            let mut st = self.lock();
            let Some(p) = st.peers.remove(&peer) else { return };
            let _ = p.link.socket.shutdown(std::net::Shutdown::Both);
            let held: Vec<u64> = st
                .in_flight
                .iter()
                .filter(|(_, f)| f.pending.contains(&peer))
                .map(|(id, _)| *id)
                .collect();
            for id in &held {
                let last = st
                    .in_flight
                    .get_mut(id)
                    .is_some_and(|f| f.pending.remove(&peer) && f.pending.is_empty());
                if last {
                    st.complete(*id);
                }
            }
            let clean = held.is_empty() && reason.is_none() && (p.detached || st.last.is_some());
            if clean {
                st.status.left += 1;
                st.events.push(SenderEvent::Left { receiver: peer });
            } else {
                st.status.lost += 1;
                let reason = reason.unwrap_or_else(|| "the connection closed".into());
                st.events.push(SenderEvent::Lost {
                    receiver: peer,
                    reclaimed: held.len(),
                    reason,
                });
            }
        }
        self.changed.notify_all();
    }

    /// Sends `frame` to `peers`; a receiver whose socket fails is disconnected.
    fn broadcast(&self, peers: &[(u64, Arc<Link>)], frame: &Frame) {
        for (id, link) in peers {
            if let Err(e) = link.send(frame) {
                self.disconnect(*id, Some(format!("sending to it failed: {e}")));
            }
        }
    }

    /// The receivers still receiving.
    fn active(st: &State) -> Vec<(u64, Arc<Link>)> {
        st.peers
            .iter()
            .filter(|(_, p)| !p.detached)
            .map(|(id, p)| (*id, p.link.clone()))
            .collect()
    }
}

/// The producing end of a channel: binds a Unix socket and lends record batches to every receiver
/// that connects.
///
/// Receivers may connect at any time (a background thread accepts them); each gets the schema,
/// then every batch sent after it joined. A batch's memory is kept, unchanged, until every receiver
/// it went to has acknowledged it (the last view of it dropped in the receiver) or has gone away.
/// A receiver that dies is noticed at once (its socket ends) and everything it held is reclaimed;
/// see [`Sender::status`] and [`Sender::take_events`].
///
/// Dropping the sender without [`Sender::finish`] sends receivers an abort. Batches still held by
/// receivers stay alive after the sender drops, until they are acknowledged or their receiver goes.
pub struct Sender {
    shared: Arc<Shared>,
    schema: SchemaRef,
    options: SenderOptions,
    path: PathBuf,
    next_id: AtomicU64,
    streams: Mutex<HashMap<usize, Stream>>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sender({}, {:?})", self.path.display(), self.status())
    }
}

impl Sender {
    /// Binds `path` (a stale socket file left by a dead process is replaced) and starts accepting
    /// receivers for batches of `schema`.
    pub fn bind(path: impl AsRef<Path>, schema: SchemaRef, options: SenderOptions) -> Result<Sender> {
        let path = path.as_ref().to_path_buf();
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && is_stale(&path) => {
                std::fs::remove_file(&path).map_err(|e| io_error("removing a stale socket", e))?;
                UnixListener::bind(&path).map_err(|e| io_error("binding the channel socket", e))?
            }
            Err(e) => return Err(io_error(&format!("binding {}", path.display()), e)),
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| io_error("configuring the channel socket", e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            closed: AtomicBool::new(false),
            hello: Frame::Hello {
                schema: encode_schema(&schema),
            },
            max_frame: options.max_frame_bytes,
            write_timeout: options.send_timeout,
        });
        let accepting = shared.clone();
        let accept = std::thread::Builder::new()
            .name("arrow-cuda-ipc-accept".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .map_err(|e| io_error("starting the accept thread", e))?;
        Ok(Sender {
            shared,
            schema,
            options,
            path,
            next_id: AtomicU64::new(1),
            streams: Mutex::new(HashMap::new()),
            accept: Some(accept),
        })
    }

    /// The schema every batch must have.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A snapshot of the receivers and the batches they hold.
    pub fn status(&self) -> SenderStatus {
        let st = self.shared.lock();
        SenderStatus {
            receivers: st.peers.len(),
            in_flight_batches: st.in_flight.len(),
            in_flight_bytes: st.in_flight_bytes,
            ..st.status.clone()
        }
    }

    /// What happened to receivers since the last call.
    pub fn take_events(&self) -> Vec<SenderEvent> {
        std::mem::take(&mut self.shared.lock().events)
    }

    /// Waits until `n` receivers are connected and receiving.
    pub fn wait_for_receivers(&self, n: usize, timeout: Duration) -> Result<()> {
        self.wait_until(timeout, "receivers to connect", |st| Shared::active(st).len() >= n)
    }

    /// Waits until no receiver holds a batch.
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        self.wait_until(timeout, "receivers to release their batches", |st| {
            st.in_flight.is_empty()
        })
    }

    fn wait_until(&self, timeout: Duration, what: &str, done: impl Fn(&State) -> bool) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while !done(&st) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io_error(&format!("waiting for {what}"), io::ErrorKind::TimedOut.into()));
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    fn stream(&self, device: Device) -> Result<Stream> {
        let Some(o) = device.ordinal() else {
            return Ok(Stream::cpu());
        };
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = streams.get(&o) {
            return Ok(s.clone());
        }
        let s = Stream::new(Device::Cuda(o))?;
        streams.insert(o, s.clone());
        Ok(s)
    }

    /// Lends `batch` to every receiver connected now and returns its id (0 when there was none).
    ///
    /// With [`SenderOptions::zero_copy`], a batch whose memory is exportable travels as it is and is
    /// kept alive (a clone of it) until every receiver is done; otherwise it is first copied into one
    /// message. Blocks while the bytes in flight would pass [`SenderOptions::max_in_flight_bytes`],
    /// for at most [`SenderOptions::send_timeout`]. For CUDA batches still being written, an IPC
    /// event recorded after the batch's ready event (and after the copy, if any) orders the
    /// receivers' work after it.
    pub fn send(&self, batch: &DeviceRecordBatch) -> Result<u64> {
        if batch.schema().fields() != self.schema.fields() {
            return Err(Error::InvalidArgument(
                "the batch's fields differ from the channel's schema".into(),
            ));
        }
        if self.shared.lock().last.is_some() {
            return Err(Error::InvalidArgument("the stream has ended".into()));
        }
        let device = batch.device();
        let described = match self.options.zero_copy {
            true => match BatchDescriptor::describe(batch) {
                Ok(d) => Some(d),
                Err(Error::Unsupported(_)) => None,
                Err(e) => return Err(e),
            },
            false => None,
        };
        let estimate = described
            .as_ref()
            .map_or_else(|| batch.size_in_bytes() as u64, |d| d.body_bytes());
        self.wait_for_room(estimate)?;
        let stream = self.stream(device)?;
        let (descriptor, lease, ready): (BatchDescriptor, Box<dyn Any + Send>, Event) = match described {
            Some(d) => (d, Box::new(batch.clone()), batch.ready().clone()),
            None => {
                let resource = self
                    .options
                    .message_resource
                    .unwrap_or_else(|| default_message_resource(device));
                let message = write_message_to(batch, resource, &stream)?;
                let ready = message.ready().clone();
                (BatchDescriptor::of_message(&message)?, Box::new(message), ready)
            }
        };
        // Receivers may touch the bytes only after they are in place: on a GPU through an IPC event
        // recorded after them (none when they are in place already: the device has finished
        // writing them, so any later work sees them), on the CPU (shared memory) once they are there.
        let event = match descriptor.device {
            Device::Cuda(_) if ready.is_complete()? => None,
            Device::Cuda(o) => {
                stream.wait(&ready)?;
                let e = self.take_event(o)?;
                e.0.record(&stream)?;
                Some(e)
            }
            _ => {
                ready.synchronize()?;
                None
            }
        };
        let bytes = descriptor.body_bytes();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = Frame::Batch {
            id,
            event: event.as_ref().map(|e| e.1),
            descriptor,
        };
        let peers = {
            let mut st = self.shared.lock();
            let peers = Shared::active(&st);
            if st.last.is_some() || peers.is_empty() {
                if let Some(e) = event {
                    st.recycle(e);
                }
                return match st.last {
                    // `finish` ran since the check above.
                    Some(_) => Err(Error::InvalidArgument("the stream has ended".into())),
                    None => Ok(0),
                };
            }
            let pending = peers.iter().map(|(id, _)| *id).collect();
            st.in_flight.insert(
                id,
                InFlight {
                    pending,
                    bytes,
                    _lease: lease,
                    event,
                },
            );
            st.in_flight_bytes += bytes;
            st.status.sent += 1;
            peers
        };
        self.shared.broadcast(&peers, &frame);
        Ok(id)
    }

    fn wait_for_room(&self, bytes: u64) -> Result<()> {
        let max = self.options.max_in_flight_bytes;
        self.wait_until(self.options.send_timeout, "room among the bytes in flight", |st| {
            st.in_flight.is_empty() || st.in_flight_bytes.saturating_add(bytes) <= max
        })
    }

    /// An interprocess event for a batch: the one released longest ago, once the pool holds
    /// [`SPARE_EVENTS`], else a new one. Recording an event again while a receiver's stream may
    /// still be waiting on its last record can stall the sender, so recent ones rest.
    fn take_event(&self, ordinal: usize) -> Result<(IpcEvent, IpcEventHandle)> {
        let spare = self
            .shared
            .lock()
            .event_pool
            .get_mut(&ordinal)
            .filter(|pool| pool.len() >= SPARE_EVENTS)
            .and_then(VecDeque::pop_front);
        if let Some(e) = spare {
            return Ok(e);
        }
        let e = IpcEvent::new(Device::Cuda(ordinal))?;
        let h = e.handle()?;
        Ok((e, h))
    }

    /// Ends the stream: receivers get `None` after the batches sent so far. Batches they hold stay
    /// lent until acknowledged ([`Sender::wait_idle`]).
    pub fn finish(&self) -> Result<()> {
        self.close_with(Frame::End)
    }

    /// Ends the stream with an error that every receiver's next receive reports.
    pub fn abort(&self, reason: &str) -> Result<()> {
        self.close_with(Frame::Abort(reason.to_string()))
    }

    fn close_with(&self, frame: Frame) -> Result<()> {
        let peers = {
            let mut st = self.shared.lock();
            if st.last.is_some() {
                return Err(Error::InvalidArgument("the stream has already ended".into()));
            }
            let peers = Shared::active(&st);
            st.last = Some(match &frame {
                Frame::End => Frame::End,
                Frame::Abort(r) => Frame::Abort(r.clone()),
                _ => unreachable!("only End and Abort close a stream"),
            });
            peers
        };
        self.shared.broadcast(&peers, &frame);
        Ok(())
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        if self.shared.lock().last.is_none() {
            // Best effort, and quick: a receiver that does not read is not waited for.
            for p in self.shared.lock().peers.values() {
                let _ = p.link.socket.set_write_timeout(Some(Duration::from_millis(100)));
            }
            let _ = self.abort("the sender was dropped before finishing the stream");
        }
        // Receivers see the end of the stream; their acknowledgements are still read, by the
        // reader threads, which release what they hold when each connection ends.
        for p in self.shared.lock().peers.values() {
            let _ = p.link.socket.shutdown(std::net::Shutdown::Write);
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether nothing listens at `path` any more.
fn is_stale(path: &Path) -> bool {
    matches!(UnixStream::connect(path), Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    use std::os::fd::AsRawFd;
    while !shared.closed.load(Ordering::SeqCst) {
        let mut poll = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut poll, 1, 50) };
        match listener.accept() {
            Ok((socket, _)) => shared.add_peer(socket),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
