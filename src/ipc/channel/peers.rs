//! A sender's side of its receivers: who is connected, which batches each holds, and the threads
//! that accept receivers and read their acknowledgements. A batch lent to receivers is kept (with
//! its interprocess event) until the last of them acknowledges it or goes away.
//!
//! No receiver can hold up the others for long. Each has its own credit (the body bytes it may
//! hold unacknowledged); a send waits for a receiver out of credit, or for room in its ring or
//! socket, at most the send timeout, then drops that receiver: nothing more is sent to it and its
//! connection is shut for writing, so its next receive fails. What it holds stays lent until it
//! acknowledges it or its connection ends (memory a receiver may still map is never freed under
//! it). Each connection is greeted and read on a thread of its own, outside the state's lock, and
//! connections past the limit are refused at once.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::ipc::channel::access::check_peer;
use crate::ipc::channel::protocol::{Frame, Link};
use crate::ipc::channel::ring::RingWriter;
use crate::ipc::event::{IpcEvent, IpcEventHandle};
use crate::ipc::wire::FrameReader;
use crate::memory::shared_device::SharedDeviceRegion;

/// Something that happened to a sender's receivers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// A process connected as a user that [`SenderOptions::allowed_uids`](crate::ipc::SenderOptions::allowed_uids)
    /// does not allow, or whose user could not be told: it was told so and disconnected before it
    /// saw anything of the stream.
    Refused {
        /// Why, with the process's user id.
        reason: String,
    },
    /// A receiver was dropped: it held up a send past
    /// [`SenderOptions::send_timeout`](crate::ipc::SenderOptions::send_timeout), out of credit (it
    /// did not acknowledge batches) or not reading its frames. Nothing more is sent to it, and its
    /// next receive fails; the batches it holds stay lent until it acknowledges them or its
    /// connection ends.
    Dropped {
        /// The receiver's number.
        receiver: u64,
        /// How many batches it held.
        held: usize,
        /// What happened.
        reason: String,
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
    /// Receivers connected now (detached and dropped ones included until they close).
    pub receivers: usize,
    /// Receivers that joined so far.
    pub joined: u64,
    /// Receivers that left cleanly.
    pub left: u64,
    /// Receivers lost (see [`SenderEvent::Lost`]) or dropped ([`SenderEvent::Dropped`]).
    pub lost: u64,
    /// Batches sent to at least one receiver.
    pub sent: u64,
    /// Batches some receiver still holds.
    pub in_flight_batches: usize,
    /// The body bytes of those batches.
    pub in_flight_bytes: u64,
}

/// A connected receiver.
pub(super) struct Peer {
    pub(super) link: Arc<Link>,
    /// It asked for nothing more.
    detached: bool,
    /// It held up a send and was dropped: nothing more is sent to it.
    dropped: bool,
    /// The body bytes of the batches it holds: its use of its credit.
    held: u64,
}

/// A batch lent to receivers.
pub(super) struct InFlight {
    pub(super) pending: BTreeSet<u64>,
    pub(super) bytes: u64,
    /// Keeps the memory alive (and unreused) until every receiver is done.
    pub(super) _lease: Box<dyn Any + Send>,
    pub(super) event: Option<(IpcEvent, IpcEventHandle)>,
    /// The regions of shared device memory whose handles went out with it: returned (reusable)
    /// once every receiver acknowledged it.
    pub(super) shared: Vec<Arc<SharedDeviceRegion>>,
    /// A receiver's connection ended while it held the batch: it may still map the memory, which
    /// is therefore never reused.
    pub(super) reclaimed: bool,
}

/// What a sender knows of its receivers and the batches they hold, under one lock.
#[derive(Default)]
pub(super) struct State {
    pub(super) peers: BTreeMap<u64, Peer>,
    pub(super) in_flight: HashMap<u64, InFlight>,
    pub(super) in_flight_bytes: u64,
    next_peer: u64,
    /// Connections accepted and not yet closed (being greeted, or receivers).
    connections: usize,
    pub(super) status: SenderStatus,
    pub(super) events: Vec<SenderEvent>,
    /// The last frame, once sent (`End` or `Abort`): late receivers get it after `Hello`.
    pub(super) last: Option<Frame>,
    /// Interprocess events no batch uses now, by device ordinal, oldest first.
    pub(super) event_pool: HashMap<usize, VecDeque<(IpcEvent, IpcEventHandle)>>,
}

