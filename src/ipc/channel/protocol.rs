//! The frames a sender and its receivers exchange.
//!
//! Sender to receiver: `Hello` (magic, protocol version, the schema as an IPC schema message) and
//! `Ring` (the ring's size, with its memfd and doorbell attached) on the socket; then, through the
//! ring (`ring.rs`), any number of `Batch` frames (an id, the ids of the regions the receiver may
//! let go of, the IPC event to wait on for CUDA batches, and the batch's descriptor, with the
//! regions' file descriptors attached), then `End`, or `Abort` with a reason; between them, from a
//! sender that announces regions (`SenderOptions::announce_regions`), `Regions` frames (the ids of
//! regions the receiver may let go of, then regions of shared device memory just made, each with
//! its device's UUID, id, size and file descriptor), which the receiver keeps and maps while it
//! waits for batches. Receiver to sender,
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

use crate::device::DeviceUuid;
use crate::error::{Error, Result};
use crate::ipc::channel::ring::{CAPACITY, RingWriter};
use crate::ipc::descriptor::BatchDescriptor;
use crate::ipc::event::IpcEventHandle;
use crate::ipc::handle::HANDLE_BYTES;
use crate::ipc::wire::{self, Reader, Writer};
use crate::memory::SharedDeviceHandle;
use crate::memory::shared_device::{OpenedRegions, SharedDeviceRegion};

