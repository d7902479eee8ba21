//! Bytes on a Unix socket: length-prefixed frames with file descriptors attached (`SCM_RIGHTS`), and
//! the little-endian encoding of the fields inside them.
//!
//! A frame is a `u32` payload length, then the payload. Descriptors travel with the first bytes of
//! their frame. Reads check every length against what is left and against a maximum frame size, so
//! truncated, oversized and corrupt frames are errors, never panics.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

/// The most descriptors one frame carries (the kernel's `SCM_MAX_FD` is 253).
pub(crate) const MAX_FDS: usize = 250;

/// Appends little-endian fields to a payload.
#[derive(Default)]
pub(crate) struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(bytes: usize) -> Self {
        Writer {
            buf: Vec::with_capacity(bytes),
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// A `u32` length, then the bytes.
    pub fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.buf.extend_from_slice(v);
    }
    pub fn raw(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
}

/// Reads little-endian fields from a payload; running past its end is [`Error::InvalidData`].
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| {
                Error::InvalidData(format!(
                    "a frame field of {n} bytes at {} overruns a payload of {} bytes",
                    self.pos,
                    self.buf.len()
                ))
            })?;
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        self.array().map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64> {
        self.array().map(u64::from_le_bytes)
    }
    pub fn i64(&mut self) -> Result<i64> {
        self.array().map(i64::from_le_bytes)
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    /// The number of bytes left.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Checks that the whole payload was read.
    pub fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(Error::InvalidData(format!("{n} unread bytes at the end of a frame"))),
        }
    }
}

/// Sends one frame: the length, the payload, and `fds` with its first bytes. Never raises `SIGPIPE`.
pub(crate) fn send_frame(socket: BorrowedFd<'_>, payload: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors in one frame", fds.len()),
        ));
    }
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a frame over 4 GiB"))?;
    let head = len.to_le_bytes();
    let total = head.len() + payload.len();
    let mut sent = 0;
    let mut attach = fds;
    while sent < total {
        // The length and the payload go out together, from where they are.
        let parts = match sent < head.len() {
            true => [&head[sent..], payload],
            false => [&payload[sent - head.len()..], &[][..]],
        };
        sent += send_some(socket, parts, attach)?;
        attach = &[];
    }
    Ok(())
}

/// Grows this process's table of descriptors to hold at least `slots` of them, so that
/// descriptors received later (one per region of memory a receiver keeps), or made (one per region
/// of shared device memory a sender's process makes), do not grow it while a batch waits: the
/// kernel grows the table of a process with several threads (a CUDA process
/// has) only after an RCU grace period, and one `recvmsg` that did so took 5.4 ms on an H200
/// machine, 84 µs a batch over 64 first opens of regions. The table grows to hold a copy of
/// `/dev/null`'s descriptor made at `slots - 1`, closed at once. Best effort: a limit on
/// descriptors below `slots` leaves the table as it is.
pub(crate) fn reserve_descriptors(slots: usize) {
    let Ok(last) = libc::c_int::try_from(slots.saturating_sub(1)) else {
        return;
    };
    let Ok(null) = std::fs::File::open("/dev/null") else {
        return;
    };
    // SAFETY: duplicates a valid descriptor at `last` or above (growing the table to hold it);
    // the copy, this function's own, is closed at once.
    unsafe {
        let copy = libc::fcntl(null.as_raw_fd(), libc::F_DUPFD_CLOEXEC, last);
        if copy >= 0 {
            libc::close(copy);
        }
    }
}

/// Aligned storage for a control message of up to [`MAX_FDS`] descriptors.
type Control = [u64; control_words()];

fn send_some(socket: BorrowedFd<'_>, parts: [&[u8]; 2], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let mut iov = parts.map(|p| libc::iovec {
        iov_base: p.as_ptr() as *mut libc::c_void,
        iov_len: p.len(),
    });
    let mut control: Control = [0; control_words()];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    if !fds.is_empty() {
        let payload_len = (fds.len() * size_of::<libc::c_int>()) as u32;
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(payload_len) } as usize;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds `space` bytes (control_words covers MAX_FDS), so the
        // first header and its data fit in it; the header is written before its data.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload_len) as _;
            let out = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                out.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: `msg` describes valid memory for the call; MSG_NOSIGNAL turns SIGPIPE into EPIPE.
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "a socket write timed out"));
            }
            _ => return Err(e),
        }
    }
}

