//! The frames a sender and its receivers exchange.
//!
//! Sender to receiver: `Hello` (magic, protocol version, the schema as an IPC schema message) and
//! `Ring` (the ring's size, with its memfd and doorbell attached) on the socket; then, through the
//! ring (`ring.rs`), any number of `Batch` frames (an id, the ids of the regions the receiver may
//! let go of, the IPC event to wait on for CUDA batches, and the batch's descriptor, with the
//! regions' file descriptors attached), then `End`, or `Abort` with a reason. Receiver to sender,
//! on the socket: `Ack` with a batch id when the last view of that batch has dropped, and `Detach`
//! when the receiver stops receiving (it may still hold batches).
//!
//! A receiver keeps every region of shared device memory it is sent mapped, under the sender's id
//! for it, until a later batch frame lets it go; the sender keeps count ([`KeptRegions`]: the most
//! recently sent, up to [`KEPT_BYTES`] and [`KEPT_REGIONS`], bounds the receiver checks, and none
//! the sender has freed) and names a kept region by its id alone. Its batches then carry no file
//! descriptor and travel through the ring, with no system call when the receiver polls. Frames
//! reach a receiver in the order they were encoded for it, so a region is never named after the
//! frame that lets it go.

use std::collections::VecDeque;
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
use crate::memory::shared_device::{OpenedRegions, SharedDeviceRegion};

const MAGIC: &[u8; 8] = b"ACUDAIPC";
/// 4: devices by UUID in batch descriptors (issue #23, finding 8). 5: regions of shared device
/// memory, by file descriptor (the default for messages on a GPU). 6: regions a receiver keeps,
/// by id.
const VERSION: u32 = 6;

/// The most bytes of a sender's regions of shared device memory a receiver keeps mapped between
/// batches, besides the regions of the batch at hand.
pub(crate) const KEPT_BYTES: usize = 256 << 20;

