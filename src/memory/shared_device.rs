//! Shared device memory: GPU memory that other processes map and keep.
//!
//! [`MemoryResource::SharedDevice`](crate::memory::MemoryResource::SharedDevice) allocations are
//! regions made with CUDA's virtual memory management (`cuMemCreate`) and exported as POSIX file
//! descriptors ([`SharedDeviceHandle`]), which cross a Unix socket with `SCM_RIGHTS` as the CPU
//! device's memfds do. The driver counts the processes that map the physical memory: a peer that
//! mapped a region keeps reading it after its creator freed it or died, which memory exported
//! through a CUDA IPC handle (`cuIpcOpenMemHandle`) does not promise. Sizes are rounded up to the
//! device's granularity (2 MiB on current GPUs).
//!
//! Making and mapping a region costs hundreds of microseconds, so both ends keep them:
//!
//! - while something keeps the pool open ([`KeepIdle`]: the IPC channel's senders do), a region
//!   this process made goes back to an idle pool when its last buffer drops (after the device
//!   finished with it) and serves the next allocation of its device and size, unless a handle of
//!   it went to another process that may still read it: only the IPC channel, which knows when
//!   every receiver let go of a batch, returns handles. The pool holds at most [`IDLE_BYTES`]
//!   (the oldest regions freed first to make room), or the region dropped last alone where it is
//!   larger, and is freed when the last [`KeepIdle`] drops, and for an allocation of its device
//!   that runs out of memory ([`free_idle`]);
//! - every region, made or mapped, has an id unique in its process, which travels with its
//!   descriptor: a receiver keeps the regions it mapped ([`OpenedRegions`], one per sender, by the
//!   sender's ids) until the sender tells it to let one go, and the sender names a region the
//!   receiver keeps by its id alone, without its descriptor (see the IPC channel's protocol);
//! - a watcher ([`SharedDeviceRegion::watch_made`]) is told of each region made, so that the IPC
//!   channel can announce it to receivers, which map it before any batch in it is sent.
//!
//! A region whose last buffer drops waits for the device (`cuCtxSynchronize`) before it is reused
//! or unmapped, as `cuMemFree` does: work still queued on it would otherwise write or read memory
//! no longer mapped, which faults the whole context (`cuMemUnmap` does not wait).
//!
//! Every live region, made or mapped, is registered by address, so the IPC layer finds the region
//! behind any [`DeviceBuffer`] that views it, including buffers received from another process,
//! which can therefore be passed on without a copy (with the descriptor they came with).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaContext;

use crate::device::{self, Device};
use crate::driver::{self, ShareableMemory};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::cache::{Region, Registry};

/// The most bytes of idle regions this process keeps for reuse, unless the one region it keeps is
/// larger.
pub(crate) const IDLE_BYTES: usize = 256 << 20;

/// One region of shared device memory mapped into this process.
#[derive(Debug)]
pub(crate) struct SharedDeviceRegion {
    memory: Option<ShareableMemory>,
    ctx: Arc<CudaContext>,
    /// The id its descriptors carry, unique in this process: the same memory made here keeps it
    /// when reused; a region mapped from another process gets one of its own (the creator's ids
    /// are unique only in the creator, and a region passed on may meet another creator's).
    id: u64,
    /// Its descriptor, exported when it was made (see [`SharedDeviceRegion::create`]; handles share
    /// it), or the one it was mapped from (a mapped region cannot be exported again).
    fd: Arc<OwnedFd>,
    /// Mapped from another process's descriptor (never reused here).
    from_peer: bool,
    /// Handles made for other processes and not yet [returned](SharedDeviceRegion::returned): a
    /// region with any is never reused, since a peer may still read it.
    outstanding: AtomicUsize,
}

/// Live regions by start address (made and mapped ones).
static REGISTRY: Registry<SharedDeviceRegion> = Registry::new();

/// A region this process made that nothing uses, kept for reuse.
#[derive(Debug)]
struct Idle {
    ordinal: usize,
    id: u64,
    memory: ShareableMemory,
    fd: Arc<OwnedFd>,
}