/// The 8-byte words a control message of [`MAX_FDS`] descriptors takes: its header (at most 24
/// bytes on any Linux ABI) and the descriptors, rounded up. `CMSG_SPACE` is not a `const fn`; a
/// unit test checks this against it.
const fn control_words() -> usize {
    (24 + MAX_FDS * size_of::<libc::c_int>()).div_ceil(8)
}

/// Receives into `buf` once without blocking, collecting any descriptors that arrive. Returns 0 at
/// end of stream, [`io::ErrorKind::WouldBlock`] when nothing has arrived.
fn recv_some(socket: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control: Control = [0; control_words()];
    // SAFETY: msghdr is plain data; every pointer set below outlives the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    let n = loop {
        // SAFETY: `msg` describes valid, writable memory for the call.
        let n = unsafe {
            libc::recvmsg(
                socket.as_raw_fd(),
                &mut msg,
                libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            _ => return Err(e),
        }
    };
    // SAFETY: the kernel filled the control buffer and set its length; the macros walk it within
    // that length, and each SCM_RIGHTS payload holds `(len - CMSG_LEN(0)) / 4` descriptors that are
    // now ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                for i in 0..bytes / size_of::<libc::c_int>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a frame carried more descriptors than allowed",
        ));
    }
    Ok(n)
}

/// One frame: the payload and the descriptors that came with it.
#[derive(Debug)]
pub(crate) struct Frame<'a> {
    pub payload: &'a [u8],
    pub fds: Vec<OwnedFd>,
}

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum RecvError {
    /// Nothing of a frame had arrived when the read timed out: the stream is still in step.
    Idle(io::Error),
    /// The stream is unusable: an I/O error, end of stream inside a frame, an oversized frame.
    Broken(Error),
}

impl RecvError {
    pub fn into_error(self) -> Error {
        match self {
            RecvError::Idle(e) => Error::io("waiting for a frame", e),
            RecvError::Broken(e) => e,
        }
    }
}

/// The moment `timeout` from now; `None` (no limit) for a timeout past what an `Instant` holds,
/// such as `Duration::MAX`.
pub(crate) fn deadline(timeout: std::time::Duration) -> Option<std::time::Instant> {
    std::time::Instant::now().checked_add(timeout)
}

/// Waits until one of `fds` has bytes to read (or has ended or failed) and returns the `revents` of
/// each; `None` when `timeout` passed first (`None`: no limit).
///
/// Readers wait here rather than in a blocking read: a thread asleep in a read is woken whenever
/// the peer reads what this end wrote (the kernel signals room to write to every sleeper), while
/// one asleep in `poll` for input is left alone. On a virtual machine each such wake-up costs the
/// peer's read microseconds.
pub(crate) fn wait_readable<const N: usize>(
    fds: [BorrowedFd<'_>; N],
    timeout: Option<std::time::Duration>,
) -> io::Result<Option<[libc::c_short; N]>> {
    let deadline = timeout.and_then(deadline);
    let mut polls = fds.map(|fd| libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    });
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => d
                .saturating_duration_since(std::time::Instant::now())
                .as_nanos()
                .div_ceil(1_000_000)
                .min(i32::MAX as u128) as i32,
        };
        // SAFETY: `N` valid pollfds for the call.
        match unsafe { libc::poll(polls.as_mut_ptr(), N as libc::nfds_t, ms) } {
            0 if ms == 0 => return Ok(None),
            0 => {}
            n if n > 0 => return Ok(Some(polls.map(|p| p.revents))),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
}