impl State {
    /// Lends `batch` (in flight already) to `peer`, which takes its bytes from its credit.
    pub(super) fn charge(&mut self, peer: u64, bytes: u64) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.held += bytes;
        }
    }

    /// `peer` is done with `batch`: its credit comes back, and the batch is released once every
    /// receiver is done with it.
    fn release(&mut self, peer: u64, batch: u64) {
        let Some(f) = self.in_flight.get_mut(&batch) else {
            return;
        };
        if !f.pending.remove(&peer) {
            return;
        }
        let (bytes, last) = (f.bytes, f.pending.is_empty());
        if let Some(p) = self.peers.get_mut(&peer) {
            p.held = p.held.saturating_sub(bytes);
        }
        if last {
            self.complete(batch);
        }
    }

    /// Drops a receiver that held up a send: it gets nothing more and its connection is shut for
    /// writing (its next receive fails); what it holds stays lent until it acknowledges it or its
    /// connection ends.
    pub(super) fn drop_peer(&mut self, peer: u64, reason: String) {
        let Some(p) = self.peers.get_mut(&peer) else { return };
        if p.dropped {
            return;
        }
        p.dropped = true;
        let _ = p.link.socket.shutdown(std::net::Shutdown::Write);
        let held = self.in_flight.values().filter(|f| f.pending.contains(&peer)).count();
        self.status.lost += 1;
        self.events.push(SenderEvent::Dropped {
            receiver: peer,
            held,
            reason,
        });
    }

    /// The receivers that hold more than `credit` bytes if lent `bytes` more (a receiver that
    /// holds nothing takes a batch of any size).
    pub(super) fn out_of_credit(&self, bytes: u64, credit: u64) -> Vec<u64> {
        self.peers
            .iter()
            .filter(|(_, p)| !p.detached && !p.dropped && p.held > 0 && p.held.saturating_add(bytes) > credit)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Releases a batch every receiver is done with: its memory is freed (or given back to its
    /// owner) before the lock is released, so a status that no longer counts it means it is gone;
    /// its event goes back to the pool.
    fn complete(&mut self, id: u64) {
        if let Some(mut done) = self.in_flight.remove(&id) {
            self.in_flight_bytes -= done.bytes;
            if !done.reclaimed {
                done.shared.iter().for_each(|r| r.returned());
            }
            if let Some(e) = done.event.take() {
                self.recycle(e);
            }
        }
    }

    /// Keeps an event no batch uses for the next batch on its device.
    pub(super) fn recycle(&mut self, event: (IpcEvent, IpcEventHandle)) {
        let ordinal = event.0.device().ordinal().unwrap_or(0);
        self.event_pool.entry(ordinal).or_default().push_back(event);
    }
}

/// The part of a sender its background threads share: the state, a condition variable signalled
/// when it changes, and what a new receiver is greeted with.
pub(super) struct Shared {
    state: Mutex<State>,
    pub(super) changed: Condvar,
    pub(super) closed: AtomicBool,
    hello: Frame,
    max_frame: usize,
    write_timeout: Duration,
    /// The users whose processes may connect (`None`: this process's own).
    allowed_uids: Option<Vec<u32>>,
    /// The most connections at once.
    max_receivers: usize,
}

impl Shared {
    /// Nothing connected yet: receivers will be greeted with `hello`, their frames may be up to
    /// `max_frame` bytes, a write to one may block for `write_timeout`, only processes of
    /// `allowed_uids` (`None`: this process's user) are accepted, and at most `max_receivers` at
    /// once.
    pub(super) fn new(
        hello: Frame,
        max_frame: usize,
        write_timeout: Duration,
        allowed_uids: Option<Vec<u32>>,
        max_receivers: usize,
    ) -> Shared {
        Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            closed: AtomicBool::new(false),
            hello,
            max_frame,
            write_timeout,
            allowed_uids,
            max_receivers,
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a new connection: refused at once past the connection limit, else greeted and read on
    /// a thread of its own, so that a process slow to take its greeting holds up nobody.
    fn accept(self: &Arc<Self>, socket: UnixStream) {
        let admitted = {
            let mut st = self.lock();
            let room = st.connections < self.max_receivers;
            st.connections += usize::from(room);
            room
        };
        if !admitted {
            let reason = format!("too many receivers (at most {} at once)", self.max_receivers);
            return self.refuse(socket, reason);
        }
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("arrow-cuda-ipc-peer".into())
            .spawn(move || {
                shared.serve(socket);
                shared.lock().connections -= 1;
                shared.changed.notify_all();
            });
        if spawned.is_err() {
            self.lock().connections -= 1;
        }
    }

    /// Tells a process that it is refused and why, without waiting for it, and records it.
    fn refuse(&self, socket: UnixStream, reason: String) {
        // Recorded before the process can learn it, so that the sender's events say so by then.
        let frame = Frame::Abort(format!("refused: {reason}"));
        self.lock().events.push(SenderEvent::Refused { reason });
        self.changed.notify_all();
        // A fresh socket's buffer takes this small frame; a full one is not waited for.
        if socket.set_nonblocking(true).is_ok() {
            let _ = Link::new(socket).send(&frame);
        }
    }

    /// Greets a new receiver, hands it its ring and reads its acknowledgements until its
    /// connection ends. Only the registration takes the state's lock, never the greeting.
    fn serve(&self, socket: UnixStream) {
        if socket.set_nonblocking(false).is_err() || socket.set_write_timeout(Some(self.write_timeout)).is_err() {
            return;
        }
        if let Err(e) = check_peer(&socket, self.allowed_uids.as_deref()) {
            // The refused process learns why, and nothing of the stream.
            return self.refuse(socket, e.to_string());
        }
        let Ok(reader) = socket.try_clone() else { return };
        let Ok(ring) = RingWriter::create() else {
            return;
        };
        let Ok(handover) = Frame::ring(&ring) else { return };
        let link = Arc::new(Link::new(socket));
        if link.send(&self.hello).is_err() || link.send(&handover).is_err() {
            return;
        }
        link.attach(ring);
        // Registered after the greeting: batches lent from now on go to it too. A stream that
        // ended before is ended for it here; one that ends after sends it its end (`close_with`
        // sees it registered).
        let (id, last) = {
            let mut st = self.lock();
            let id = st.next_peer;
            st.next_peer += 1;
            let peer = Peer {
                link: link.clone(),
                detached: false,
                dropped: false,
                held: 0,
            };
            st.peers.insert(id, peer);
            st.status.joined += 1;
            st.events.push(SenderEvent::Joined { receiver: id });
            let last = match &st.last {
                Some(Frame::End) => Some(Frame::End),
                Some(Frame::Abort(reason)) => Some(Frame::Abort(reason.clone())),
                _ => None,
            };
            (id, last)
        };
        self.changed.notify_all();
        if let Some(last) = last {
            self.broadcast(&[(id, link)], &last);
        }
        self.read_peer(id, reader);
    }

    /// Reads one receiver's frames until its connection ends.
    fn read_peer(&self, id: u64, socket: UnixStream) {
        let mut reader = FrameReader::new(self.max_frame);
        let reason = loop {
            match reader.recv(socket.as_fd(), None) {
                Ok(None) => break None,
                Ok(Some(frame)) => match Frame::decode(frame, None) {
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
        self.lock().release(peer, batch);
        self.changed.notify_all();
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
                if let Some(f) = st.in_flight.get_mut(id) {
                    f.reclaimed = true;
                }
                // `peer` is gone from `peers`: only the batches are released.
                st.release(peer, *id);
            }
            let clean = held.is_empty() && reason.is_none() && (p.detached || st.last.is_some());
            if p.dropped {
                // Counted and reported when it was dropped.
            } else if clean {
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

    /// Sends `frame` to `peers`; a receiver that takes no frame within the write timeout (or
    /// whose socket fails) is dropped.
    pub(super) fn broadcast(&self, peers: &[(u64, Arc<Link>)], frame: &Frame) {
        for (id, link) in peers {
            if let Err(e) = link.send(frame) {
                self.lock().drop_peer(*id, format!("sending to it failed: {e}"));
                self.changed.notify_all();
            }
        }
    }

    /// The receivers still receiving.
    pub(super) fn active(st: &State) -> Vec<(u64, Arc<Link>)> {
        st.peers
            .iter()
            .filter(|(_, p)| !p.detached && !p.dropped)
            .map(|(id, p)| (*id, p.link.clone()))
            .collect()
    }
}

/// Accepts receivers until the sender closes.
pub(super) fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
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
            Ok((socket, _)) => shared.accept(socket),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