/// Idle regions, oldest first.
static IDLE: Mutex<VecDeque<Idle>> = Mutex::new(VecDeque::new());

/// The id of the next region this process makes.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The live [`KeepIdle`]s.
static KEEPERS: Mutex<usize> = Mutex::new(0);

/// How many regions this process has let go of for good (freed, or unmapped when mapped from a
/// peer): counted once each is neither live nor idle. Their ids never come back.
static RETIRED: AtomicU64 = AtomicU64::new(0);

/// Told of each region this process makes (not one reused from the idle pool), once it is
/// exported, on the thread that made it: see [`SharedDeviceRegion::watch_made`].
pub(crate) type MadeWatcher = dyn Fn(&Arc<SharedDeviceRegion>) + Send + Sync;

/// The watchers of regions being made, as long as their owners keep them.
static WATCHERS: Mutex<Vec<Weak<MadeWatcher>>> = Mutex::new(Vec::new());

/// The region's first byte in this process, and its size (a multiple of the device's granularity).
impl Region for SharedDeviceRegion {
    fn address(&self) -> u64 {
        self.memory().ptr
    }

    fn size(&self) -> usize {
        self.memory().size
    }
}

/// Whether device `ordinal` can make shared device memory: the driver has the entry points and
/// the GPU supports virtual memory management with POSIX file descriptors.
/// Asked once per device: every message a channel sends asks again.
pub(crate) fn supported(ordinal: usize) -> bool {
    use driver::CUdevice_attribute as A;
    static KNOWN: Mutex<BTreeMap<usize, bool>> = Mutex::new(BTreeMap::new());
    let mut known = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    *known.entry(ordinal).or_insert_with(|| {
        let Ok(ctx) = device::context(ordinal) else {
            return false;
        };
        let has = |a| ctx.attribute(a).is_ok_and(|v| v != 0);
        driver::shareable_available(|| {
            has(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
                && has(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
        })
    })
}

/// While one lives, regions this process made are kept for reuse when dropped (see the module's
/// documentation); when the last one drops, the idle regions are freed (receivers that still map
/// one keep its memory until they unmap it).
#[derive(Debug)]
pub(crate) struct KeepIdle(());

impl KeepIdle {
    pub(crate) fn new() -> KeepIdle {
        *KEEPERS.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        KeepIdle(())
    }
}

impl Drop for KeepIdle {
    fn drop(&mut self) {
        let mut keepers = KEEPERS.lock().unwrap_or_else(|p| p.into_inner());
        *keepers -= 1;
        if *keepers == 0 {
            retire_idle(|_| true);
        }
    }
}

/// Frees the idle regions of device `ordinal`, for an allocation there that ran out of memory;
/// returns their bytes.
pub(crate) fn free_idle(ordinal: usize) -> usize {
    retire_idle(|r| r.ordinal == ordinal)
}

/// Takes the idle regions `which` picks out of the pool and [`retire`]s them; returns their bytes.
fn retire_idle(which: impl Fn(&Idle) -> bool) -> usize {
    let freed: VecDeque<Idle> = {
        let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
        let (freed, kept) = idle.drain(..).partition(|r| which(r));
        *idle = kept;
        freed
    };
    freed.iter().for_each(|r| retire(r.ordinal, &r.memory));
    freed.iter().map(|r| r.memory.size).sum()
}

/// Lets go of a region for good: [`free`]s it and counts it in [`RETIRED`].
fn retire(ordinal: usize, memory: &ShareableMemory) {
    free(ordinal, memory);
    RETIRED.fetch_add(1, Ordering::SeqCst);
}

/// Unmaps `memory` and releases this process's handle of it.
fn free(ordinal: usize, memory: &ShareableMemory) {
    // Errors cannot be reported from a drop; the driver keeps them for the context's next call.
    if let Ok(ctx) = device::context(ordinal)
        && ctx.bind_to_thread().is_ok()
    {
        // SAFETY: mapped in this context, given back once (the caller took it from its owner);
        // nothing uses it any more.
        let _ = unsafe { driver::shareable_free(memory) };
    }
}

impl SharedDeviceRegion {
    /// A region of at least `size` bytes on device `ordinal`: an idle one of that size, or a new one.
    ///
    /// A new region is exported as it is made, not when it is first sent: the export
    /// (`cuMemExportToShareableHandle`) costs 80-290 µs (H100, H200), which the first batch sent in
    /// the region would otherwise wait for on its way to another process.
    pub(crate) fn create(ordinal: usize, size: usize) -> Result<Arc<SharedDeviceRegion>> {
        let ctx = Self::bound(ordinal)?;
        // SAFETY: `bound` checked that the device supports it.
        let size = unsafe { driver::shareable_size(size, ordinal) }?;
        let reused = {
            let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
            let found = idle.iter().position(|r| r.ordinal == ordinal && r.memory.size == size);
            found.and_then(|i| idle.remove(i))
        };
        let made = reused.is_none();
        let (id, memory, fd) = match reused {
            Some(r) => (r.id, r.memory, r.fd),
            None => {
                // SAFETY: supported, the context is bound, and the size is a shareable size.
                let memory = unsafe { driver::shareable_alloc(size, ordinal) }
                    .map_err(Error::alloc(Device::Cuda(ordinal), size))?;
                // SAFETY: made above, live.
                let fd = match unsafe { driver::shareable_export(&memory) } {
                    Ok(fd) => Arc::new(fd),
                    Err(e) => {
                        free(ordinal, &memory);
                        return Err(e);
                    }
                };
                (NEXT_ID.fetch_add(1, Ordering::Relaxed), memory, fd)
            }
        };
        let region = Self::register(SharedDeviceRegion {
            memory: Some(memory),
            ctx,
            id,
            fd,
            from_peer: false,
            outstanding: AtomicUsize::new(0),
        });
        if made {
            let watchers: Vec<_> = {
                let mut watchers = WATCHERS.lock().unwrap_or_else(|p| p.into_inner());
                watchers.retain(|w| w.strong_count() > 0);
                watchers.iter().filter_map(Weak::upgrade).collect()
            };
            watchers.iter().for_each(|w| w(&region));
        }
        Ok(region)
    }

    /// Calls `watcher` with each region this process makes from now on (not those reused from the
    /// idle pool), once it is exported, on the thread that made it, until the caller drops its
    /// last `Arc` of the watcher. The allocation waits for the watcher, which must not make a
    /// region itself, nor wait for a lock held while regions are made.
    pub(crate) fn watch_made(watcher: &Arc<MadeWatcher>) {
        WATCHERS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(watcher));
    }

    /// Device `ordinal`'s context, bound to this thread, where it supports shared device memory.
    fn bound(ordinal: usize) -> Result<Arc<CudaContext>> {
        if !supported(ordinal) {
            return Err(Error::Unsupported(format!(
                "shared device memory on cuda:{ordinal}: the driver or GPU lacks virtual memory \
                 management with POSIX file descriptors; use MemoryResource::Device"
            )));
        }
        let ctx = device::context(ordinal)?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        Ok(ctx)
    }

    fn register(region: SharedDeviceRegion) -> Arc<SharedDeviceRegion> {
        let region = Arc::new(region);
        REGISTRY.insert(&region);
        region
    }

    fn memory(&self) -> &ShareableMemory {
        self.memory.as_ref().expect("a live region has its memory")
    }

    /// The device's ordinal in this process.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// A handle for another process: the descriptor of the memory (the one it came with, for a
    /// region mapped from a peer), its id and its size.
    pub(crate) fn handle(&self) -> SharedDeviceHandle {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        self.announced()
    }

    /// A handle for a process that maps the region ahead of any batch in it (the IPC channel's
    /// announcements of regions as they are made): it lends nothing, so it is not counted against
    /// reusing the region; a batch in the region later goes with a [counted](Self::handle) one.
    pub(crate) fn announced(&self) -> SharedDeviceHandle {
        SharedDeviceHandle {
            fd: self.fd.clone(),
            id: self.id,
            size: self.size(),
        }
    }

    /// Every process that got one of the region's handles let go of what it mapped through it
    /// (the IPC channel says so when every receiver acknowledged a batch): one handle fewer stands
    /// in the way of reusing the region.
    pub(crate) fn returned(&self) {
        let _ = self
            .outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }

    /// How many regions this process has let go of for good so far: when it has not changed, every
    /// region seen live before still is (or is idle, to be reused under its id).
    pub(crate) fn retired() -> u64 {
        RETIRED.load(Ordering::SeqCst)
    }

    /// Those of `ids` that name no region of this process any more, live or idle: let go of for
    /// good (a region being let go of may be named too early, never too late once
    /// [`SharedDeviceRegion::retired`] counts it).
    pub(crate) fn retired_among(ids: impl Iterator<Item = u64>) -> Vec<u64> {
        let mut live = HashSet::new();
        REGISTRY.for_each(|r| {
            live.insert(r.id);
        });
        live.extend(IDLE.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|r| r.id));
        ids.filter(|id| !live.contains(id)).collect()
    }

    /// The number of regions mapped from other processes' descriptors in this process now (a hook
    /// for the crate's tests).
    pub(crate) fn mapped_from_peers() -> usize {
        REGISTRY.count(|r| r.from_peer)
    }

    /// The registered region holding `buffer`'s bytes, and the buffer's offset in it.
    pub(crate) fn find(buffer: &DeviceBuffer) -> Option<(Arc<SharedDeviceRegion>, usize)> {
        REGISTRY.find(buffer.address(), buffer.len())
    }

    /// The whole region as a buffer of its device that keeps `owner` alive until its last view
    /// drops. The owner must keep this region alive (hold it).
    pub(crate) fn buffer(&self, owner: impl std::any::Any + Send + Sync) -> DeviceBuffer {
        // SAFETY: the region is mapped for `size` bytes while the owner (which holds it) lives.
        unsafe { DeviceBuffer::from_raw_parts(self.address(), self.size(), Device::Cuda(self.ordinal()), owner) }
    }
}

