//! The shared-memory ring that carries a sender's frames to one receiver.
//!
//! A socket write and the read at the other end cost a few microseconds each, more on a virtual
//! machine: on the GPU machines they were about a quarter of a small batch's latency. So the sender
//! makes, for each receiver, a sealed memfd with a header and a ring of bytes, and an eventfd as a
//! doorbell, and passes both with `SCM_RIGHTS` right after its greeting. From then on every frame
//! it sends that receiver is an entry in the ring: a `u32` length, the payload, padding to 8 bytes.
//! A frame with descriptors attached, or one too large for the ring, goes on the socket, announced
//! by an entry whose length is [`ON_SOCKET`], so entries and socket frames keep one order. The
//! receiver's acknowledgements still go on the socket, whose end is also how each side learns that
//! the other has gone.
//!
//! The header holds the bytes written (`tail`; only the sender stores it), the bytes consumed
//! (`head`; only the receiver stores it), and a flag the receiver raises before it sleeps. A sender
//! that finds the flag raised after publishing an entry lowers it and writes the doorbell. Each
//! side stores its own word and then loads the other's, both sequentially consistent, so at least
//! one of them sees the other: no entry is left waiting for a receiver that sleeps.
//!
//! A sender also rings ahead: as a send begins, before the batch is described, it lowers a raised
//! flag and writes the doorbell, so that the receiver's thread wakes (several microseconds on the
//! GPU machines) while the entry is made; a receiver woken to an empty ring polls for the entry a
//! short while before it sleeps again (see `Receiver::recv`), and the push finds it awake.
//!
//! Neither side trusts the other. Each keeps its own position privately and only reads the other's,
//! checking that it stays within the ring. The receiver copies an entry out of shared memory before
//! it reads it, and checks its length against what was published and against its frame limit. A
//! peer that breaks these rules is an error, never a read out of bounds.
//!
//! Every access to the shared bytes is atomic (relaxed loads and stores of aligned words, of bytes
//! at the unaligned edges), never a plain read or write: the other process may write them at any
//! moment (a broken or hostile one, even while they are copied), and a plain access racing with a
//! write is undefined behaviour for the compiler, which may assume the bytes do not change under
//! it. With atomic accesses such a race only garbles the copy, which is then checked.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ipc::wire::{self, wait_readable};
use crate::memory::shm;

/// The ring's size in bytes, a power of two. A 100-column batch's frame takes about 3 KiB.
pub(crate) const CAPACITY: usize = 1 << 20;
/// The header: the sender's `tail`, the receiver's `head` and its sleeping flag, each on a cache
/// line of its own, in one page.
const HEADER: usize = 4096;
const TAIL: usize = 0;
const HEAD: usize = 64;
const SLEEPING: usize = 128;
/// The length word of an entry that announces a frame on the socket.
const ON_SOCKET: u32 = u32::MAX;
/// How long a sender waiting for room in the ring sleeps between looks.
const ROOM_POLL: Duration = Duration::from_micros(50);

/// The bytes an entry with a payload of `len` bytes takes.
fn entry_len(len: usize) -> usize {
    (4 + len).next_multiple_of(8)
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// A ring's memory mapped into this process, read and write.
struct Shared {
    address: *mut u8,
    capacity: usize,
}

// SAFETY: the mapping is plain memory, reached only through atomics and copies (see `copy_in`).
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    /// Maps the ring, every page faulted in: the first pass of frames through the ring would
    /// otherwise fault in each page it writes (the sender) and reads (the receiver). On an H200
    /// machine a first 8 KiB frame cost the sender's copy 8-10 µs where a later one took 1.3-1.6,
    /// and a first 8 KiB copy into a fresh memfd mapping 5.1-5.2 µs
    /// (`scripts/probes/first_touch.c`).
    fn map(memory: BorrowedFd<'_>, capacity: usize) -> Result<Shared> {
        let address = shm::map(memory, HEADER + capacity, libc::PROT_READ | libc::PROT_WRITE, true)?;
        Ok(Shared {
            address: address as *mut u8,
            capacity,
        })
    }

    fn counter(&self, at: usize) -> &AtomicU64 {
        // SAFETY: `at` is a 64-byte aligned offset in the mapped header page, which lives as long
        // as `self`; the other process reaches this word only atomically too.
        unsafe { AtomicU64::from_ptr(self.address.add(at).cast()) }
    }

    fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: as in `counter`.
        unsafe { AtomicU32::from_ptr(self.address.add(SLEEPING).cast()) }
    }

    /// The ring's bytes from position `pos` on, in one or two pieces: `(offset, len)` pairs.
    fn pieces(&self, pos: u64, len: usize) -> [(usize, usize); 2] {
        let at = (pos % self.capacity as u64) as usize;
        let first = len.min(self.capacity - at);
        [(at, first), (0, len - first)]
    }

    /// Copies `bytes` into the ring at position `pos`.
    fn copy_in(&self, pos: u64, bytes: &[u8]) {
        let mut from = bytes;
        for (at, n) in self.pieces(pos, bytes.len()) {
            // SAFETY: `at + n <= capacity` bytes of the mapped ring, which lives as long as `self`.
            // The receiver reads these bytes only after the tail that publishes them, and only
            // atomically.
            unsafe { store(self.address.add(HEADER + at), &from[..n]) };
            from = &from[n..];
        }
    }

    /// Copies the ring's bytes at position `pos` into `out`.
    fn copy_out(&self, pos: u64, out: &mut [u8]) {
        let mut to = out;
        for (at, n) in self.pieces(pos, to.len()) {
            // SAFETY: `at + n <= capacity` bytes of the mapped ring, which lives as long as `self`,
            // into private memory. A sender that writes them meanwhile garbles only the copy,
            // which is checked.
            unsafe { load(self.address.add(HEADER + at), &mut to[..n]) };
            to = &mut to[n..];
        }
    }
}