/// Whether the other end of `socket` has closed it in both directions (`POLLHUP`, or an error
/// pending): the peer died, closed it, or shut it down for good. A peer that only shut down its
/// writing half has not hung up. Asks the kernel without waiting.
pub(crate) fn hung_up(socket: BorrowedFd<'_>) -> bool {
    let mut poll = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd for the call.
        match unsafe { libc::poll(&mut poll, 1, 0) } {
            n if n > 0 => return poll.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
            0 => return false,
            _ if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            _ => return false,
        }
    }
}

/// The smallest read a [`FrameReader`] asks for.
const MIN_READ: usize = 64 << 10;

/// Reads frames from one socket through one buffer. A read takes whatever has arrived, so a frame
/// (or several) most often arrives in one system call; bytes read past a frame wait for the next.
///
/// Descriptors belong to the frame whose bytes the read that brought them ended in: the kernel
/// attaches a frame's descriptors to its first bytes and ends a read after bytes that carry
/// descriptors, so that frame is the one that sent them.
pub(crate) struct FrameReader {
    max: usize,
    buf: Vec<u8>,
    /// The unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// The bytes consumed before `buf[0]`, to place descriptors in the stream.
    base: u64,
    /// Descriptors not yet handed out, with the stream position of the last byte of their read.
    fds: std::collections::VecDeque<(u64, OwnedFd)>,
}

impl FrameReader {
    /// A reader of frames of at most `max` payload bytes.
    pub fn new(max: usize) -> FrameReader {
        FrameReader {
            max,
            buf: Vec::new(),
            start: 0,
            end: 0,
            base: 0,
            fds: Default::default(),
        }
    }

