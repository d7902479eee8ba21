//! Zero-copy batch descriptors, after Arrow's "Dissociated IPC" protocol
//! (apache/arrow `docs/source/format/DissociatedIPC.rst`): the metadata travels on its own and every
//! body buffer is addressed as `(region, offset, length)`, where a region is an exported base
//! allocation: on a GPU a CUDA IPC handle or a file descriptor of shared device memory, on the CPU
//! a memfd.
//!
//! [`BatchDescriptor::describe`] describes a batch whose memory is already exportable without
//! copying a byte; [`BatchDescriptor::of_message`] describes a message written into one allocation
//! ([`crate::ipc::write_message`]). The receiver opens the regions (cached per process, see
//! [`crate::ipc::handle`] and [`crate::ipc::shm`]) and builds the arrays as views of them,
//! checking every location against its region.
//!
//! Devices travel by UUID ([`DeviceUuid`]), never by ordinal: two processes with different
//! `CUDA_VISIBLE_DEVICES` number the same GPU differently. A received descriptor names its devices
//! by the ordinals of the receiving process, found by UUID when it is decoded; a UUID this process
//! does not see is [`Error::UnknownDevice`].
//!
//! The metadata is the `RecordBatch` message the batch would have as an ordinary IPC message (its
//! buffer offsets are those of a contiguous body), after a `DictionaryBatch` message for each of its
//! dictionaries; the locations say where each buffer really is, the dictionaries' first.

use std::any::Any;
use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

use arrow_schema::SchemaRef;

use crate::array::DeviceRecordBatch;
use crate::device::{Device, DeviceUuid, Event};
use crate::error::{Error, Result};
use crate::ipc::handle::{IpcMemHandle, OpenedHandle};
use crate::ipc::layout::{BodyLayout, needs_normalising};
use crate::ipc::message::DeviceMessage;
use crate::ipc::wire::{Reader, Writer};
use crate::ipc::{decode, handle};
use crate::memory::cache::Region as _;
use crate::memory::fence::Fence;
use crate::memory::shared_device::{OpenedRegions, SharedDeviceRegion};
use crate::memory::shm::{SharedMapping, SharedMemHandle, SharedRegion};
use crate::memory::{DeviceBuffer, MemoryResource, SharedDeviceHandle};
use crate::trace::Laps;

/// An exported base allocation.
#[derive(Debug)]
pub enum RegionHandle {
    /// Device memory of a GPU, by CUDA IPC handle.
    Cuda {
        /// The device's ordinal in this process: the exporter's own ordinal where the region was
        /// exported, the ordinal of the device with [`uuid`](RegionHandle::Cuda::uuid) where it was
        /// received. Only the UUID travels.
        ordinal: usize,
        /// The device's UUID, the same in every process.
        uuid: DeviceUuid,
        /// The handle (with the allocation's size).
        handle: IpcMemHandle,
    },
    /// Shared device memory of a GPU, by file descriptor: a receiver that maps it keeps it.
    SharedCuda {
        /// The device's ordinal in this process, as for [`RegionHandle::Cuda`].
        ordinal: usize,
        /// The device's UUID, the same in every process.
        uuid: DeviceUuid,
        /// The descriptor (with the region's size).
        handle: SharedDeviceHandle,
    },
    /// Shared host memory, by file descriptor.
    Host(SharedMemHandle),
}

impl RegionHandle {
    /// The region's size in bytes.
    pub fn size(&self) -> usize {
        match self {
            RegionHandle::Cuda { handle, .. } => handle.size(),
            RegionHandle::SharedCuda { handle, .. } => handle.size(),
            RegionHandle::Host(h) => h.size(),
        }
    }
}

/// Where one IPC buffer's bytes are: `len` bytes at `offset` of region `region`. Empty buffers
/// name no region ([`BufferLocation::EMPTY`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferLocation {
    /// The index of the region in [`BatchDescriptor::regions`].
    pub region: u32,
    /// The offset in the region.
    pub offset: u64,
    /// The length in bytes.
    pub len: u64,
}

impl BufferLocation {
    /// The location of an empty buffer.
    pub const EMPTY: BufferLocation = BufferLocation {
        region: u32::MAX,
        offset: 0,
        len: 0,
    };
}