/// Copies `out.len()` bytes of shared memory from `from` through relaxed atomic loads: aligned
/// 8-byte words, and single bytes before the first and after the last.
///
/// # Safety
/// `from..from + out.len()` is mapped memory that stays mapped during the call and that every
/// other party reaches only atomically.
unsafe fn load(from: *const u8, out: &mut [u8]) {
    let head = from.align_offset(8).min(out.len());
    let words = (out.len() - head) / 8;
    let (first, rest) = out.split_at_mut(head);
    let (middle, last) = rest.split_at_mut(8 * words);
    let byte = |i: usize| {
        // SAFETY: byte `i` of the range (caller), reached atomically by everyone.
        unsafe { AtomicU8::from_ptr(from.add(i).cast_mut()) }.load(Ordering::Relaxed)
    };
    first.iter_mut().enumerate().for_each(|(i, b)| *b = byte(i));
    for (w, chunk) in middle.chunks_exact_mut(8).enumerate() {
        // SAFETY: an 8-byte aligned word of the range (`head` aligns it).
        let word = unsafe { AtomicU64::from_ptr(from.add(head + 8 * w).cast_mut().cast()) };
        chunk.copy_from_slice(&word.load(Ordering::Relaxed).to_ne_bytes());
    }
    let end = head + 8 * words;
    last.iter_mut().enumerate().for_each(|(i, b)| *b = byte(end + i));
}

/// Copies `bytes` into shared memory at `to` through relaxed atomic stores, as [`load`] reads.
///
/// # Safety
/// `to..to + bytes.len()` is mapped writable memory that stays mapped during the call and that
/// every other party reaches only atomically.
unsafe fn store(to: *mut u8, bytes: &[u8]) {
    let head = to.align_offset(8).min(bytes.len());
    let words = (bytes.len() - head) / 8;
    let (first, rest) = bytes.split_at(head);
    let (middle, last) = rest.split_at(8 * words);
    let byte = |i: usize, b: u8| {
        // SAFETY: byte `i` of the range (caller), reached atomically by everyone.
        unsafe { AtomicU8::from_ptr(to.add(i)) }.store(b, Ordering::Relaxed)
    };
    first.iter().enumerate().for_each(|(i, b)| byte(i, *b));
    for (w, chunk) in middle.chunks_exact(8).enumerate() {
        // SAFETY: an 8-byte aligned word of the range (`head` aligns it).
        let word = unsafe { AtomicU64::from_ptr(to.add(head + 8 * w).cast()) };
        word.store(
            u64::from_ne_bytes(chunk.try_into().expect("8 bytes")),
            Ordering::Relaxed,
        );
    }
    let end = head + 8 * words;
    last.iter().enumerate().for_each(|(i, b)| byte(end + i, *b));
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; nothing refers to it past `self`.
        unsafe { libc::munmap(self.address.cast(), HEADER + self.capacity) };
    }
}