    /// Receives the next frame: `None` at a clean end of stream. Each wait for more bytes lasts at
    /// most `timeout` (`None`: no limit); a timeout with nothing of the frame read is
    /// [`RecvError::Idle`].
    pub fn recv(
        &mut self,
        socket: BorrowedFd<'_>,
        timeout: Option<std::time::Duration>,
    ) -> std::result::Result<Option<Frame<'_>>, RecvError> {
        loop {
            let have = self.end - self.start;
            if have >= 4 {
                let head = self.buf[self.start..self.start + 4].try_into().expect("4 bytes");
                let len = u32::from_le_bytes(head) as usize;
                if len == 0 || len > self.max {
                    return Err(RecvError::Broken(Error::InvalidData(format!(
                        "a frame of {len} bytes (at most {} are accepted)",
                        self.max
                    ))));
                }
                if have >= 4 + len {
                    return Ok(Some(self.take(4 + len)));
                }
                self.reserve(4 + len);
            } else {
                self.reserve(4);
            }
            let mut fds = Vec::new();
            match recv_some(socket, &mut self.buf[self.end..], &mut fds) {
                Ok(0) if have == 0 && self.fds.is_empty() => return Ok(None),
                Ok(0) => {
                    return Err(RecvError::Broken(Error::InvalidData(format!(
                        "the stream ended inside a frame, after {have} of its bytes"
                    ))));
                }
                Ok(n) => {
                    self.end += n;
                    let last = self.base + self.end as u64 - 1;
                    self.fds.extend(fds.into_iter().map(|fd| (last, fd)));
                    if self.fds.len() > MAX_FDS {
                        return Err(RecvError::Broken(Error::InvalidData(format!(
                            "{} descriptors pending on the stream",
                            self.fds.len()
                        ))));
                    }
                }
                // Nothing yet (the first read is tried before any wait, for a reader that
                // polled already).
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => match wait_readable([socket], timeout) {
                    Ok(Some(_)) => {}
                    Ok(None) => {
                        let e = io::Error::new(io::ErrorKind::TimedOut, "a socket read timed out");
                        return Err(match have {
                            0 => RecvError::Idle(e),
                            _ => RecvError::Broken(Error::io("reading a frame", e)),
                        });
                    }
                    Err(e) => return Err(RecvError::Broken(Error::io("waiting for a frame", e))),
                },
                Err(e) => return Err(RecvError::Broken(Error::io("reading a frame", e))),
            }
        }
    }

    /// Whether no bytes read are waiting to be handed out.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Hands out the frame of `total` bytes (length included) at the start of the unconsumed bytes,
    /// with the descriptors that arrived inside it.
    fn take(&mut self, total: usize) -> Frame<'_> {
        let (from, to) = (self.start, self.start + total);
        let frame_end = self.base + to as u64;
        let mut fds = Vec::new();
        while self.fds.front().is_some_and(|(at, _)| *at < frame_end) {
            fds.push(self.fds.pop_front().expect("a descriptor").1);
        }
        self.start = to;
        Frame {
            payload: &self.buf[from + 4..to],
            fds,
        }
    }

    /// Makes room for `need` unconsumed bytes and a read of at least [`MIN_READ`] past them. An
    /// empty buffer grown for a large frame goes back to its usual size.
    fn reserve(&mut self, need: usize) {
        if self.start == self.end {
            self.base += self.start as u64;
            (self.start, self.end) = (0, 0);
            let usual = need + MIN_READ;
            if self.buf.len() > 4 * usual {
                self.buf.truncate(usual);
                self.buf.shrink_to_fit();
            }
        }
        let want = need.max(self.end - self.start + MIN_READ);
        if self.buf.len() - self.start < want {
            // Move what is left to the front, then grow if that is not enough.
            self.buf.copy_within(self.start..self.end, 0);
            self.base += self.start as u64;
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// The next frame's payload and descriptor count.
    fn next(r: &mut FrameReader, s: &UnixStream) -> std::result::Result<Option<(Vec<u8>, usize)>, RecvError> {
        Ok(r.recv(s.as_fd(), s.read_timeout().unwrap())?
            .map(|f| (f.payload.to_vec(), f.fds.len())))
    }

    /// The size of this process's table of descriptors (`FDSize` in `/proc/self/status`).
    fn descriptor_table() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let size = status.lines().find_map(|l| l.strip_prefix("FDSize:"));
        size.map(|v| v.trim().parse().unwrap()).unwrap()
    }

    /// Reserving grows the table to the slots asked for (within the process's limit) and leaves
    /// the copy it made for that closed; reserving more than any table may hold does nothing.
    #[test]
    fn reserving_descriptors_grows_the_table_and_keeps_nothing_open() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a valid out-parameter.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        let slots = 2048.min(limit.rlim_cur as usize);
        reserve_descriptors(slots);
        let size = descriptor_table();
        assert!(size >= slots, "a table of {size} slots, {slots} reserved");
        // The copy went to the last slot (nothing else of the process is that high) and is closed.
        // SAFETY: only asks about a descriptor number.
        assert_eq!(unsafe { libc::fcntl(slots as libc::c_int - 1, libc::F_GETFD) }, -1);
        reserve_descriptors(usize::MAX);
        assert_eq!(descriptor_table(), size);
    }

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        // Written before any is read, so one read could take several: each frame still gets the
        // descriptors it was sent with, and no other.
        send_frame(a.as_fd(), b"first", &[]).unwrap();
        send_frame(a.as_fd(), b"hello", &[c.as_fd(), c.as_fd()]).unwrap();
        send_frame(a.as_fd(), b"again", &[]).unwrap();
        send_frame(a.as_fd(), b"three", &[c.as_fd(), c.as_fd(), c.as_fd()]).unwrap();
        let mut r = FrameReader::new(100);
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"first".to_vec(), 0)));
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"hello".to_vec(), 2)));
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"again".to_vec(), 0)));
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"three".to_vec(), 3)));
        drop(a);
        assert_eq!(next(&mut r, &b).unwrap(), None);
    }

    #[test]
    fn a_peer_hangs_up_when_it_closes_both_directions() {
        use std::net::Shutdown;
        // What a receiver's fence tells apart: a sender that ended its stream or was dropped shuts
        // down its writing half and keeps what it lent; one that died, or reclaimed what the
        // receiver held, closed the socket or shut down both halves. Unread bytes change nothing.
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), b"unread", &[]).unwrap();
        assert!(!hung_up(b.as_fd()));
        a.shutdown(Shutdown::Write).unwrap();
        assert!(!hung_up(b.as_fd()), "only its writing half is shut down");
        a.shutdown(Shutdown::Both).unwrap();
        assert!(hung_up(b.as_fd()));
        let (a, b) = UnixStream::pair().unwrap();
        send_frame(b.as_fd(), b"unread by the peer", &[]).unwrap();
        drop(a);
        assert!(hung_up(b.as_fd()), "closed, with bytes of ours unread (a reset)");
    }

    #[test]
    fn many_small_frames_come_out_of_few_reads_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let writer = std::thread::spawn(move || {
            for i in 0..1000u32 {
                send_frame(a.as_fd(), &i.to_le_bytes().repeat(1 + i as usize % 7), &[]).unwrap();
            }
        });
        let mut r = FrameReader::new(100);
        for i in 0..1000u32 {
            let (payload, fds) = next(&mut r, &b).unwrap().unwrap();
            assert_eq!((payload, fds), (i.to_le_bytes().repeat(1 + i as usize % 7), 0));
        }
        writer.join().unwrap();
        assert_eq!(next(&mut r, &b).unwrap(), None);
    }

    #[test]
    fn bad_frames_are_errors() {
        let broken = |r: std::result::Result<Option<(Vec<u8>, usize)>, RecvError>| {
            matches!(r, Err(RecvError::Broken(Error::InvalidData(_))))
        };
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&1000u32.to_le_bytes()).unwrap();
        assert!(broken(next(&mut FrameReader::new(100), &b)));
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&10u32.to_le_bytes()).unwrap();
        a.write_all(b"abc").unwrap();
        drop(a);
        assert!(broken(next(&mut FrameReader::new(100), &b)));
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[1, 0]).unwrap();
        drop(a);
        assert!(broken(next(&mut FrameReader::new(100), &b)));
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&0u32.to_le_bytes()).unwrap();
        assert!(broken(next(&mut FrameReader::new(100), &b)));
        let (a, b) = UnixStream::pair().unwrap();
        b.set_read_timeout(Some(std::time::Duration::from_millis(10))).unwrap();
        let mut r = FrameReader::new(100);
        assert!(matches!(next(&mut r, &b), Err(RecvError::Idle(_))));
        // After a timeout with nothing read the reader is still in step.
        send_frame(a.as_fd(), b"late", &[]).unwrap();
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"late".to_vec(), 0)));
    }

    #[test]
    fn frames_larger_than_the_socket_buffer_arrive_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let payload: Vec<u8> = (0..4_000_037u32).map(|i| (i % 251) as u8).collect();
        let sent = payload.clone();
        let writer = std::thread::spawn(move || {
            send_frame(a.as_fd(), &sent, &[]).unwrap();
            send_frame(a.as_fd(), b"after", &[]).unwrap();
        });
        let mut r = FrameReader::new(8 << 20);
        let (got, _) = next(&mut r, &b).unwrap().unwrap();
        assert!(got == payload);
        assert!(r.buf.len() >= payload.len());
        assert_eq!(next(&mut r, &b).unwrap(), Some((b"after".to_vec(), 0)));
        writer.join().unwrap();
        // Once the large frame is consumed, the buffer shrinks back for the next read.
        assert_eq!(next(&mut r, &b).unwrap(), None);
        assert!(r.buf.len() <= 4 + MIN_READ, "{}", r.buf.len());
    }

    #[test]
    fn control_storage_holds_the_most_descriptors() {
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize;
        assert!(control_words() * 8 >= space, "{} < {space}", control_words() * 8);
    }

    #[test]
    fn readers_check_lengths() {
        let mut w = Writer::default();
        w.u32(7);
        w.bytes(b"abc");
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u32().unwrap(), 7);
        assert_eq!(r.bytes().unwrap(), b"abc");
        r.finish().unwrap();
        assert!(Reader::new(&[5, 0, 0, 0, 1]).bytes().is_err());
        assert!(Reader::new(&[1]).u64().is_err());
        assert!(Reader::new(&[1]).finish().is_err());
    }
}