/// A batch described for another process: metadata, exported regions and buffer locations.
#[derive(Debug)]
pub struct BatchDescriptor {
    /// The device the batch lives on, by its ordinal in this process (see
    /// [`device_uuid`](BatchDescriptor::device_uuid)).
    pub device: Device,
    /// The UUID of [`device`](BatchDescriptor::device)'s GPU (`None` for the CPU): what travels in
    /// place of its ordinal, and what the receiving process finds its own ordinal of the device by.
    pub device_uuid: Option<DeviceUuid>,
    /// The flatbuffer `Message`s with the `DictionaryBatch` headers of the batch's dictionaries,
    /// in id order.
    pub dictionaries: Vec<Vec<u8>>,
    /// The flatbuffer `Message` with the batch's `RecordBatch` header.
    pub metadata: Vec<u8>,
    /// The exported allocations.
    pub regions: Vec<RegionHandle>,
    /// One location per buffer of the metadata, in order.
    pub locations: Vec<BufferLocation>,
}

impl BatchDescriptor {
    /// Describes `batch` without copying it: every buffer must lie in memory another process can
    /// open ([`MemoryResource::SharedDevice`] or [`MemoryResource::Device`] on a GPU,
    /// [`MemoryResource::SharedHost`] on the CPU, or a region received in either), and no array
    /// may have an offset or an unknown null count ([`Error::Unsupported`] otherwise; write a
    /// message instead). The caller must keep the batch alive and unchanged until the receivers
    /// are done with it.
    ///
    /// Whoever opens the regions can write them on a GPU (CUDA IPC maps memory read-write; shared
    /// host memory is sealed against a receiver's writes), so from this call on the batch's memory
    /// is untrusted in this process too: its downloads ([`crate::transfer::dtoh`]) validate every
    /// array, as they do for received batches.
    pub fn describe(batch: &DeviceRecordBatch) -> Result<BatchDescriptor> {
        match Route::of(batch)? {
            Route::Lend(located) => located.export(),
            Route::Copy(why) => Err(Error::Unsupported(why)),
        }
    }

    /// Describes a message written into one exportable allocation: a single region.
    pub fn of_message(message: &DeviceMessage) -> Result<BatchDescriptor> {
        let buffer = message.buffer();
        let device = buffer.device();
        let (region, base) = match (device, buffer.resource()) {
            (Device::Cuda(o), MemoryResource::SharedDevice(_)) => {
                let (handle, offset) = SharedDeviceHandle::export(buffer)?;
                let uuid = DeviceUuid::of(o)?;
                (
                    RegionHandle::SharedCuda {
                        ordinal: o,
                        uuid,
                        handle,
                    },
                    offset,
                )
            }
            (Device::Cuda(o), _) => (
                RegionHandle::Cuda {
                    ordinal: o,
                    uuid: DeviceUuid::of(o)?,
                    handle: IpcMemHandle::export(buffer)?,
                },
                buffer.offset(),
            ),
            (Device::Cpu, _) => {
                let (handle, offset) = SharedMemHandle::export(buffer)?;
                (RegionHandle::Host(handle), offset)
            }
            (other, _) => return Err(Error::Unsupported(format!("IPC of {other} memory"))),
        };
        let mut locations = Vec::new();
        for part in message.parts() {
            let parsed = decode::parse(part.metadata())?;
            let header = decode::header(&parsed)?;
            let body = (base + part.body_offset()) as u64;
            let buffers = header.batch.buffers().into_iter().flatten();
            locations.extend(buffers.map(|b| match b.length() {
                0 => BufferLocation::EMPTY,
                len => BufferLocation {
                    region: 0,
                    offset: body + b.offset() as u64,
                    len: len as u64,
                },
            }));
        }
        let (batch, dictionaries) = message.parts().split_last().expect("a message holds a batch");
        Ok(BatchDescriptor {
            device,
            device_uuid: device_uuid(device)?,
            dictionaries: dictionaries.iter().map(|p| p.metadata().to_vec()).collect(),
            metadata: batch.metadata().to_vec(),
            regions: vec![region],
            locations,
        })
    }

    /// The number of bytes the batch's buffers take.
    pub fn body_bytes(&self) -> u64 {
        self.locations.iter().map(|l| l.len).sum()
    }