/// A new eventfd, non-blocking.
fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain flags; the result is checked.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(Error::io("eventfd", io::Error::last_os_error()));
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The sender's end of a ring.
pub(crate) struct RingWriter {
    shared: Shared,
    memory: OwnedFd,
    bell: OwnedFd,
    /// The bytes written so far (the receiver's copy in the header is never read back).
    tail: u64,
}

impl RingWriter {
    /// A new ring of [`CAPACITY`] bytes.
    pub fn create() -> Result<RingWriter> {
        let memory = shm::sealed_memfd(HEADER + CAPACITY)?;
        let shared = Shared::map(memory.as_fd(), CAPACITY)?;
        // Written once (with the zeros it holds) before any frame: a populated page is still
        // faulted on its first write (0.8-1.0 µs an 8 KiB copy on an H200 machine, against
        // 0.2-0.3 into pages written before: `scripts/probes/first_touch.c`).
        // SAFETY: the whole mapping, which no other process has yet.
        unsafe { std::ptr::write_bytes(shared.address, 0, HEADER + CAPACITY) };
        Ok(RingWriter {
            shared,
            memory,
            bell: eventfd()?,
            tail: 0,
        })
    }

    /// The ring's memory, to pass to the receiver.
    pub fn memory(&self) -> BorrowedFd<'_> {
        self.memory.as_fd()
    }

    /// The doorbell, to pass to the receiver.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.bell.as_fd()
    }

    /// Whether a frame of `len` payload bytes goes in the ring (larger ones go on the socket).
    pub fn fits(&self, len: usize) -> bool {
        entry_len(len) <= self.shared.capacity / 4
    }

    /// Appends an entry: the frame `payload`, or with `None` the announcement of the next frame on
    /// `socket`. Waits while the ring is full, as a write to the socket would: failing when the
    /// receiver's connection has ended or the socket's write timeout passes first. A receiver
    /// whose position is not in the ring is an [`io::ErrorKind::InvalidData`] error.
    pub fn push(&mut self, payload: Option<&[u8]>, socket: &UnixStream) -> io::Result<()> {
        let (word, body) = match payload {
            Some(p) if self.fits(p.len()) => (p.len() as u32, p),
            Some(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a frame too large for the ring",
                ));
            }
            None => (ON_SOCKET, &[][..]),
        };
        let need = entry_len(body.len()) as u64;
        self.wait_for_room(need, socket)?;
        self.shared.copy_in(self.tail, &word.to_le_bytes());
        self.shared.copy_in(self.tail + 4, body);
        self.tail += need;
        self.shared.counter(TAIL).store(self.tail, Ordering::SeqCst);
        self.wake();
        Ok(())
    }

    /// Whether the receiver has raised its flag to sleep.
    #[cfg(test)]
    pub fn receiver_sleeps(&self) -> bool {
        self.shared.sleeping().load(Ordering::SeqCst) != 0
    }

    /// Rings the doorbell if the receiver is asleep, lowering its flag. After a push this wakes a
    /// receiver that went to sleep before the entry came; called as a send begins, before the
    /// entry is made, it wakes the receiver while the sender makes it, and the push then finds the
    /// receiver awake and rings nothing.
    pub fn wake(&self) {
        if self.shared.sleeping().swap(0, Ordering::SeqCst) != 0 {
            // SAFETY: 8 bytes from a valid u64 to our eventfd. A full counter (EAGAIN) means the
            // bell is ringing already.
            unsafe { libc::write(self.bell.as_raw_fd(), (&1u64 as *const u64).cast(), 8) };
        }
    }

    fn wait_for_room(&self, need: u64, socket: &UnixStream) -> io::Result<()> {
        let capacity = self.shared.capacity as u64;
        // Set when the ring is first found full: `Some(None)` waits without limit.
        let mut deadline: Option<Option<Instant>> = None;
        loop {
            let used = self
                .tail
                .wrapping_sub(self.shared.counter(HEAD).load(Ordering::Acquire));
            if used > capacity {
                return Err(invalid("the receiver's ring position is outside the ring"));
            }
            if capacity - used >= need {
                return Ok(());
            }
            let deadline = match deadline {
                Some(d) => d,
                None => *deadline.insert(socket.write_timeout()?.and_then(wire::deadline)),
            };
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "waiting for room in the ring"));
            }
            let mut poll = libc::pollfd {
                fd: socket.as_raw_fd(),
                events: 0,
                revents: 0,
            };
            // SAFETY: one valid pollfd; a zero timeout never blocks.
            let ended =
                unsafe { libc::poll(&mut poll, 1, 0) } > 0 && poll.revents & (libc::POLLHUP | libc::POLLERR) != 0;
            if ended {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the receiver's connection ended",
                ));
            }
            std::thread::sleep(ROOM_POLL);
        }
    }
}