impl Drop for SharedDeviceRegion {
    fn drop(&mut self) {
        let Some(memory) = self.memory.take() else { return };
        REGISTRY.remove(memory.ptr);
        let ordinal = self.ctx.ordinal();
        // Work of any stream may still read or write the region (an upload into a batch dropped
        // before it finished, a read of a received batch). Neither reuse nor `cuMemUnmap` waits
        // for it, and work on memory no longer mapped faults the whole context: the region is
        // let go of once the device is done, as `cuMemFree` and `PinnedRegion` wait.
        let done = self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok();
        let keepers = KEEPERS.lock().unwrap_or_else(|p| p.into_inner());
        if done && *keepers > 0 && !self.from_peer && *self.outstanding.get_mut() == 0 {
            // The region dropped last is the likeliest to serve the next allocation (a stream of
            // batches of one size): the oldest idle regions make room for it, and it is kept
            // alone where it is larger than the pool.
            let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
            let mut held: usize = idle.iter().map(|r| r.memory.size).sum();
            let mut evicted = Vec::new();
            while held + memory.size > IDLE_BYTES
                && let Some(old) = idle.pop_front()
            {
                held -= old.memory.size;
                evicted.push(old);
            }
            idle.push_back(Idle {
                ordinal,
                id: self.id,
                memory,
                fd: self.fd.clone(),
            });
            drop((idle, keepers));
            evicted.iter().for_each(|r| retire(r.ordinal, &r.memory));
            return;
        }
        drop(keepers);
        retire(ordinal, &memory);
    }
}

