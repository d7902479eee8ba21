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

/// Receives into `buf` once, collecting any descriptors that arrive. Returns 0 at end of stream.
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
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "a socket read timed out"));
            }
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
pub(crate) struct Frame {
    pub payload: Vec<u8>,
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
            RecvError::Idle(e) => crate::ipc::io_error("waiting for a frame", e),
            RecvError::Broken(e) => e,
        }
    }
}

/// Polls `socket` without sleeping until it has bytes to read (or has ended or failed), for at most
/// `budget`. A thread that sleeps in a read is woken by the kernel when data arrives, which costs
/// tens of microseconds (more on virtual machines); one that polls sees the data at once.
pub(crate) fn poll_readable(socket: BorrowedFd<'_>, budget: std::time::Duration) {
    let start = std::time::Instant::now();
    let mut byte = 0u8;
    loop {
        // SAFETY: a one-byte peek into `byte`, which outlives the call; nothing is consumed.
        let n = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let would_block = n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock;
        if !would_block || start.elapsed() >= budget {
            return;
        }
        std::hint::spin_loop();
    }
}

/// Receives one frame of at most `max` payload bytes: `None` at a clean end of stream.
pub(crate) fn recv_frame(socket: BorrowedFd<'_>, max: usize) -> std::result::Result<Option<Frame>, RecvError> {
    let mut fds = Vec::new();
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match recv_some(socket, &mut head[got..], &mut fds) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(RecvError::Broken(Error::InvalidData(
                    "the stream ended inside a frame header".into(),
                )));
            }
            Ok(n) => got += n,
            Err(e) if got == 0 && fds.is_empty() && e.kind() == io::ErrorKind::TimedOut => {
                return Err(RecvError::Idle(e));
            }
            Err(e) => return Err(RecvError::Broken(crate::ipc::io_error("reading a frame", e))),
        }
    }
    let len = u32::from_le_bytes(head) as usize;
    if len == 0 || len > max {
        return Err(RecvError::Broken(Error::InvalidData(format!(
            "a frame of {len} bytes (at most {max} are accepted)"
        ))));
    }
    let mut payload = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match recv_some(socket, &mut payload[got..], &mut fds) {
            Ok(0) => {
                return Err(RecvError::Broken(Error::InvalidData(format!(
                    "the stream ended after {got} of a frame's {len} bytes"
                ))));
            }
            Ok(n) => got += n,
            Err(e) => return Err(RecvError::Broken(crate::ipc::io_error("reading a frame", e))),
        }
    }
    if fds.len() > MAX_FDS {
        return Err(RecvError::Broken(Error::InvalidData(format!(
            "a frame with {} descriptors",
            fds.len()
        ))));
    }
    Ok(Some(Frame { payload, fds }))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (c, _d) = UnixStream::pair().unwrap();
        send_frame(a.as_fd(), b"hello", &[c.as_fd(), c.as_fd()]).unwrap();
        send_frame(a.as_fd(), b"again", &[]).unwrap();
        let f = recv_frame(b.as_fd(), 100).unwrap().unwrap();
        assert_eq!(f.payload, b"hello");
        assert_eq!(f.fds.len(), 2);
        let f = recv_frame(b.as_fd(), 100).unwrap().unwrap();
        assert_eq!(f.payload, b"again");
        assert!(f.fds.is_empty());
        drop(a);
        assert!(recv_frame(b.as_fd(), 100).unwrap().is_none());
    }

    #[test]
    fn bad_frames_are_errors() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&1000u32.to_le_bytes()).unwrap();
        assert!(matches!(
            recv_frame(b.as_fd(), 100),
            Err(RecvError::Broken(Error::InvalidData(_)))
        ));
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&10u32.to_le_bytes()).unwrap();
        a.write_all(b"abc").unwrap();
        drop(a);
        assert!(matches!(
            recv_frame(b.as_fd(), 100),
            Err(RecvError::Broken(Error::InvalidData(_)))
        ));
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[1, 0]).unwrap();
        drop(a);
        assert!(matches!(
            recv_frame(b.as_fd(), 100),
            Err(RecvError::Broken(Error::InvalidData(_)))
        ));
        let (a, b) = UnixStream::pair().unwrap();
        b.set_read_timeout(Some(std::time::Duration::from_millis(10))).unwrap();
        assert!(matches!(recv_frame(b.as_fd(), 100), Err(RecvError::Idle(_))));
        drop(a);
    }

    #[test]
    fn frames_larger_than_the_socket_buffer_arrive_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let payload: Vec<u8> = (0..4_000_037u32).map(|i| (i % 251) as u8).collect();
        let sent = payload.clone();
        let writer = std::thread::spawn(move || send_frame(a.as_fd(), &sent, &[]).unwrap());
        let f = recv_frame(b.as_fd(), 8 << 20).unwrap().unwrap();
        writer.join().unwrap();
        assert!(f.payload == payload);
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