    /// Opens the regions and builds the batch of `schema` as views of them. `owner` is dropped when
    /// the last view drops (after the mappings are released), which is how a receiver learns that a
    /// batch is done with. The batch's ready event is `ready`: the caller orders it after the
    /// producer's writes. Malformed descriptors are [`Error::InvalidData`].
    pub fn import(self, schema: &SchemaRef, ready: Event, owner: impl Any + Send + Sync) -> Result<DeviceRecordBatch> {
        self.import_retaining(schema, ready, owner, None, None)
            .map(|(batch, _)| batch)
    }

    /// [`BatchDescriptor::import`], with the reads of every region that its sender must keep
    /// (CUDA IPC and shared host memory) checking `fence` first when given (the channel's: that the
    /// sender still keeps the memory), also returning the mappings it opened. Shared device memory
    /// is kept by its mapping here and needs no fence; with `opened` (the regions mapped from the
    /// same sender before), a region mapped before is not mapped again.
    pub(crate) fn import_retaining(
        self,
        schema: &SchemaRef,
        ready: Event,
        owner: impl Any + Send + Sync,
        fence: Option<Arc<dyn Fence>>,
        mut opened: Option<&mut OpenedRegions>,
    ) -> Result<(DeviceRecordBatch, Vec<Mapping>)> {
        let device = self.device;
        let mut laps = Laps::start();
        let mappings = self
            .regions
            .into_iter()
            .map(|r| match (r, device) {
                (RegionHandle::Cuda { ordinal, handle, .. }, Device::Cuda(o)) if ordinal == o => {
                    Ok(Mapping::Cuda(handle::open(&handle, ordinal)?))
                }
                (RegionHandle::SharedCuda { ordinal, handle, .. }, Device::Cuda(o)) if ordinal == o => {
                    Ok(Mapping::SharedCuda(match opened.as_deref_mut() {
                        Some(opened) => opened.open(handle, ordinal)?,
                        None => handle.open(ordinal)?,
                    }))
                }
                (RegionHandle::Host(h), Device::Cpu) => Ok(Mapping::Host(h.open()?)),
                (r, d) => Err(Error::InvalidData(format!("a region {r:?} for a batch on {d}"))),
            })
            .collect::<Result<Vec<_>>>()?;
        // Declared in this order so the mappings are released before the owner is dropped.
        struct Lease<O> {
            _mappings: Vec<Mapping>,
            _owner: O,
        }
        let lease = Arc::new(Lease {
            _mappings: mappings.clone(),
            _owner: owner,
        });
        let regions: Vec<DeviceBuffer> = mappings
            .iter()
            .map(|m| m.buffer(lease.clone(), fence.clone()))
            .collect();
        drop(lease);
        laps.lap("recv.open");
        let dictionaries = self
            .dictionaries
            .iter()
            .map(|d| decode::parse(d))
            .collect::<Result<Vec<_>>>()?;
        let message = decode::parse(&self.metadata)?;
        let headers = dictionaries
            .iter()
            .chain([&message])
            .map(decode::header)
            .collect::<Result<Vec<_>>>()?;
        let locations = self.locations;
        let resolve = Placed {
            locations: &locations,
            regions: &regions,
        };
        let n_buffers: usize = headers.iter().map(|h| h.batch.buffers().map_or(0, |b| b.len())).sum();
        if n_buffers != locations.len() {
            return Err(Error::InvalidData(format!(
                "{} locations for {n_buffers} IPC buffers",
                locations.len()
            )));
        }
        laps.lap("recv.parse");
        let (header, dictionary_headers) = headers.split_last().expect("a batch's header");
        let mut values = decode::Dictionaries::new();
        let mut first = 0;
        for h in dictionary_headers {
            decode::dictionary(schema, h, device, &resolve, first, &mut values)?;
            first += h.batch.buffers().map_or(0, |b| b.len());
        }
        let batch = decode::batch(schema, header, device, &resolve, first, &values, ready)?;
        laps.lap("recv.build");
        Ok((batch, mappings))
    }