/// What another process needs to map a region of shared device memory: a descriptor of its
/// memory, the id its exporter gave it and its size. Clones share the descriptor.
#[derive(Clone, Debug)]
pub struct SharedDeviceHandle {
    fd: Arc<OwnedFd>,
    id: u64,
    size: usize,
}

impl SharedDeviceHandle {
    /// The handle of the region that holds `buffer` (memory of
    /// [`MemoryResource::SharedDevice`](crate::memory::MemoryResource::SharedDevice), or a region
    /// received from a peer), and the buffer's offset in it. The handle covers the whole region;
    /// whoever imports it can read and write it, so from this call on downloads of arrays in the
    /// region validate them, as for any memory handed to another process.
    pub fn export(buffer: &DeviceBuffer) -> Result<(SharedDeviceHandle, usize)> {
        let (region, offset) = SharedDeviceRegion::find(buffer).ok_or_else(|| {
            Error::Unsupported(format!(
                "{buffer:?} is not shared device memory; allocate it from MemoryResource::SharedDevice \
                 to send it without a copy"
            ))
        })?;
        let handle = region.handle();
        buffer.mark_exported();
        Ok((handle, offset))
    }

    /// A handle from a received descriptor and the id and size the peer announced.
    pub fn from_fd(fd: OwnedFd, id: u64, size: usize) -> SharedDeviceHandle {
        SharedDeviceHandle {
            fd: Arc::new(fd),
            id,
            size,
        }
    }

