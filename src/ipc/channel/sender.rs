//! The producing end of a channel: its options and the [`Sender`] itself (its receivers are kept in
//! `peers.rs`).

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_schema::SchemaRef;

use crate::array::DeviceRecordBatch;
use crate::device::{Device, DeviceUuid, Event, Stream};
use crate::error::{Error, Result};
use crate::ipc::channel::access::check_owner;
use crate::ipc::channel::peers::{InFlight, SenderEvent, SenderStatus, Shared, State, accept_loop};
use crate::ipc::channel::protocol::{Frame, KEPT_BYTES, KEPT_REGIONS};
use crate::ipc::descriptor::{BatchDescriptor, Route};
use crate::ipc::event::{IpcEvent, IpcEventHandle};
use crate::ipc::message::{encode_schema, write_message_to};
use crate::ipc::wire;
use crate::memory::MemoryResource;
use crate::memory::cache::Region as _;
use crate::memory::shared_device::{KeepIdle, MadeWatcher, SharedDeviceRegion};
use crate::trace::Laps;

/// How a [`Sender`] behaves.
#[derive(Clone, Debug)]
pub struct SenderOptions {
    /// Each receiver's credit: the most body bytes lent to one receiver and not yet acknowledged
    /// by it. [`Sender::send`] waits for a receiver's acknowledgements to free room (a receiver
    /// that holds nothing takes a batch of any size). Receivers get the same batches, so the
    /// sender keeps at most this much per receiver.
    pub max_in_flight_bytes: u64,
    /// How long one receiver may hold up [`Sender::send`]: out of credit, or not taking its frames
    /// (its ring and socket full). Past it that receiver is dropped ([`SenderEvent::Dropped`]:
    /// nothing more is sent to it and its next receive fails) and the send goes on to the others,
    /// so a receiver that stops acknowledging delays the stream once, by at most this much.
    pub send_timeout: Duration,
    /// Send batches whose memory is exportable as they are, without a copy. When false, or when a
    /// batch is not exportable, it is copied into one message first. On a GPU with shared device
    /// memory, only that memory is lent as it is ([`MemoryResource::SharedDevice`]): a batch in
    /// CUDA IPC memory ([`MemoryResource::Device`]) is copied, so that receivers keep reading what
    /// they hold after this process is gone. A batch lent as it is can be written by its
    /// receivers on a GPU (they map its memory read-write), so its downloads in this process
    /// validate every array from then on (see [`BatchDescriptor::describe`]); a copied one stays
    /// as trusted as it was.
    pub zero_copy: bool,
    /// Where messages are written; by default memory another process can map and keep
    /// ([`MemoryResource::shared_for`]: shared device memory on a GPU that has it, so receivers
    /// keep reading what they hold after this process is gone).
    pub message_resource: Option<MemoryResource>,
    /// The largest frame accepted from a receiver.
    pub max_frame_bytes: usize,
    /// The users whose processes may receive, told by the kernel (`SO_PEERCRED`) for each
    /// connection; `None` (the default): only this process's own user. A process refused is told
    /// so and disconnected before it sees the schema ([`SenderEvent::Refused`]). Every receiver
    /// can open the memory of the batches it is sent: see the [`crate::ipc`] docs before allowing
    /// other users.
    pub allowed_uids: Option<Vec<u32>>,
    /// The most connections at once (receivers, and processes being greeted); one past it is told
    /// so and disconnected ([`SenderEvent::Refused`]). Each receiver costs a thread, a ring of
    /// 1 MiB of shared memory and an eventfd.
    pub max_receivers: usize,
    /// Announce each region of shared device memory this process makes from now on (of at most
    /// 256 MiB, what a receiver keeps) to the receivers connected then, as soon as it is made, so
    /// that they map it while they wait for batches: the first batch lent from a new region then
    /// finds it mapped, instead of waiting for the receiver to import and map it (70-120 µs on an
    /// H100 or H200). Every receiver maps every region the process makes, for whatever use, and
    /// keeps it among the most recent regions it was sent; a receiver that is not waiting in
    /// [`Receiver::recv`](crate::ipc::Receiver::recv) maps them in its next call. The thread that
    /// makes a region sends its announcement, which takes microseconds beside the hundreds that
    /// making the region takes (but waits, as a send does, for a receiver that takes no frames).
    /// Off by default.
    pub announce_regions: bool,
}