    /// The bytes [`BatchDescriptor::encode`] appends (at most: regions by descriptor take fewer).
    pub(crate) fn encoded_len(&self) -> usize {
        let region = 1 + UUID_LEN + IpcMemHandle::SERIALIZED_LEN;
        let metadata: usize = self
            .dictionaries
            .iter()
            .chain([&self.metadata])
            .map(|m| 4 + m.len())
            .sum();
        FORMAT.len() + 4 + 8 + UUID_LEN + 4 + region * self.regions.len() + 4 + metadata + 4 + 20 * self.locations.len()
    }

    /// The id and size of each region of shared device memory.
    pub(crate) fn shared_regions(&self) -> Vec<(u64, usize)> {
        let shared = self.regions.iter().filter_map(|r| match r {
            RegionHandle::SharedCuda { handle, .. } => Some((handle.id(), handle.size())),
            _ => None,
        });
        shared.collect()
    }

    /// Appends the descriptor to a frame payload; the descriptors of regions that travel as file
    /// descriptors go to `fds`, except those of shared device memory whose id `kept` holds (the
    /// receiver keeps them mapped: see the channel's protocol).
    ///
    /// The encoding, little-endian: the format tag `ACD` and version ([`FORMAT`]); the device as
    /// its C Device Data Interface type (`u32`) and the exporter's id (`i64`, for messages only),
    /// then the device's UUID (16 bytes, zero for the CPU); the regions (`u32` count; each a kind
    /// byte, then for CUDA memory (3) the device's UUID and the serialized IPC handle, for shared
    /// host memory (2) its size, for shared device memory (4) the device's UUID, the region's id
    /// (the exporter's) and its size, these two with their descriptor attached, for shared device
    /// memory the receiver keeps (5) the device's UUID and the region's id); the dictionaries' and
    /// the batch's metadata (`u32` length, bytes); the locations (`u32` count, 20 bytes each).
    pub(crate) fn encode<'a>(&'a self, w: &mut Writer, fds: &mut Vec<BorrowedFd<'a>>, kept: impl Fn(u64) -> bool) {
        w.raw(&FORMAT);
        w.u32(self.device.device_type().0 as u32);
        w.i64(self.device.device_id());
        w.raw(&self.device_uuid.unwrap_or_default().0);
        w.u32(self.regions.len() as u32);
        for r in &self.regions {
            match r {
                RegionHandle::Cuda { uuid, handle, .. } => {
                    w.u8(REGION_CUDA);
                    w.raw(&uuid.0);
                    w.raw(&handle.serialize());
                }
                RegionHandle::SharedCuda { uuid, handle, .. } if kept(handle.id()) => {
                    w.u8(REGION_SHARED_CUDA_KEPT);
                    w.raw(&uuid.0);
                    w.u64(handle.id());
                }
                RegionHandle::SharedCuda { uuid, handle, .. } => {
                    w.u8(REGION_SHARED_CUDA);
                    w.raw(&uuid.0);
                    w.u64(handle.id());
                    w.u64(handle.size() as u64);
                    fds.push(handle.fd());
                }
                RegionHandle::Host(h) => {
                    w.u8(REGION_HOST);
                    w.u64(h.size() as u64);
                    fds.push(h.fd());
                }
            }
        }
        w.u32(self.dictionaries.len() as u32);
        for d in &self.dictionaries {
            w.bytes(d);
        }
        w.bytes(&self.metadata);
        w.u32(self.locations.len() as u32);
        // Written in place, 20 bytes each: one length check instead of three per location.
        let start = w.buf.len();
        w.buf.resize(start + 20 * self.locations.len(), 0);
        for (out, l) in w.buf[start..].chunks_exact_mut(20).zip(&self.locations) {
            out[..4].copy_from_slice(&l.region.to_le_bytes());
            out[4..12].copy_from_slice(&l.offset.to_le_bytes());
            out[12..].copy_from_slice(&l.len.to_le_bytes());
        }
    }

    /// Reads a descriptor from a frame payload, taking the descriptors of regions that travel as
    /// file descriptors from `fds` in order, and finds the devices it names among this process's
    /// by UUID. A channel's receiver passes the regions it keeps (`kept`): those named by id are
    /// found there, and those sent with their descriptors are kept once the descriptor is read
    /// whole. Every count is checked against the bytes left; malformed input, and a region named
    /// by an id not kept, is [`Error::InvalidData`], another version of the encoding
    /// [`Error::Unsupported`], and a device this process does not see [`Error::UnknownDevice`].
    pub(crate) fn decode(
        r: &mut Reader<'_>,
        fds: &mut std::vec::IntoIter<OwnedFd>,
        kept: Option<&mut OpenedRegions>,
    ) -> Result<BatchDescriptor> {
        let invalid = |m: String| Error::InvalidData(m);
        let format = r.array::<4>()?;
        if format[..3] != FORMAT[..3] {
            return Err(invalid(format!(
                "not a batch descriptor (it starts with {format:02x?})"
            )));
        }
        if format[3] != FORMAT[3] {
            return Err(Error::Unsupported(format!(
                "batch descriptor version {}; this build reads version {}",
                format[3], FORMAT[3]
            )));
        }
        let device_type = crate::abi::DeviceType(r.u32()? as i32);
        let theirs = Device::from_c(device_type, r.i64()?).map_err(|e| invalid(format!("batch device: {e}")))?;
        let uuid = DeviceUuid(r.array::<UUID_LEN>()?);
        let (device, device_uuid) = match theirs {
            Device::Cpu if uuid != DeviceUuid::default() => {
                return Err(invalid(format!("a CPU batch with a device UUID {uuid}")));
            }
            Device::Cpu => (Device::Cpu, None),
            Device::Cuda(_) => (Device::Cuda(local_ordinal(uuid, theirs)?), Some(uuid)),
            Device::CudaHost(_) => (Device::CudaHost(local_ordinal(uuid, theirs)?), Some(uuid)),
            Device::CudaManaged(_) => (Device::CudaManaged(local_ordinal(uuid, theirs)?), Some(uuid)),
        };
        let n = r.u32()? as usize;
        if n > r.remaining() / 9 {
            return Err(invalid(format!("{n} regions in a frame of {} bytes", r.remaining())));
        }
        let mut regions = Vec::with_capacity(n);
        let size =
            |r: &mut Reader<'_>| usize::try_from(r.u64()?).map_err(|_| invalid("a region size out of range".into()));
        let mut fd = |what: &str| {
            fds.next()
                .ok_or_else(|| invalid(format!("a {what} region without its descriptor")))
        };
        for _ in 0..n {
            let region = match r.u8()? {
                REGION_CUDA => {
                    let uuid = DeviceUuid(r.array::<UUID_LEN>()?);
                    let handle = IpcMemHandle::deserialize(r.take(IpcMemHandle::SERIALIZED_LEN)?)?;
                    RegionHandle::Cuda {
                        ordinal: local_ordinal(uuid, theirs)?,
                        uuid,
                        handle,
                    }
                }
                kind @ (REGION_SHARED_CUDA | REGION_SHARED_CUDA_KEPT) => {
                    let uuid = DeviceUuid(r.array::<UUID_LEN>()?);
                    let id = r.u64()?;
                    // A device this process does not see is told first, whether the region came
                    // with its descriptor or is named by id (it was never kept then).
                    let ordinal = local_ordinal(uuid, theirs)?;
                    let handle = match kind {
                        REGION_SHARED_CUDA => SharedDeviceHandle::from_fd(fd("shared device")?, id, size(r)?),
                        _ => kept.as_deref().and_then(|k| k.handle(id)).ok_or_else(|| {
                            invalid(format!(
                                "a shared device region named by id {id}, which this receiver does not keep"
                            ))
                        })?,
                    };
                    RegionHandle::SharedCuda { ordinal, uuid, handle }
                }
                REGION_HOST => {
                    let size = size(r)?;
                    RegionHandle::Host(SharedMemHandle::from_fd(fd("host")?, size))
                }
                k => return Err(invalid(format!("region kind {k}"))),
            };
            regions.push(region);
        }
        let n = r.u32()? as usize;
        if n > r.remaining() / 4 {
            return Err(invalid(format!(
                "{n} dictionaries in a frame of {} bytes",
                r.remaining()
            )));
        }
        let dictionaries = (0..n).map(|_| Ok(r.bytes()?.to_vec())).collect::<Result<Vec<_>>>()?;
        let metadata = r.bytes()?.to_vec();
        let n = r.u32()? as usize;
        if n > r.remaining() / 20 {
            return Err(invalid(format!(
                "{n} buffer locations in a frame of {} bytes",
                r.remaining()
            )));
        }
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let locations = r
            .take(n * 20)?
            .chunks_exact(20)
            .map(|l| BufferLocation {
                region: u32::from_le_bytes(l[..4].try_into().expect("4 bytes")),
                offset: word(&l[4..12]),
                len: word(&l[12..]),
            })
            .collect();
        // A descriptor read whole: the regions sent with their descriptors are kept from now on
        // (those already kept stay as they are).
        if let Some(kept) = kept {
            for r in &regions {
                if let RegionHandle::SharedCuda { handle, .. } = r {
                    kept.keep(handle);
                }
            }
        }
        Ok(BatchDescriptor {
            device,
            device_uuid,
            dictionaries,
            metadata,
            regions,
            locations,
        })
    }

    /// The descriptor as bytes plus the file descriptors of its regions that travel as such (a
    /// frame payload of its own; the channel embeds the same encoding in its batch frames).
    pub fn to_bytes(&self) -> (Vec<u8>, Vec<BorrowedFd<'_>>) {
        let mut w = Writer::with_capacity(self.encoded_len());
        let mut fds = Vec::new();
        self.encode(&mut w, &mut fds, |_| false);
        (w.buf, fds)
    }

    /// Reads [`BatchDescriptor::to_bytes`]'s form; every byte must be used and every descriptor
    /// claimed.
    pub fn from_bytes(bytes: &[u8], fds: Vec<OwnedFd>) -> Result<BatchDescriptor> {
        let mut r = Reader::new(bytes);
        let mut fds = fds.into_iter();
        let d = Self::decode(&mut r, &mut fds, None)?;
        r.finish()?;
        if fds.next().is_some() {
            return Err(Error::InvalidData(
                "more file descriptors than regions that take one".into(),
            ));
        }
        Ok(d)
    }
}