    /// The descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The id the exporting process gave the region (unique in that process).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The size of the region in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Maps the region on device `ordinal` of this process. The driver refuses a descriptor that
    /// is not shared device memory, and one of less memory than the announced size
    /// ([`Error::Driver`]); a size of zero is [`Error::InvalidData`]. The memory stays mapped, and
    /// valid, until the returned region drops, whatever becomes of its creator.
    pub(crate) fn open(self, ordinal: usize) -> Result<Arc<SharedDeviceRegion>> {
        if self.size == 0 {
            return Err(Error::InvalidData("a shared device region of zero bytes".into()));
        }
        let ctx = SharedDeviceRegion::bound(ordinal)?;
        // SAFETY: supported, and the context is bound (`bound`).
        let memory = unsafe { driver::shareable_import(self.fd.as_fd(), self.size, ordinal) }?;
        Ok(SharedDeviceRegion::register(SharedDeviceRegion {
            memory: Some(memory),
            ctx,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            fd: self.fd,
            from_peer: true,
            outstanding: AtomicUsize::new(0),
        }))
    }
}

/// The regions of shared device memory a receiver keeps for one sender, by the sender's ids: each
/// handle the sender sent, and its mapping once made, until the sender tells it to let one go
/// ([`OpenedRegions::forget`]). The sender names kept regions by id alone
/// ([`OpenedRegions::handle`]); a mapping that failed is tried again with the next batch that
/// names the region. The batches built over a region keep it mapped whatever this drops.
#[derive(Debug, Default)]
pub(crate) struct OpenedRegions {
    regions: HashMap<u64, Kept>,
}

/// A region a receiver keeps.
#[derive(Debug)]
struct Kept {
    handle: SharedDeviceHandle,
    mapped: Option<Arc<SharedDeviceRegion>>,
}

impl OpenedRegions {
    /// Keeps `handle`, just received, under its id (a region kept under it already, of its
    /// size, stays as it is).
    pub(crate) fn keep(&mut self, handle: &SharedDeviceHandle) {
        self.kept(handle);
    }

    /// [`Self::keep`], returning what is kept.
    fn kept(&mut self, handle: &SharedDeviceHandle) -> &mut Kept {
        let fresh = || Kept {
            handle: handle.clone(),
            mapped: None,
        };
        let kept = self.regions.entry(handle.id).or_insert_with(fresh);
        if kept.handle.size != handle.size {
            *kept = fresh();
        }
        kept
    }

    /// The handle kept under the sender's id `id`; `None` when none is.
    pub(crate) fn handle(&self, id: u64) -> Option<SharedDeviceHandle> {
        self.regions.get(&id).map(|k| k.handle.clone())
    }