/// One entry taken from a ring.
pub(crate) enum Entry<'a> {
    /// A frame's payload.
    Frame(&'a [u8]),
    /// The next frame is on the socket.
    OnSocket,
}

/// What woke a receiver asleep on its ring.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// The ring may hold an entry, or the sender rang ahead of one.
    Ring,
    /// The socket has bytes to read, or has ended.
    Socket,
}

/// The receiver's end of a ring.
pub(crate) struct RingReader {
    shared: Shared,
    bell: OwnedFd,
    /// The bytes consumed so far (the sender's copy in the header is never read back).
    head: u64,
    /// The largest frame accepted.
    max: usize,
    /// The last entry taken, copied out of shared memory.
    buf: Vec<u8>,
}

impl RingReader {
    /// Maps the ring a sender passed: `memory` must be a memfd sealed against shrinking of the
    /// header and `capacity` bytes, a power of two of at least a page. Frames over `max` bytes are
    /// refused. Anything else is [`Error::InvalidData`].
    pub fn open(memory: OwnedFd, bell: OwnedFd, capacity: u64, max: usize) -> Result<RingReader> {
        let capacity = usize::try_from(capacity)
            .ok()
            .filter(|c| c.is_power_of_two() && (HEADER..=1 << 30).contains(c))
            .ok_or_else(|| Error::InvalidData(format!("a ring of {capacity} bytes")))?;
        shm::check_sealed(memory.as_fd(), HEADER + capacity)?;
        // Whatever the sender made it, reads of the doorbell must not block.
        // SAFETY: fcntl on a descriptor we hold; the results are checked.
        let nonblocking = unsafe {
            let flags = libc::fcntl(bell.as_raw_fd(), libc::F_GETFL);
            flags >= 0 && libc::fcntl(bell.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !nonblocking {
            return Err(Error::InvalidData(
                "a ring's doorbell is not a descriptor that can be read".into(),
            ));
        }
        Ok(RingReader {
            shared: Shared::map(memory.as_fd(), capacity)?,
            bell,
            head: 0,
            max,
            buf: Vec::new(),
        })
    }

    /// Whether the sender has published nothing past what was taken.
    pub fn is_empty(&self) -> bool {
        self.shared.counter(TAIL).load(Ordering::Acquire) == self.head
    }

    /// Takes the next entry, if the sender has published one. A ring that breaks the rules is
    /// [`Error::InvalidData`], after which the ring is of no further use.
    pub fn pop(&mut self) -> Result<Option<Entry<'_>>> {
        let tail = self.shared.counter(TAIL).load(Ordering::Acquire);
        let published = tail.wrapping_sub(self.head);
        if published == 0 {
            return Ok(None);
        }
        if published > self.shared.capacity as u64 || published < 8 {
            return Err(Error::InvalidData(format!(
                "the sender published {published} bytes in a ring of {}",
                self.shared.capacity
            )));
        }
        let mut word = [0u8; 4];
        self.shared.copy_out(self.head, &mut word);
        let len = match u32::from_le_bytes(word) {
            ON_SOCKET => {
                self.advance(8);
                return Ok(Some(Entry::OnSocket));
            }
            len => len as usize,
        };
        let need = entry_len(len);
        if len == 0 || len > self.max || need as u64 > published {
            return Err(Error::InvalidData(format!(
                "a ring entry of {len} bytes, with {published} published (at most {} are accepted)",
                self.max
            )));
        }
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        self.shared.copy_out(self.head + 4, &mut self.buf[..len]);
        self.advance(need as u64);
        Ok(Some(Entry::Frame(&self.buf[..len])))
    }

    /// Gives the bytes of the entry just taken back to the sender.
    fn advance(&mut self, bytes: u64) {
        self.head += bytes;
        self.shared.counter(HEAD).store(self.head, Ordering::Release);
    }

    /// Sleeps until the sender publishes an entry or `socket` has something to read (or has ended),
    /// for at most `timeout` (`None`: no limit); `None` when the timeout passed first.
    pub fn sleep(&mut self, socket: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<Option<Woken>> {
        self.shared.sleeping().store(1, Ordering::SeqCst);
        if self.shared.counter(TAIL).load(Ordering::SeqCst) != self.head {
            self.shared.sleeping().store(0, Ordering::Relaxed);
            return Ok(Some(Woken::Ring));
        }
        let woke = wait_readable([socket, self.bell.as_fd()], timeout);
        self.shared.sleeping().store(0, Ordering::Relaxed);
        let mut rung = 0u64;
        // SAFETY: reads 8 bytes into a u64 from a non-blocking descriptor; nothing to read is fine.
        unsafe { libc::read(self.bell.as_raw_fd(), (&mut rung as *mut u64).cast(), 8) };
        Ok(woke?.map(|[socket, _]| match socket {
            0 => Woken::Ring,
            _ => Woken::Socket,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer and the reader of its ring, and the socket pair beside them.
    fn pair(max: usize) -> (RingWriter, RingReader, UnixStream, UnixStream) {
        let w = RingWriter::create().unwrap();
        let r = RingReader::open(
            w.memory().try_clone_to_owned().unwrap(),
            w.bell().try_clone_to_owned().unwrap(),
            CAPACITY as u64,
            max,
        )
        .unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        a.set_write_timeout(Some(Duration::from_millis(200))).unwrap();
        (w, r, a, b)
    }

    fn frame(r: &mut RingReader) -> Option<Vec<u8>> {
        match r.pop().unwrap()? {
            Entry::Frame(p) => Some(p.to_vec()),
            Entry::OnSocket => panic!("an announcement"),
        }
    }

    #[test]
    fn frames_come_out_in_order_across_the_wrap() {
        let (mut w, mut r, s, _peer) = pair(1 << 20);
        assert!(r.pop().unwrap().is_none() && r.is_empty());
        // Entries of odd sizes, many times round the ring, the reader a few entries behind.
        let mut expect = std::collections::VecDeque::new();
        for i in 0..5000usize {
            let payload: Vec<u8> = (0..(i * 37) % 2000 + 1).map(|j| (i + j) as u8).collect();
            w.push(Some(&payload), &s).unwrap();
            expect.push_back(payload);
            if expect.len() > 3 {
                assert_eq!(frame(&mut r).unwrap(), expect.pop_front().unwrap());
            }
        }
        w.push(None, &s).unwrap();
        while let Some(e) = expect.pop_front() {
            assert_eq!(frame(&mut r).unwrap(), e);
        }
        assert!(matches!(r.pop().unwrap(), Some(Entry::OnSocket)));
        assert!(r.pop().unwrap().is_none());
        assert!(w.tail > 2 * CAPACITY as u64, "the test went round the ring");
    }

    #[test]
    fn a_full_ring_waits_for_room_then_times_out() {
        let (mut w, mut r, s, peer) = pair(1 << 20);
        let big = vec![7u8; CAPACITY / 4 - 8];
        assert!(w.fits(big.len()) && !w.fits(big.len() + 8));
        for _ in 0..4 {
            w.push(Some(&big), &s).unwrap();
        }
        // Full: room comes when the reader takes an entry.
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(frame(&mut r).unwrap().len(), CAPACITY / 4 - 8);
            r
        });
        w.push(Some(&[1, 2, 3]), &s).unwrap();
        let _r = reader.join().unwrap();
        // Full again, and the reader takes nothing: a timeout.
        let e = w.push(Some(&big), &s).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // A receiver whose connection ended is not waited for.
        drop(peer);
        let at = Instant::now();
        let e = w.push(Some(&big), &s).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::BrokenPipe);
        assert!(at.elapsed() < Duration::from_millis(150));
        let e = w.push(Some(&vec![0; CAPACITY]), &s).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_sleeping_reader_wakes_for_an_entry_or_the_socket() {
        let (mut w, mut r, s, peer) = pair(1 << 20);
        assert_eq!(r.sleep(peer.as_fd(), Some(Duration::from_millis(10))).unwrap(), None);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            w.push(Some(b"hello"), &s).unwrap();
            (w, s)
        });
        assert_eq!(
            r.sleep(peer.as_fd(), Some(Duration::from_secs(10))).unwrap(),
            Some(Woken::Ring)
        );
        let (mut w, s) = writer.join().unwrap();
        assert_eq!(frame(&mut r).unwrap(), b"hello");
        // The bell was read: the next sleep sleeps.
        assert_eq!(r.sleep(peer.as_fd(), Some(Duration::from_millis(10))).unwrap(), None);
        // An entry published before the sleep is seen at once.
        w.push(Some(b"again"), &s).unwrap();
        assert_eq!(r.sleep(peer.as_fd(), None).unwrap(), Some(Woken::Ring));
        assert_eq!(frame(&mut r).unwrap(), b"again");
        // The sender's end of the connection closing wakes it too.
        drop(s);
        assert_eq!(
            r.sleep(peer.as_fd(), Some(Duration::from_secs(10))).unwrap(),
            Some(Woken::Socket)
        );
    }

    /// Ringing ahead wakes a reader that sleeps, and only one: the push that follows finds it awake
    /// and rings nothing more.
    #[test]
    fn ringing_ahead_wakes_a_sleeping_reader_once() {
        let (mut w, mut r, s, peer) = pair(1 << 20);
        let rung = |w: &RingWriter| {
            crate::ipc::wire::wait_readable([w.bell()], Some(Duration::ZERO))
                .unwrap()
                .is_some()
        };
        // An awake reader is not rung for.
        w.wake();
        assert!(!rung(&w));
        let reader = std::thread::spawn(move || {
            let woken = r.sleep(peer.as_fd(), Some(Duration::from_secs(10))).unwrap();
            (r, woken)
        });
        let asleep = Instant::now();
        while !w.receiver_sleeps() {
            assert!(asleep.elapsed() < Duration::from_secs(10), "the reader never slept");
            std::thread::yield_now();
        }
        w.wake();
        let (mut r, woken) = reader.join().unwrap();
        assert_eq!(woken, Some(Woken::Ring));
        assert!(r.is_empty(), "woken ahead of the entry");
        w.push(Some(b"made"), &s).unwrap();
        assert!(!rung(&w), "the push found the reader awake");
        assert_eq!(frame(&mut r).unwrap(), b"made");
    }

    /// The atomic copies move every byte, at every alignment of either end and every length.
    #[test]
    fn atomic_copies_move_every_byte() {
        let src: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        let mut shared = vec![0u64; 16];
        for at in 0..16 {
            for len in 0..40 {
                shared.iter_mut().for_each(|w| *w = 0);
                let base = shared.as_mut_ptr().cast::<u8>();
                // SAFETY: `at + len < 128` bytes of `shared`, reached only here.
                unsafe { store(base.add(at), &src[3..3 + len]) };
                let mut out = vec![0xffu8; len + 5];
                // SAFETY: as above.
                unsafe { load(base.add(at), &mut out[5..]) };
                assert_eq!(&out[5..], &src[3..3 + len], "at {at}, {len} bytes");
                // Nothing outside the range was written.
                // SAFETY: as above, the whole of `shared`.
                let all = unsafe { std::slice::from_raw_parts(base, 128) };
                assert!(
                    all[..at].iter().chain(&all[at + len..]).all(|&b| b == 0),
                    "at {at}, {len} bytes"
                );
            }
        }
    }

    #[test]
    fn a_corrupt_ring_is_an_error_not_a_stray_read() {
        // A frame over the reader's limit.
        let (mut w, mut r, s, _peer) = pair(100);
        w.push(Some(&[0; 101]), &s).unwrap();
        assert!(matches!(r.pop(), Err(Error::InvalidData(_))));
        // A tail past the ring.
        let (w, mut r, _s, _peer) = pair(100);
        w.shared.counter(TAIL).store(CAPACITY as u64 + 8, Ordering::SeqCst);
        assert!(matches!(r.pop(), Err(Error::InvalidData(_))));
        // A length word that claims more than was published; a zero length.
        for word in [64u32, 0] {
            let (mut w, mut r, s, _peer) = pair(100);
            w.push(Some(&[1, 2, 3]), &s).unwrap();
            w.shared.copy_in(0, &word.to_le_bytes());
            assert!(matches!(r.pop(), Err(Error::InvalidData(_))), "{word}");
        }
        // A head the receiver moved past the tail stops the sender.
        let (mut w, _r, s, _peer) = pair(100);
        w.shared.counter(HEAD).store(8, Ordering::SeqCst);
        let e = w.push(Some(&[1]), &s).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        // Descriptors that are not a sealed memfd of the announced size, or a bad capacity.
        let dup = |fd: BorrowedFd<'_>| fd.try_clone_to_owned().unwrap();
        for capacity in [CAPACITY as u64 / 2, 3 << 20, 0, u64::MAX] {
            assert!(matches!(
                RingReader::open(dup(w.memory()), dup(w.bell()), capacity, 100),
                Err(Error::InvalidData(_))
            ));
        }
        assert!(matches!(
            RingReader::open(dup(w.bell()), dup(w.bell()), CAPACITY as u64, 100),
            Err(Error::InvalidData(_))
        ));
    }
}