/// The tag that starts an encoded descriptor: `ACD` and the version of the encoding. Version 2
/// names devices by UUID (version 1, untagged, named them by the exporter's ordinal).
const FORMAT: [u8; 4] = *b"ACD\x02";
/// The bytes of a device UUID.
const UUID_LEN: usize = 16;
/// Region kinds on the wire (1 was a CUDA region by ordinal, before UUIDs).
const REGION_HOST: u8 = 2;
const REGION_CUDA: u8 = 3;
const REGION_SHARED_CUDA: u8 = 4;
/// A region of shared device memory the receiving end of a channel keeps, by id alone.
const REGION_SHARED_CUDA_KEPT: u8 = 5;

/// The UUID of `device`'s GPU, `None` for the CPU.
fn device_uuid(device: Device) -> Result<Option<DeviceUuid>> {
    device.ordinal().map(DeviceUuid::of).transpose()
}

/// The ordinal in this process of the device with `uuid`, which the sending process has as
/// `theirs`: [`Error::UnknownDevice`] when this process does not see it.
fn local_ordinal(uuid: DeviceUuid, theirs: Device) -> Result<usize> {
    uuid.ordinal().map_err(|e| match e {
        Error::UnknownDevice { uuid, reason } => Error::UnknownDevice {
            uuid,
            reason: format!("{reason}; the sending process has it as {theirs}"),
        },
        other => other,
    })
}