    /// The region `handle` names, mapped on device `ordinal`: the mapping kept under its id (of
    /// its size and device), or a new one, kept from then on (with `handle`, as [`Self::keep`]
    /// keeps it).
    pub(crate) fn open(&mut self, handle: SharedDeviceHandle, ordinal: usize) -> Result<Arc<SharedDeviceRegion>> {
        let kept = self.kept(&handle);
        if let Some(r) = &kept.mapped
            && r.size() == handle.size
            && r.ordinal() == ordinal
        {
            return Ok(r.clone());
        }
        let region = handle.open(ordinal)?;
        kept.mapped = Some(region.clone());
        Ok(region)
    }

    /// Lets the region kept under the sender's id `id` go (its batches keep it mapped until they
    /// drop).
    pub(crate) fn forget(&mut self, id: u64) {
        self.regions.remove(&id);
    }

    /// Lets go of every kept region but those of `current` (ids and sizes) when the others come to
    /// more than `regions` or `bytes`, which a sender that counts what it had kept never lets
    /// happen; returns whether it did.
    pub(crate) fn bound(&mut self, regions: usize, bytes: usize, current: &[(u64, usize)]) -> bool {
        let current = |id: &u64| current.iter().any(|(c, _)| c == id);
        let others = self.regions.iter().filter(|(id, _)| !current(id));
        let (n, held) = others.fold((0, 0usize), |(n, held), (_, k)| {
            (n + 1, held.saturating_add(k.handle.size))
        });
        let over = n > regions || held > bytes;
        if over {
            self.regions.retain(|id, _| current(id));
        }
        over
    }