/// The most regions a receiver keeps besides those of the batch at hand (regions are 2 MiB or
/// more, so the bytes bound first; this bounds the descriptors a sender can make it hold).
pub(crate) const KEPT_REGIONS: usize = 256;

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

    /// The payload, and the descriptors to attach. With `kept` (what the receiver keeps, updated
    /// for this frame), a batch's regions that the receiver keeps are named by id, and the frame
    /// lets go of those it need not keep any more.
    pub fn encode(&self, kept: Option<&mut KeptRegions>) -> (Vec<u8>, Vec<BorrowedFd<'_>>) {
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
                let regions = descriptor.shared_regions();
                let (known, forget) = match kept {
                    Some(kept) => {
                        let mut forget = kept.retire();
                        let (known, evicted) = kept.send(&regions);
                        forget.extend(evicted);
                        (known, forget)
                    }
                    None => (Vec::new(), Vec::new()),
                };
                w.u32(forget.len() as u32);
                forget.iter().for_each(|id| w.u64(*id));
                match event {
                    Some(h) => {
                        w.u8(1);
                        w.raw(&h.0);
                    }
                    None => w.u8(0),
                }
                descriptor.encode(&mut w, &mut fds, |id| known.contains(&id));
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

    /// Reads a frame; every byte must be used and every descriptor claimed. A receiver passes the
    /// regions it keeps (`opened`): a batch frame names kept ones by id, and lets some go.
    pub fn decode(frame: wire::Frame, mut opened: Option<&mut OpenedRegions>) -> Result<Frame> {
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
                    let n = r.u32()? as usize;
                    if n > r.remaining() / 8 {
                        return Err(Error::InvalidData(format!(
                            "{n} regions to let go of in a frame of {} bytes",
                            r.remaining()
                        )));
                    }
                    for _ in 0..n {
                        let region = r.u64()?;
                        if let Some(opened) = opened.as_deref_mut() {
                            opened.forget(region);
                        }
                    }
                    let event = match r.u8()? {
                        0 => None,
                        1 => Some(IpcEventHandle(r.array::<HANDLE_BYTES>()?)),
                        k => return Err(Error::InvalidData(format!("event flag {k}"))),
                    };
                    let descriptor = BatchDescriptor::decode(&mut r, &mut fds, opened.as_deref_mut())?;
                    if let Some(opened) = opened.as_deref_mut()
                        && opened.bound(KEPT_REGIONS, KEPT_BYTES, &descriptor.shared_regions())
                    {
                        return Err(Error::InvalidData(format!(
                            "the sender had this receiver keep more than {KEPT_REGIONS} of its \
                             regions or {KEPT_BYTES} bytes of them besides a batch's; the \
                             receiver let go of them"
                        )));
                    }
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

/// The regions of shared device memory a receiver keeps mapped, as its sender counts them: by id
/// and size, the most recently sent first; with the regions of the batch being sent, at most
/// [`KEPT_BYTES`] and [`KEPT_REGIONS`], or those regions alone where they take more.
#[derive(Debug, Default)]
pub(crate) struct KeptRegions {
    regions: VecDeque<(u64, usize)>,
    /// [`SharedDeviceRegion::retired`] when the regions were last checked for retired ones.
    retired: u64,
}

impl KeptRegions {
    /// The ids of kept regions that this process has let go of for good, which the receiver is to
    /// let go of too (it would keep their memory otherwise): looked for only when some region was
    /// let go of since the last look.
    pub(crate) fn retire(&mut self) -> Vec<u64> {
        let now = SharedDeviceRegion::retired();
        if now == self.retired {
            return Vec::new();
        }
        self.retired = now;
        let gone = SharedDeviceRegion::retired_among(self.regions.iter().map(|(id, _)| *id));
        self.regions.retain(|(id, _)| !gone.contains(id));
        gone
    }

    /// A batch frame with `regions` (id and size) goes to the receiver, which keeps them from then
    /// on: the ids of those it keeps already, and of those it is to let go of (the least recently
    /// sent, past [`KEPT_BYTES`] or [`KEPT_REGIONS`]; never one of `regions`).
    pub(crate) fn send(&mut self, regions: &[(u64, usize)]) -> (Vec<u64>, Vec<u64>) {
        let sent = |id: &u64| regions.iter().any(|(r, _)| r == id);
        let mut known = Vec::new();
        self.regions.retain(|(id, _)| {
            let again = sent(id);
            if again {
                known.push(*id);
            }
            !again
        });
        for r in regions.iter().rev() {
            self.regions.push_front(*r);
        }
        let (mut held, mut count, mut forget) = (0, 0, Vec::new());
        self.regions.retain(|(id, size)| {
            held += size;
            count += 1;
            let keep = (held <= KEPT_BYTES && count <= KEPT_REGIONS) || sent(id);
            if !keep {
                forget.push(*id);
            }
            keep
        });
        (known, forget)
    }
}

/// One end of a connection: the socket, and on a sender's side the ring its frames go through,
/// with writes of whole frames serialised.
pub(crate) struct Link {
    pub socket: UnixStream,
    out: Mutex<Out>,
}

/// How frames leave a link.
#[derive(Default)]
struct Out {
    /// The socket alone until a sender attaches its receiver's ring.
    ring: Option<RingWriter>,
    /// The regions the receiver at the other end keeps (on a sender's side).
    kept: KeptRegions,
}

impl Link {
    pub fn new(socket: UnixStream) -> Link {
        Link {
            socket,
            out: Mutex::new(Out::default()),
        }
    }

    /// Sends every later frame through `ring` (announced to the receiver already).
    pub fn attach(&self, ring: RingWriter) {
        self.out.lock().unwrap_or_else(|p| p.into_inner()).ring = Some(ring);
    }

    /// Sends one frame; concurrent senders never interleave. Through a ring, a frame with
    /// descriptors or too large for it goes on the socket, announced in the ring first.
    pub fn send(&self, frame: &Frame) -> io::Result<()> {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let Out { ring, kept } = &mut *out;
        let (payload, fds) = frame.encode(Some(kept));
        match ring {
            Some(ring) if fds.is_empty() && ring.fits(payload.len()) => ring.push(Some(&payload), &self.socket),
            Some(ring) => {
                ring.push(None, &self.socket)?;
                wire::send_frame(self.socket.as_fd(), &payload, &fds)
            }
            None => wire::send_frame(self.socket.as_fd(), &payload, &fds),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// A receiver is told which regions it keeps: named by id once sent, the least recently sent
    /// let go past the limit, never those of the batch at hand.
    #[test]
    fn kept_regions_are_the_most_recently_sent() {
        let mut kept = KeptRegions::default();
        assert_eq!(kept.send(&[(1, 2 * MIB), (2, 2 * MIB)]), (vec![], vec![]));
        assert_eq!(kept.send(&[(2, 2 * MIB), (3, 2 * MIB)]), (vec![2], vec![]));
        // 1 is now the least recently sent: a region that fills the rest of the budget lets it go.
        let big = KEPT_BYTES - 4 * MIB;
        assert_eq!(kept.send(&[(4, big)]), (vec![], vec![1]));
        assert_eq!(kept.send(&[(3, 2 * MIB)]), (vec![3], vec![]));
        // One batch's regions alone may take more than the budget: all are kept, the others go.
        assert_eq!(kept.send(&[(5, KEPT_BYTES), (6, 2 * MIB)]), (vec![], vec![3, 4, 2]));
        assert_eq!(kept.send(&[(6, 2 * MIB)]), (vec![6], vec![5]));
        assert_eq!(kept.send(&[(7, 2 * MIB)]), (vec![], vec![]));
        assert_eq!(kept.send(&[(6, 2 * MIB), (7, 2 * MIB)]), (vec![7, 6], vec![]));
        // Small regions: the count bounds them.
        let mut kept = KeptRegions::default();
        for id in 0..KEPT_REGIONS as u64 {
            assert_eq!(kept.send(&[(id, 4096)]), (vec![], vec![]));
        }
        assert_eq!(kept.send(&[(1000, 4096)]), (vec![], vec![0]));
    }

    /// A sender that has its receiver keep more than the bounds besides a batch's regions gets
    /// that batch refused, and the receiver lets go of all but the batch's regions. (Regions of
    /// descriptors that are not device memory: decoding keeps them and maps nothing.) Without a
    /// GPU, the device the regions name is what is refused.
    #[test]
    fn a_receiver_keeps_no_more_than_the_bounds() {
        use crate::device::{Device, DeviceUuid};
        use crate::ipc::descriptor::RegionHandle;
        use crate::memory::SharedDeviceHandle;

        let gpu = DeviceUuid::of(0).ok();
        let uuid = gpu.unwrap_or_default();
        let mut kept = OpenedRegions::default();
        let mut receive = |id: u64| {
            let null = std::fs::File::open("/dev/null").unwrap();
            let descriptor = BatchDescriptor {
                device: Device::Cuda(0),
                device_uuid: Some(uuid),
                dictionaries: Vec::new(),
                metadata: Vec::new(),
                regions: vec![RegionHandle::SharedCuda {
                    ordinal: 0,
                    uuid,
                    handle: SharedDeviceHandle::from_fd(null.into(), id, 200 * MIB),
                }],
                locations: Vec::new(),
            };
            let batch = Frame::Batch {
                id,
                event: None,
                descriptor,
            };
            let (payload, fds) = batch.encode(None);
            let fds = fds.iter().map(|fd| fd.try_clone_to_owned().unwrap()).collect();
            let frame = wire::Frame { payload: &payload, fds };
            match Frame::decode(frame, Some(&mut kept)).unwrap() {
                Frame::Batch { .. } => Ok(()),
                Frame::BadBatch { error, .. } => Err(error),
                other => panic!("{other:?}"),
            }
        };
        match gpu {
            Some(_) => {
                receive(1).unwrap();
                receive(2).unwrap();
                let e = receive(3).unwrap_err();
                assert!(e.to_string().contains("let go of them"), "{e}");
                assert_eq!((kept.len(), kept.bytes()), (1, 200 * MIB), "the batch's region alone");
                assert!(kept.handle(3).is_some());
            }
            None => {
                let e = receive(1).unwrap_err();
                assert!(matches!(e, Error::UnknownDevice { .. }), "{e}");
                assert_eq!(kept.len(), 0);
            }
        }
    }

    /// A batch frame's list of regions to let go of comes before its descriptor: it is read when
    /// the descriptor is malformed, and a count larger than the frame is refused.
    #[test]
    fn batch_frames_list_the_regions_to_let_go_of_first() {
        let mut payload = vec![BATCH];
        payload.extend_from_slice(&9u64.to_le_bytes());
        payload.extend_from_slice(&2u32.to_le_bytes());
        payload.extend_from_slice(&1u64.to_le_bytes());
        payload.extend_from_slice(&2u64.to_le_bytes());
        payload.push(0);
        payload.extend_from_slice(b"not a descriptor");
        let mut kept = OpenedRegions::default();
        // The error of batch 9 the payload decodes to.
        let mut refused = |payload: &[u8]| {
            let frame = wire::Frame {
                payload,
                fds: Vec::new(),
            };
            match Frame::decode(frame, Some(&mut kept)).unwrap() {
                Frame::BadBatch { id: 9, error } => error.to_string(),
                other => panic!("{other:?}"),
            }
        };
        let error = refused(&payload);
        assert!(error.contains("descriptor"), "{error}");
        // More ids than bytes left.
        payload.truncate(9);
        payload.extend_from_slice(&u32::MAX.to_le_bytes());
        let error = refused(&payload);
        assert!(error.contains("let go of"), "{error}");
    }
}