/// The IPC buffers of a descriptor's batch: each at its location in one of the regions opened.
struct Placed<'a> {
    locations: &'a [BufferLocation],
    regions: &'a [DeviceBuffer],
}

impl decode::Resolve for Placed<'_> {
    /// IPC buffer `index`'s region and offset there, once its location is checked against the
    /// metadata's length and the region.
    #[inline]
    fn check(&self, index: usize, _offset: usize, len: usize) -> Result<(&DeviceBuffer, usize)> {
        let loc = self
            .locations
            .get(index)
            .ok_or_else(|| Error::InvalidData(format!("no location for IPC buffer {index}")))?;
        if loc.len != len as u64 {
            return Err(Error::InvalidData(format!(
                "IPC buffer {index} has {len} bytes in the metadata and {} in its location",
                loc.len
            )));
        }
        let region = self.regions.get(loc.region as usize).ok_or_else(|| {
            Error::InvalidData(format!(
                "IPC buffer {index} in region {} of {}",
                loc.region,
                self.regions.len()
            ))
        })?;
        let fits = loc
            .offset
            .checked_add(loc.len)
            .is_some_and(|end| end <= region.len() as u64);
        if !fits {
            return Err(Error::InvalidData(format!(
                "IPC buffer {index} ({}..+{}) overruns its region of {} bytes",
                loc.offset,
                loc.len,
                region.len()
            )));
        }
        Ok((region, loc.offset as usize))
    }
}