    /// The number of regions kept.
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }

    /// The bytes of the regions kept.
    pub(crate) fn bytes(&self) -> usize {
        self.regions.values().map(|k| k.handle.size).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    /// A handle of `size` bytes under `id`, of a descriptor that is not device memory: keeping one
    /// maps nothing.
    fn handle(id: u64, size: usize) -> SharedDeviceHandle {
        let fd = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        SharedDeviceHandle::from_fd(fd, id, size)
    }

    /// Serialises this module's cases that make regions on the GPU: each reads the idle pool,
    /// which the regions another drops would change.
    static GPU: Mutex<()> = Mutex::new(());

    /// While something keeps the idle pool, the region dropped last is kept for reuse even where
    /// it is larger than the pool: the oldest idle regions are freed to make room, and the next
    /// allocation of its size gets it back. (A sender streaming batches larger than the pool
    /// copies each into a message of one size.)
    #[test]
    fn the_region_dropped_last_is_kept_whatever_its_size() {
        let _gpu = GPU.lock().unwrap_or_else(|p| p.into_inner());
        if crate::device::cuda_for_tests().is_none() {
            return;
        }
        if !supported(0) {
            eprintln!("skipped: no shared device memory on cuda:0");
            return;
        }
        let _keep = KeepIdle::new();
        // Sizes no other case makes.
        let small = SharedDeviceRegion::create(0, 14 << 20).unwrap();
        let small_id = small.id;
        drop(small);
        assert!(
            IDLE.lock().unwrap().iter().any(|r| r.id == small_id),
            "a small region is kept"
        );
        let big = SharedDeviceRegion::create(0, IDLE_BYTES + (6 << 20)).unwrap();
        let (big_id, big_size) = (big.id, big.size());
        assert!(big_size > IDLE_BYTES);
        drop(big);
        assert_eq!(
            SharedDeviceRegion::retired_among([small_id, big_id].into_iter()),
            [small_id],
            "the small region freed to make room, the big one kept"
        );
        let again = SharedDeviceRegion::create(0, big_size).unwrap();
        assert_eq!(again.id, big_id, "the big region reused");
    }

    /// A region dropped while a copy out of it is still queued, behind 8 GiB of other copies, is
    /// let go of only once the copy is done, whether it was made here (and is freed: a handle of
    /// it went to another process, so it is not kept for reuse) or mapped from a descriptor (as a
    /// receiver maps a sender's): the stream then finishes without a fault and the copy read the
    /// region's bytes.
    #[test]
    fn regions_dropped_with_a_copy_queued_wait_for_it() {
        use crate::device::Stream;
        use crate::memory::MemoryResource;
        let _gpu = GPU.lock().unwrap_or_else(|p| p.into_inner());
        let Some(device) = crate::device::cuda_for_tests() else {
            return;
        };
        if !supported(0) {
            eprintln!("skipped: no shared device memory on cuda:0");
            return;
        }
        let stream = Stream::new(device).unwrap();
        let busy = 1 << 30;
        let from = DeviceBuffer::alloc(MemoryResource::Device(0), busy, &stream).unwrap();
        let mut to = DeviceBuffer::alloc(MemoryResource::Device(0), busy, &stream).unwrap();
        for mapped in [false, true] {
            let made = SharedDeviceRegion::create(0, 1).unwrap();
            let size = made.size();
            let pattern: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let view = made.buffer(made.clone());
            // SAFETY: the region holds `size` bytes; `pattern` outlives the copy (synchronised).
            unsafe {
                crate::memory::buffer::copy(
                    view.address(),
                    device,
                    pattern.as_ptr() as u64,
                    Device::Cpu,
                    size,
                    &stream,
                )
            }
            .unwrap();
            stream.synchronize().unwrap();
            let mut out = DeviceBuffer::alloc(MemoryResource::Device(0), size, &stream).unwrap();
            // Another test's device-wide synchronisation can let the copies finish early: then
            // this tries again.
            let queued = (0..5).any(|_| {
                let region = if mapped {
                    made.announced().open(0).unwrap()
                } else {
                    drop(made.handle());
                    made.clone()
                };
                let view = region.buffer(region.clone());
                for _ in 0..8 {
                    // SAFETY: both buffers outlive the copies (the stream is synchronised below).
                    unsafe { to.copy_from_async(0, &from, &stream) }.unwrap();
                }
                // SAFETY: `out` outlives the copy; the view and its region need not, which is what
                // this tests: a region's drop waits for the device before it lets the memory go.
                let copied = unsafe { out.copy_from_async(0, &view, &stream) }.unwrap();
                !copied.is_complete().unwrap()
            });
            assert!(queued, "mapped {mapped}: a copy still queued when its region dropped");
            drop((view, made));
            stream.synchronize().unwrap();
            assert!(
                out.to_vec(&stream).unwrap() == pattern,
                "mapped {mapped}: the copy read the region"
            );
        }
    }

    /// A receiver keeps what it is sent, finds it by id, lets it go when told, and lets go of
    /// everything but the batch at hand when the sender had it keep more than the bounds.
    #[test]
    fn kept_regions_are_found_by_id_and_bounded() {
        let mut kept = OpenedRegions::default();
        for id in 1..=3 {
            kept.keep(&handle(id, 100));
        }
        assert_eq!((kept.len(), kept.bytes()), (3, 300));
        assert_eq!(kept.handle(2).map(|h| (h.id(), h.size())), Some((2, 100)));
        assert!(kept.handle(9).is_none());
        // Sent again with its descriptor: the region kept stays.
        let before = kept.handle(1).unwrap().fd().as_raw_fd();
        kept.keep(&handle(1, 100));
        assert_eq!(kept.handle(1).unwrap().fd().as_raw_fd(), before);
        kept.forget(2);
        assert!(kept.handle(2).is_none());
        // Within the bounds besides the batch at hand (1): nothing goes.
        assert!(!kept.bound(1, 100, &[(1, 100)]));
        assert_eq!(kept.len(), 2);
        // Past them: all but the batch's regions go.
        assert!(kept.bound(1, 99, &[(1, 100)]));
        assert_eq!((kept.len(), kept.bytes()), (1, 100));
        kept.keep(&handle(4, 100));
        kept.keep(&handle(5, 100));
        assert!(kept.bound(1, 1000, &[]), "two regions, one allowed");
        assert_eq!(kept.len(), 0);
    }
}