impl Default for SenderOptions {
    fn default() -> Self {
        SenderOptions {
            max_in_flight_bytes: 4 << 30,
            send_timeout: Duration::from_secs(30),
            zero_copy: true,
            message_resource: None,
            max_frame_bytes: 1 << 20,
            allowed_uids: None,
            max_receivers: 64,
            announce_regions: false,
        }
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
    /// Keeps the shared device regions of acknowledged messages for the next ones.
    _keep_idle: KeepIdle,
    /// Announces each region of shared device memory this process makes, with
    /// [`SenderOptions::announce_regions`].
    _announcing: Option<Arc<MadeWatcher>>,
}

/// Released interprocess events kept resting before one is recorded again.
const SPARE_EVENTS: usize = 4;

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sender({}, {:?})", self.path.display(), self.status())
    }
}

impl Sender {
    /// Binds `path` (a stale socket file left by a dead process is replaced) and starts accepting
    /// receivers for batches of `schema`. A file at `path` that belongs to another user is
    /// neither replaced nor used ([`std::io::ErrorKind::PermissionDenied`]); put sockets in a
    /// directory only this user can enter, such as [`private_socket_path`](crate::ipc::private_socket_path)'s.
    pub fn bind(path: impl AsRef<Path>, schema: SchemaRef, options: SenderOptions) -> Result<Sender> {
        let path = path.as_ref().to_path_buf();
        check_owner(&path)?;
        // This process holds a descriptor of each region of shared device memory it makes (each is
        // exported as it is made): room for as many as a receiver keeps, and as many more, so that
        // making one for a batch does not wait for the table to grow.
        wire::reserve_descriptors(2 * KEPT_REGIONS);
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && is_stale(&path) => {
                std::fs::remove_file(&path).map_err(|e| Error::io("removing a stale socket", e))?;
                UnixListener::bind(&path).map_err(|e| Error::io("binding the channel socket", e))?
            }
            Err(e) => return Err(Error::io(format!("binding {}", path.display()), e)),
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the channel socket", e))?;
        let hello = Frame::Hello {
            schema: encode_schema(&schema),
        };
        let shared = Arc::new(Shared::new(
            hello,
            options.max_frame_bytes,
            options.send_timeout,
            options.allowed_uids.clone(),
            options.max_receivers,
        ));
        let announcing = options.announce_regions.then(|| announcer(&shared));
        let accepting = shared.clone();
        let accept = std::thread::Builder::new()
            .name("arrow-cuda-ipc-accept".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .map_err(|e| Error::io("starting the accept thread", e))?;
        Ok(Sender {
            shared,
            schema,
            options,
            path,
            next_id: AtomicU64::new(1),
            streams: Mutex::new(HashMap::new()),
            accept: Some(accept),
            _keep_idle: KeepIdle::new(),
            _announcing: announcing,
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
        let deadline = wire::deadline(timeout);
        let mut st = self.shared.lock();
        while !done(&st) {
            let changed = &self.shared.changed;
            st = match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
                Some(left) if left.is_zero() => {
                    return Err(Error::io(format!("waiting for {what}"), io::ErrorKind::TimedOut.into()));
                }
                Some(left) => changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0,
                None => changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            };
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
    /// message. Blocks while a receiver has no credit for it ([`SenderOptions::max_in_flight_bytes`]
    /// unacknowledged), for at most [`SenderOptions::send_timeout`], after which that receiver is
    /// dropped ([`SenderEvent::Dropped`]) and the batch goes to the others. For CUDA batches still being written, an IPC
    /// event recorded after the batch's ready event (and after the copy, if any) orders the
    /// receivers' work after it.
    pub fn send(&self, batch: &DeviceRecordBatch) -> Result<u64> {
        let mut laps = Laps::start();
        if batch.schema().fields() != self.schema.fields() {
            return Err(Error::InvalidArgument(
                "the batch's fields differ from the channel's schema".into(),
            ));
        }
        let peers = {
            let st = self.shared.lock();
            if st.last.is_some() {
                return Err(Error::InvalidArgument("the stream has ended".into()));
            }
            Shared::active(&st)
        };
        // Receivers asleep wake while the batch is described, not after its frame is written.
        for (_, link) in &peers {
            link.wake();
        }
        laps.lap("send.wake");
        let device = batch.device();
        let (described, mut shared) = match self.route(batch)? {
            Route::Lend(located) => {
                let shared = located.shared_regions();
                (Some(located.export()?), shared)
            }
            Route::Copy(_) => (None, Vec::new()),
        };
        laps.lap("send.describe");
        let estimate = described
            .as_ref()
            .map_or_else(|| batch.size_in_bytes() as u64, |d| d.body_bytes());
        self.wait_for_room(estimate);
        laps.lap("send.credit");
        let stream = self.stream(device)?;
        let (descriptor, lease, ready): (BatchDescriptor, Box<dyn Any + Send>, Event) = match described {
            Some(d) => (d, Box::new(batch.clone()), batch.ready().clone()),
            None => {
                let resource = self
                    .options
                    .message_resource
                    .unwrap_or_else(|| MemoryResource::shared_for(device));
                let message = write_message_to(batch, resource, &stream)?;
                shared.extend(SharedDeviceRegion::find(message.buffer()).map(|(region, _)| region));
                let ready = message.ready().clone();
                (BatchDescriptor::of_message(&message)?, Box::new(message), ready)
            }
        };
        laps.lap("send.message");
        let event = self.order_after(descriptor.device, &ready, &stream)?;
        laps.lap("send.event");
        // Its steps: send.lend, send.frame.
        self.lend(descriptor, lease, event, shared)
    }

    /// How `batch` travels: lent as it is when [`SenderOptions::zero_copy`] is on and its memory
    /// allows, else copied into a message. Memory that would be lent through CUDA IPC handles,
    /// whose reads become undefined once this process frees it or dies, is copied into shared
    /// device memory instead where the GPU has it. Decided before anything is exported or copied.
    fn route<'a>(&self, batch: &'a DeviceRecordBatch) -> Result<Route<'a>> {
        if !self.options.zero_copy {
            return Ok(Route::Copy("zero-copy sending is off".into()));
        }
        Ok(match Route::of(batch)? {
            Route::Lend(located)
                if located.lends_cuda_ipc()
                    && matches!(
                        MemoryResource::shared_for(batch.device()),
                        MemoryResource::SharedDevice(_)
                    ) =>
            {
                Route::Copy("CUDA IPC memory is copied into shared device memory, which receivers keep".into())
            }
            other => other,
        })
    }

    /// Orders the receivers' use of a batch on `device` after `ready`. Receivers may touch the
    /// bytes only after they are in place: on a GPU through an IPC event recorded after them (none
    /// when they are in place already: the device has finished writing them, so any later work
    /// sees them), on the CPU (shared memory) once they are there.
    fn order_after(
        &self,
        device: Device,
        ready: &Event,
        stream: &Stream,
    ) -> Result<Option<(IpcEvent, IpcEventHandle)>> {
        Ok(match device {
            Device::Cuda(_) if ready.is_complete()? => None,
            Device::Cuda(o) => {
                stream.wait(ready)?;
                let e = self.take_event(o)?;
                e.0.record(stream)?;
                Some(e)
            }
            _ => {
                ready.synchronize()?;
                None
            }
        })
    }

    /// Lends a described batch to every receiver connected now, keeping `lease` (and `event`)
    /// until each is done; returns its id, or 0 when no receiver was connected. Its steps: keeping
    /// the batch (`send.lend`), then encoding and writing its frame to each (`send.frame`).
    fn lend(
        &self,
        descriptor: BatchDescriptor,
        lease: Box<dyn Any + Send>,
        event: Option<(IpcEvent, IpcEventHandle)>,
        shared: Vec<Arc<SharedDeviceRegion>>,
    ) -> Result<u64> {
        let mut laps = Laps::start();
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
                    // `finish` ran since the check in `send`.
                    Some(_) => Err(Error::InvalidArgument("the stream has ended".into())),
                    None => Ok(0),
                };
            }
            let pending = peers.iter().map(|(id, _)| *id).collect();
            for (peer, _) in &peers {
                st.charge(*peer, bytes);
            }
            st.in_flight.insert(
                id,
                InFlight {
                    pending,
                    bytes,
                    _lease: lease,
                    event,
                    shared,
                    reclaimed: false,
                },
            );
            st.in_flight_bytes += bytes;
            st.status.sent += 1;
            peers
        };
        laps.lap("send.lend");
        self.shared.broadcast(&peers, &frame);
        laps.lap("send.frame");
        Ok(id)
    }

    /// Waits until every receiver has credit for `bytes` more; those still without it after
    /// [`SenderOptions::send_timeout`] are dropped.
    fn wait_for_room(&self, bytes: u64) {
        let credit = self.options.max_in_flight_bytes;
        let timeout = self.options.send_timeout;
        if self
            .wait_until(timeout, "credit", |st| st.out_of_credit(bytes, credit).is_empty())
            .is_ok()
        {
            return;
        }
        let mut st = self.shared.lock();
        for peer in st.out_of_credit(bytes, credit) {
            let reason = format!("it held its credit of {credit} bytes unacknowledged for {timeout:?}");
            st.drop_peer(peer, reason);
        }
        drop(st);
        self.shared.changed.notify_all();
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

/// What announces each region of shared device memory this process makes to `shared`'s receivers
/// ([`SenderOptions::announce_regions`]), on the thread that made it, until it drops: the frame
/// costs that thread microseconds (a write on each receiver's socket, with the region's
/// descriptor), beside the hundreds of microseconds the region took to make and export.
fn announcer(shared: &Arc<Shared>) -> Arc<MadeWatcher> {
    let shared = Arc::downgrade(shared);
    let watcher: Arc<MadeWatcher> = Arc::new(move |region: &Arc<SharedDeviceRegion>| {
        let Some(shared) = shared.upgrade() else { return };
        if region.size() > KEPT_BYTES {
            return;
        }
        let Ok(uuid) = DeviceUuid::of(region.ordinal()) else {
            return;
        };
        let peers = {
            let st = shared.lock();
            match st.last {
                None => Shared::active(&st),
                Some(_) => return,
            }
        };
        if !peers.is_empty() {
            shared.broadcast(&peers, &Frame::Regions(vec![(uuid, region.announced())]));
        }
    });
    SharedDeviceRegion::watch_made(&watcher);
    watcher
}

/// Whether nothing listens at `path` any more.
fn is_stale(path: &Path) -> bool {
    matches!(UnixStream::connect(path), Err(e) if e.kind() == io::ErrorKind::ConnectionRefused)
}

#[cfg(test)]
mod tests {
    use arrow_array::{ArrayRef, Int64Array, RecordBatch};

    use super::*;
    use crate::transfer::htod_async;

    fn on_cpu(resource: MemoryResource) -> DeviceRecordBatch {
        let ints: ArrayRef = Arc::new(Int64Array::from_iter_values(0..100));
        let batch = RecordBatch::try_from_iter([("ints", ints)]).unwrap();
        htod_async(&batch, resource, &Stream::cpu()).unwrap()
    }

    fn lent(route: Route<'_>) -> bool {
        matches!(route, Route::Lend(_))
    }

    /// The path a batch takes is decided before anything is exported: lent as it is when its memory
    /// can be opened by another process and its arrays have an IPC layout, copied otherwise.
    #[test]
    fn the_route_is_decided_up_front() {
        let path = std::env::temp_dir().join(format!("acipc-unit-{}-route.sock", std::process::id()));
        let shared = on_cpu(MemoryResource::SharedHost);
        let sender = Sender::bind(&path, shared.schema().clone(), SenderOptions::default()).unwrap();
        assert!(lent(sender.route(&shared).unwrap()));
        let sliced = shared.slice(1, 10).unwrap();
        assert!(!lent(sender.route(&sliced).unwrap()), "a slice has no IPC layout");
        let private = on_cpu(MemoryResource::Host);
        assert!(
            !lent(sender.route(&private).unwrap()),
            "plain host memory is not shared"
        );
        // The public `describe` reports the same decisions as `Unsupported`.
        assert!(BatchDescriptor::describe(&shared).is_ok());
        assert!(matches!(BatchDescriptor::describe(&sliced), Err(Error::Unsupported(_))));
        assert!(matches!(
            BatchDescriptor::describe(&private),
            Err(Error::Unsupported(_))
        ));

        let copying = SenderOptions {
            zero_copy: false,
            ..SenderOptions::default()
        };
        let path2 = path.with_extension("copy.sock");
        let sender2 = Sender::bind(&path2, shared.schema().clone(), copying).unwrap();
        assert!(!lent(sender2.route(&shared).unwrap()), "zero copy is off");
    }
}