/// How a batch can reach another process, decided before anything is exported or copied.
pub(crate) enum Route<'a> {
    /// Every buffer lies in memory another process can open: the batch is lent as it is.
    Lend(Located<'a>),
    /// The batch must be written into a message first, for the reason given (an array with an
    /// offset or an unknown null count, or a buffer in memory no other process can open).
    Copy(String),
}

impl<'a> Route<'a> {
    /// Decides how `batch` travels, in one walk of its buffers. Errors are malformed batches and,
    /// for a batch lent as it is, memory another process lent and no longer keeps
    /// ([`DeviceBuffer::check_readable`]; a copy checks its sources itself); a batch that cannot
    /// be lent as it is is [`Route::Copy`].
    pub(crate) fn of(batch: &'a DeviceRecordBatch) -> Result<Route<'a>> {
        let layouts = match BodyLayout::of(batch) {
            Ok(layouts) => layouts,
            Err(_) if needs_normalising(batch) => {
                return Ok(Route::Copy(
                    "an array with an offset or an unknown null count has no IPC layout as it is".into(),
                ));
            }
            Err(e) => return Err(e),
        };
        let device = batch.device();
        let mut regions: Vec<Region<'a>> = Vec::new();
        // Region index by the region's address in this process.
        let mut index: HashMap<u64, u32> = HashMap::new();
        let mut locations = Vec::with_capacity(layouts.iter().map(|l| l.buffers.len()).sum());
        // The last buffer placed, its region and its offset there: the next buffer is most often a
        // view of the same allocation, which needs no lookup.
        let mut last: Option<(&DeviceBuffer, u32, u64)> = None;
        for b in layouts.iter().flat_map(|l| &l.buffers) {
            let Some(src) = b.source else {
                locations.push(BufferLocation::EMPTY);
                continue;
            };
            if let Some((prev, region, prev_offset)) = last
                && src.shares_allocation(prev)
            {
                // Checked readable with `prev`.
                // Views of one allocation lie in one region at the distance they lie apart.
                let offset = prev_offset
                    .wrapping_add(src.offset() as u64)
                    .wrapping_sub(prev.offset() as u64);
                locations.push(BufferLocation {
                    region,
                    offset,
                    len: b.len as u64,
                });
                last = Some((src, region, offset));
                continue;
            }
            // Lent on, the memory is handed on: not once its lender let go of it (a copy checks
            // its sources itself).
            src.check_readable()?;
            let (key, offset, kind) = match (device, src.resource()) {
                (Device::Cuda(o), MemoryResource::Device(r)) if r == o => {
                    (src.address() - src.offset() as u64, src.offset(), RegionKind::Cuda)
                }
                (Device::Cuda(_), _) => match SharedDeviceRegion::find(src) {
                    Some((region, offset)) => (region.address(), offset, RegionKind::SharedCuda(region)),
                    None => return Ok(Route::Copy(not_exportable(src))),
                },
                (Device::Cpu, _) => match SharedRegion::find(src) {
                    Some((region, offset)) => (region.address(), offset, RegionKind::Host(region)),
                    None => return Ok(Route::Copy(not_exportable(src))),
                },
                _ => return Ok(Route::Copy(not_exportable(src))),
            };
            let region = *index.entry(key).or_insert_with(|| {
                regions.push(Region { buffer: src, kind });
                regions.len() as u32 - 1
            });
            locations.push(BufferLocation {
                region,
                offset: offset as u64,
                len: b.len as u64,
            });
            last = Some((src, region, offset as u64));
        }
        Ok(Route::Lend(Located {
            device,
            layouts,
            regions,
            locations,
        }))
    }
}

/// One region of a [`Located`] batch: a buffer in it, and what kind of memory it is.
struct Region<'a> {
    buffer: &'a DeviceBuffer,
    kind: RegionKind,
}