const MAGIC: &[u8; 8] = b"ACUDAIPC";
/// 4: devices by UUID in batch descriptors (issue #23, finding 8). 5: regions of shared device
/// memory, by file descriptor (the default for messages on a GPU). 6: regions a receiver keeps,
/// by id. 7: regions announced as they are made.
const VERSION: u32 = 7;

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
const REGIONS: u8 = 6;
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
    /// Regions of shared device memory the sender's process just made, for the receiver to keep
    /// and map before a batch names them (those it keeps already are not sent again).
    Regions(Vec<(DeviceUuid, SharedDeviceHandle)>),
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
                let known = kept_after(kept, &descriptor.shared_regions(), &mut w);
                match event {
                    Some(h) => {
                        w.u8(1);
                        w.raw(&h.0);
                    }
                    None => w.u8(0),
                }
                descriptor.encode(&mut w, &mut fds, |id| known.contains(&id));
            }
            Frame::Regions(regions) => {
                w.u8(REGIONS);
                let ids: Vec<_> = regions.iter().map(|(_, h)| (h.id(), h.size())).collect();
                let known = kept_after(kept, &ids, &mut w);
                let new: Vec<_> = regions.iter().filter(|(_, h)| !known.contains(&h.id())).collect();
                w.u32(new.len() as u32);
                for (uuid, handle) in new {
                    w.raw(&uuid.0);
                    w.u64(handle.id());
                    w.u64(handle.size() as u64);
                    fds.push(handle.fd());
                }
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
                    let_go(&mut r, opened.as_deref_mut())?;
                    let event = match r.u8()? {
                        0 => None,
                        1 => Some(IpcEventHandle(r.array::<HANDLE_BYTES>()?)),
                        k => return Err(Error::InvalidData(format!("event flag {k}"))),
                    };
                    let descriptor = BatchDescriptor::decode(&mut r, &mut fds, opened.as_deref_mut())?;
                    check_bound(opened.as_deref_mut(), &descriptor.shared_regions())?;
                    finish(&r, &mut fds)?;
                    Ok((event, descriptor))
                })();
                return Ok(match rest {
                    Ok((event, descriptor)) => Frame::Batch { id, event, descriptor },
                    Err(error) => Frame::BadBatch { id, error },
                });
            }
            REGIONS => {
                let_go(&mut r, opened.as_deref_mut())?;
                let n = r.u32()? as usize;
                if n > r.remaining() / 32 {
                    return Err(Error::InvalidData(format!(
                        "{n} regions announced in a frame of {} bytes",
                        r.remaining()
                    )));
                }
                let mut regions = Vec::with_capacity(n);
                for _ in 0..n {
                    let uuid = DeviceUuid(r.array::<16>()?);
                    let id = r.u64()?;
                    let size = usize::try_from(r.u64()?)
                        .map_err(|_| Error::InvalidData("a region size out of range".into()))?;
                    let fd = fds
                        .next()
                        .ok_or_else(|| Error::InvalidData("an announced region without its descriptor".into()))?;
                    regions.push((uuid, SharedDeviceHandle::from_fd(fd, id, size)));
                }
                finish(&r, &mut fds)?;
                if let Some(opened) = opened.as_deref_mut() {
                    regions.iter().for_each(|(_, handle)| opened.keep(handle));
                }
                let ids: Vec<_> = regions.iter().map(|(_, h)| (h.id(), h.size())).collect();
                check_bound(opened, &ids)?;
                return Ok(Frame::Regions(regions));
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

/// Writes the ids of the regions the receiver is to let go of, before a frame with `regions` (id
/// and size) goes to it, and returns the ids of those of `regions` it keeps already; with no
/// count of what it keeps (`kept`), none.
fn kept_after(kept: Option<&mut KeptRegions>, regions: &[(u64, usize)], w: &mut Writer) -> Vec<u64> {
    let (known, forget) = match kept {
        Some(kept) => {
            let mut forget = kept.retire();
            let (known, evicted) = kept.send(regions);
            forget.extend(evicted);
            (known, forget)
        }
        None => (Vec::new(), Vec::new()),
    };
    w.u32(forget.len() as u32);
    forget.iter().for_each(|id| w.u64(*id));
    known
}

/// Reads the ids of the regions to let go of that start batch and region frames, and lets them go.
fn let_go(r: &mut Reader<'_>, mut opened: Option<&mut OpenedRegions>) -> Result<()> {
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
    Ok(())
}

/// Checks that the sender had the receiver keep no more than the bounds besides `current` (the
/// regions of the frame at hand); past them the receiver lets go of all others.
fn check_bound(opened: Option<&mut OpenedRegions>, current: &[(u64, usize)]) -> Result<()> {
    if opened.is_some_and(|opened| opened.bound(KEPT_REGIONS, KEPT_BYTES, current)) {
        return Err(Error::InvalidData(format!(
            "the sender had this receiver keep more than {KEPT_REGIONS} of its regions or \
             {KEPT_BYTES} bytes of them besides a frame's; the receiver let go of them"
        )));
    }
    Ok(())
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

    /// Wakes the receiver if it sleeps on its ring, ahead of a frame being made
    /// ([`RingWriter::wake`]).
    pub fn wake(&self) {
        if let Some(ring) = &self.out.lock().unwrap_or_else(|p| p.into_inner()).ring {
            ring.wake();
        }
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

    /// Regions announced as they are made are kept by the receiver, each sent once: a region the
    /// receiver keeps already is not sent again, the announcement lets go of the least recently
    /// sent past the bounds, and a batch frame names an announced region by id alone.
    #[test]
    fn announced_regions_are_kept_and_named_by_id() {
        use crate::device::{Device, DeviceUuid};
        use crate::ipc::descriptor::RegionHandle;

        let uuid = DeviceUuid([7; 16]);
        let handle = |id: u64, size: usize| {
            let null = std::fs::File::open("/dev/null").unwrap();
            SharedDeviceHandle::from_fd(null.into(), id, size)
        };
        let (mut kept, mut opened) = (KeptRegions::default(), OpenedRegions::default());
        // Encodes `frame` for the receiver and decodes it there: the frame read, and the number of
        // descriptors it carried.
        let deliver = |frame: Frame, kept: &mut KeptRegions, opened: &mut OpenedRegions| {
            let (payload, fds) = frame.encode(Some(kept));
            let carried = fds.len();
            let fds = fds.iter().map(|fd| fd.try_clone_to_owned().unwrap()).collect();
            let frame = wire::Frame { payload: &payload, fds };
            (Frame::decode(frame, Some(opened)).unwrap(), carried)
        };
        let announce = |regions: &[(u64, usize)]| {
            Frame::Regions(regions.iter().map(|&(id, size)| (uuid, handle(id, size))).collect())
        };
        match deliver(announce(&[(1, 2 * MIB), (2, 2 * MIB)]), &mut kept, &mut opened) {
            (Frame::Regions(got), 2) => {
                let got: Vec<_> = got.iter().map(|(u, h)| (*u, h.id(), h.size())).collect();
                assert_eq!(got, [(uuid, 1, 2 * MIB), (uuid, 2, 2 * MIB)]);
            }
            other => panic!("{other:?}"),
        }
        // Region 2 is kept: announced again, it is not sent again.
        match deliver(announce(&[(2, 2 * MIB), (3, 2 * MIB)]), &mut kept, &mut opened) {
            (Frame::Regions(got), 1) => assert_eq!(got.iter().map(|(_, h)| h.id()).collect::<Vec<_>>(), [3]),
            other => panic!("{other:?}"),
        }
        // A batch in region 1 names it by id alone (no descriptor), and the receiver finds it.
        let batch = Frame::Batch {
            id: 9,
            event: None,
            descriptor: BatchDescriptor {
                device: Device::Cpu,
                device_uuid: None,
                dictionaries: Vec::new(),
                metadata: Vec::new(),
                regions: vec![RegionHandle::SharedCuda {
                    ordinal: 0,
                    uuid,
                    handle: handle(1, 2 * MIB),
                }],
                locations: Vec::new(),
            },
        };
        assert!(
            batch.encode(Some(&mut kept)).1.is_empty(),
            "a kept region travels by id"
        );
        // A region that fills the budget lets the least recently sent go: region 3 (1 went in the
        // batch since, and 2 went before 3 in their announcement).
        let big = KEPT_BYTES - 4 * MIB;
        let (frame, carried) = deliver(announce(&[(4, big)]), &mut kept, &mut opened);
        assert!(matches!(frame, Frame::Regions(_)) && carried == 1);
        assert!(opened.handle(3).is_none(), "let go of");
        assert!(opened.handle(1).is_some() && opened.handle(2).is_some() && opened.handle(4).is_some());
        assert_eq!(opened.bytes(), KEPT_BYTES);
    }

    /// A region frame that claims more regions than its bytes, or a region without its descriptor,
    /// is refused.
    #[test]
    fn malformed_region_frames_are_refused() {
        let decode = |payload: &[u8]| {
            let frame = wire::Frame {
                payload,
                fds: Vec::new(),
            };
            Frame::decode(frame, Some(&mut OpenedRegions::default()))
                .unwrap_err()
                .to_string()
        };
        let mut payload = vec![REGIONS];
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&1000u32.to_le_bytes());
        assert!(
            decode(&payload).contains("1000 regions announced"),
            "{}",
            decode(&payload)
        );
        payload.truncate(5);
        payload.extend_from_slice(&1u32.to_le_bytes());
        payload.extend_from_slice(&[0; 32]);
        assert!(
            decode(&payload).contains("without its descriptor"),
            "{}",
            decode(&payload)
        );
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