/// How a region reaches another process.
enum RegionKind {
    /// By CUDA IPC handle.
    Cuda,
    /// Shared device memory, by file descriptor.
    SharedCuda(Arc<SharedDeviceRegion>),
    /// Shared host memory, by file descriptor.
    Host(Arc<SharedRegion>),
}

/// A batch whose every buffer was found in memory another process can open, and where each lies.
pub(crate) struct Located<'a> {
    device: Device,
    layouts: Vec<BodyLayout<'a>>,
    regions: Vec<Region<'a>>,
    locations: Vec<BufferLocation>,
}

impl Located<'_> {
    /// Whether any of the batch's regions would be lent through a CUDA IPC handle.
    pub(crate) fn lends_cuda_ipc(&self) -> bool {
        self.regions.iter().any(|r| matches!(r.kind, RegionKind::Cuda))
    }

    /// The regions of shared device memory among the batch's.
    pub(crate) fn shared_regions(&self) -> Vec<Arc<SharedDeviceRegion>> {
        let shared = self.regions.iter().filter_map(|r| match &r.kind {
            RegionKind::SharedCuda(region) => Some(region.clone()),
            _ => None,
        });
        shared.collect()
    }

    /// Exports the regions and builds the descriptor.
    pub(crate) fn export(self) -> Result<BatchDescriptor> {
        let Located {
            device,
            mut layouts,
            regions,
            locations,
        } = self;
        // Every buffer the receivers can reach (and, on a GPU, write) is untrusted from now on.
        for source in layouts.iter().flat_map(|l| &l.buffers).filter_map(|b| b.source) {
            source.mark_exported();
        }
        let regions = regions
            .into_iter()
            .map(|r| match r.kind {
                RegionKind::Cuda => {
                    let o = r.buffer.device().ordinal().expect("CUDA IPC memory is on a GPU");
                    Ok(RegionHandle::Cuda {
                        ordinal: o,
                        uuid: DeviceUuid::of(o)?,
                        handle: IpcMemHandle::export(r.buffer)?,
                    })
                }
                RegionKind::SharedCuda(region) => Ok(RegionHandle::SharedCuda {
                    ordinal: region.ordinal(),
                    uuid: DeviceUuid::of(region.ordinal())?,
                    handle: region.handle(),
                }),
                RegionKind::Host(region) => Ok(RegionHandle::Host(region.handle()?)),
            })
            .collect::<Result<Vec<_>>>()?;
        let batch = layouts.pop().expect("a batch's layout");
        Ok(BatchDescriptor {
            device,
            device_uuid: device_uuid(device)?,
            dictionaries: layouts.iter().map(BodyLayout::metadata).collect(),
            metadata: batch.metadata(),
            regions,
            locations,
        })
    }
}

fn not_exportable(b: &DeviceBuffer) -> String {
    format!(
        "{b:?} ({:?}) cannot be opened by another process; allocate from MemoryResource::SharedDevice, \
         MemoryResource::Device or MemoryResource::SharedHost, or write a message",
        b.resource()
    )
}

/// A region opened in this process.
#[derive(Clone, Debug)]
pub(crate) enum Mapping {
    Cuda(Arc<OpenedHandle>),
    SharedCuda(Arc<SharedDeviceRegion>),
    Host(SharedMapping),
}

impl Mapping {
    /// Whether both are the same mapping.
    pub(crate) fn same_as(&self, other: &Mapping) -> bool {
        match (self, other) {
            (Mapping::Cuda(a), Mapping::Cuda(b)) => Arc::ptr_eq(a, b),
            (Mapping::SharedCuda(a), Mapping::SharedCuda(b)) => Arc::ptr_eq(a, b),
            (Mapping::Host(a), Mapping::Host(b)) => a.same_as(b),
            _ => false,
        }
    }

    fn buffer(&self, owner: impl Any + Send + Sync, fence: Option<Arc<dyn Fence>>) -> DeviceBuffer {
        match self {
            Mapping::Cuda(h) => h.buffer_owned_by(owner, fence),
            // Kept by this process's mapping: readable after its creator is gone.
            Mapping::SharedCuda(region) => region.buffer(owner),
            Mapping::Host(m) => m.buffer(owner, fence),
        }
    }
}
