//! Memory resources and the allocations they hand out.

use std::alloc::Layout;
use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;

use crate::device::{Device, Stream};
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::cache::Region;
use crate::memory::fence::Fence;

/// The alignment of every allocation this crate makes on the host, and of every buffer it plans.
pub const ALIGNMENT: usize = 64;

/// Where and how memory is allocated. Every [`DeviceBuffer`](crate::DeviceBuffer) remembers its resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MemoryResource {
    /// Ordinary host memory, 64-byte aligned, zero-initialised (the CPU device).
    Host,
    /// Stream-ordered pool memory of a GPU (`cuMemAllocAsync`): fast to allocate and free, but
    /// `cuIpcGetMemHandle` rejects it, so it cannot cross processes. Falls back to
    /// [`MemoryResource::Device`] on GPUs without memory pools.
    DevicePool(usize),
    /// Plain device memory (`cuMemAlloc`) that CUDA IPC can export: what Arrow C++'s CUDA IPC
    /// reads. A process that opened it must not read it once its creator freed it or died.
    Device(usize),
    /// Device memory that other processes map and keep (CUDA virtual memory management,
    /// `cuMemCreate`, exported as a POSIX file descriptor): a process that mapped it reads it for
    /// as long as it keeps the mapping, whatever becomes of its creator. Sizes are rounded up to the
    /// device's granularity (2 MiB on current GPUs). [`Error::Unsupported`] where the driver or
    /// GPU lacks it; [`MemoryResource::shared_for`] picks it where it is supported.
    SharedDevice(usize),
    /// Page-locked host memory (fresh pages registered with `cuMemHostRegister`, portable and
    /// mapped into the device's address space): the fast target of device-to-host copies, readable
    /// by the CPU at full speed.
    PinnedHost(usize),
    /// Write-combined page-locked host memory (`cuMemHostAlloc`): fast for uploads, very slow for
    /// the CPU to read.
    WriteCombinedHost(usize),
    /// CUDA managed (unified) memory (`cuMemAllocManaged`), reachable from host and device.
    Managed(usize),
    /// Host memory that other processes can map (the CPU device): a sealed `memfd` mapped shared,
    /// zero-initialised. It stands in for CUDA IPC on the CPU: the IPC layer sends the file
    /// descriptor to a peer process. Linux only.
    SharedHost,
    /// Memory allocated elsewhere and wrapped, on the given device.
    Foreign(Device),
}

impl MemoryResource {
    /// The resource a device uses by default: pool memory for a GPU, pinned memory for CUDA_HOST.
    pub fn default_for(device: Device) -> MemoryResource {
        match device {
            Device::Cpu => MemoryResource::Host,
            Device::Cuda(o) => MemoryResource::DevicePool(o),
            Device::CudaHost(o) => MemoryResource::PinnedHost(o),
            Device::CudaManaged(o) => MemoryResource::Managed(o),
        }
    }

    /// The memory of `device` that other processes can map and keep: [`MemoryResource::SharedHost`]
    /// for the CPU, [`MemoryResource::SharedDevice`] for a GPU that supports it,
    /// [`MemoryResource::Device`] for one that does not (CUDA IPC), and the default resource for
    /// the other devices (not exportable).
    pub fn shared_for(device: Device) -> MemoryResource {
        match device {
            Device::Cpu => MemoryResource::SharedHost,
            Device::Cuda(o) if crate::memory::shared_device::supported(o) => MemoryResource::SharedDevice(o),
            Device::Cuda(o) => MemoryResource::Device(o),
            other => MemoryResource::default_for(other),
        }
    }

    /// The device that this resource's memory belongs to.
    pub fn device(self) -> Device {
        match self {
            MemoryResource::Host | MemoryResource::SharedHost => Device::Cpu,
            MemoryResource::DevicePool(o) | MemoryResource::Device(o) | MemoryResource::SharedDevice(o) => {
                Device::Cuda(o)
            }
            MemoryResource::PinnedHost(o) | MemoryResource::WriteCombinedHost(o) => Device::CudaHost(o),
            MemoryResource::Managed(o) => Device::CudaManaged(o),
            MemoryResource::Foreign(d) => d,
        }
    }

    /// Whether memory of this resource can be handed to another process without a copy:
    /// [`MemoryResource::Device`] through a CUDA IPC handle (`cuIpcGetMemHandle` rejects pool memory),
    /// [`MemoryResource::SharedDevice`] and [`MemoryResource::SharedHost`] through a file descriptor.
    pub fn ipc_exportable(self) -> bool {
        matches!(
            self,
            MemoryResource::Device(_) | MemoryResource::SharedDevice(_) | MemoryResource::SharedHost
        )
    }

    /// Allocates `size` bytes. Pool memory is allocated in the order of `stream` (the device's shared
    /// stream when `stream` is the CPU's) and later freed on that stream.
    ///
    /// Device memory that runs out is tried once more after the idle regions of shared device
    /// memory kept for reuse on that device were freed, if there were any: they serve only
    /// allocations of their own size. (What the device's memory pool keeps, the driver gives back
    /// itself to an allocation that would otherwise fail.)
    pub(crate) fn allocate(self, size: usize, stream: &Stream) -> Result<Allocation> {
        let first = self.allocate_once(size, stream);
        match (&first, self) {
            (
                Err(Error::OutOfMemory { .. }),
                MemoryResource::DevicePool(o) | MemoryResource::Device(o) | MemoryResource::SharedDevice(o),
            ) if crate::memory::shared_device::free_idle(o) > 0 => self.allocate_once(size, stream),
            _ => first,
        }
    }

    fn allocate_once(self, size: usize, stream: &Stream) -> Result<Allocation> {
        let device = self.device();
        if size == 0 {
            return Ok(Allocation {
                ptr: ALIGNMENT as u64,
                size,
                resource: self,
                release: Release::Nothing,
                ipc_handle: OnceLock::new(),
                exported: AtomicBool::new(false),
                fence: None,
            });
        }
        let ctx = device.context()?;
        let alloc_err = Error::alloc(device, size);
        let (ptr, release) = match (self, ctx) {
            (MemoryResource::Host, _) => {
                let layout = Layout::from_size_align(size, ALIGNMENT).map_err(|_| Error::OutOfMemory {
                    device,
                    requested: size,
                })?;
                // SAFETY: the layout has a non-zero size (checked above).
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(Error::OutOfMemory {
                        device,
                        requested: size,
                    });
                }
                (p as u64, Release::Host(layout))
            }
            (MemoryResource::SharedHost, _) => {
                // The region (fd and mapping) is owned by the allocation and unmapped when it drops.
                let region = crate::memory::shm::SharedRegion::create(size)?;
                (region.address(), Release::Owner(Box::new(region)))
            }
            (MemoryResource::SharedDevice(o), Some(_)) => {
                // The region (its mapping and handle) is owned by the allocation, freed when it drops.
                let region = crate::memory::shared_device::SharedDeviceRegion::create(o, size)?;
                (region.address(), Release::Owner(Box::new(region)))
            }
            (MemoryResource::DevicePool(o), Some(ctx)) if ctx.has_async_alloc() => {
                let stream = match stream.cuda() {
                    Some(s) if s.context().ordinal() == o => stream.clone(),
                    _ => Stream::shared(device)?,
                };
                let raw = stream.bind()?;
                // SAFETY: the stream belongs to this device's context, bound above.
                let p = unsafe { driver::mem_alloc_async(size, raw) }.map_err(alloc_err)?;
                (p, Release::Pool(stream))
            }
            (MemoryResource::DevicePool(_) | MemoryResource::Device(_), Some(ctx)) => {
                ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
                // SAFETY: the context is bound to this thread.
                let p = unsafe { driver::mem_alloc(size) }.map_err(alloc_err)?;
                (p, Release::Device(ctx))
            }
            (MemoryResource::PinnedHost(o), Some(_)) => {
                // The region (its mapping and registration) is owned by the allocation, freed when it drops.
                let region = crate::memory::register::PinnedRegion::create(o, size)?;
                (region.address(), Release::Owner(Box::new(region)))
            }
            (MemoryResource::WriteCombinedHost(_), Some(ctx)) => {
                ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
                // SAFETY: the context is bound to this thread.
                let p = unsafe { driver::mem_host_alloc_write_combined(size) }.map_err(alloc_err)?;
                (p as u64, Release::WriteCombinedHost(ctx))
            }
            (MemoryResource::Managed(_), Some(ctx)) => {
                ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
                // SAFETY: the context is bound to this thread.
                let p = unsafe { driver::mem_alloc_managed(size) }.map_err(alloc_err)?;
                (p, Release::Device(ctx))
            }
            (MemoryResource::Foreign(_), _) => {
                return Err(Error::Unsupported("foreign memory is wrapped, not allocated".into()));
            }
            (_, None) => unreachable!("every CUDA resource's device has a context"),
        };
        Ok(Allocation {
            ptr,
            size,
            resource: self,
            release,
            ipc_handle: OnceLock::new(),
            exported: AtomicBool::new(false),
            fence: None,
        })
    }
}

/// How an allocation is given back.
enum Release {
    Nothing,
    Host(Layout),
    Device(Arc<CudaContext>),
    Pool(Stream),
    WriteCombinedHost(Arc<CudaContext>),
    Owner(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// The owner of several buffers at addresses of its own (every buffer of one imported array):
    /// the allocation spans them, and only the views of them are memory (see
    /// [`Allocation::spanning`]).
    Span(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// One block of memory with one owner. Buffers share it through an `Arc` and view ranges of it.
pub(crate) struct Allocation {
    ptr: u64,
    size: usize,
    resource: MemoryResource,
    release: Release,
    /// The CUDA IPC handle of the allocation, once exported: the driver may hand out different
    /// bytes for each `cuIpcGetMemHandle` of one allocation, and a peer that caches mappings by
    /// handle would then open it again every time.
    ipc_handle: OnceLock<[u8; 64]>,
    /// A handle of the allocation (CUDA IPC or a memfd) was made for another process, which may
    /// then write it (a CUDA IPC mapping is always read-write): what was valid in it may not be.
    exported: AtomicBool,
    /// For memory another process lent: whether it still keeps it (see `fence.rs`).
    fence: Option<Arc<dyn Fence>>,
}

impl Allocation {
    /// Wraps memory owned by `owner`, which is dropped when the allocation is.
    ///
    /// # Safety
    /// `ptr..ptr + size` must be memory of `device` that stays valid until `owner` is dropped.
    pub(crate) unsafe fn foreign(ptr: u64, size: usize, device: Device, owner: Box<dyn Any + Send + Sync>) -> Self {
        Allocation {
            ptr,
            size,
            resource: MemoryResource::Foreign(device),
            release: Release::Owner(owner),
            ipc_handle: OnceLock::new(),
            exported: AtomicBool::new(false),
            fence: None,
        }
    }

    /// Like [`Allocation::foreign`], for memory that another process lent: reads check `fence`
    /// first.
    ///
    /// # Safety
    /// As for [`Allocation::foreign`], while `fence` passes.
    pub(crate) unsafe fn foreign_fenced(
        ptr: u64,
        size: usize,
        device: Device,
        owner: Box<dyn Any + Send + Sync>,
        fence: Arc<dyn Fence>,
    ) -> Self {
        // SAFETY: the caller's contract.
        let mut alloc = unsafe { Allocation::foreign(ptr, size, device, owner) };
        alloc.fence = Some(fence);
        alloc
    }

    /// Like [`Allocation::foreign`], for several buffers of one owner that lie anywhere in
    /// `ptr..ptr + size`: one allocation for them all, which their views share. The bytes between
    /// them need not be memory, so the allocation is never viewed whole
    /// ([`Allocation::is_span`]).
    ///
    /// # Safety
    /// Each buffer viewed must be memory of `device` that stays valid until `owner` is dropped.
    pub(crate) unsafe fn spanning(ptr: u64, size: usize, device: Device, owner: Box<dyn Any + Send + Sync>) -> Self {
        Allocation {
            ptr,
            size,
            resource: MemoryResource::Foreign(device),
            release: Release::Span(owner),
            ipc_handle: OnceLock::new(),
            exported: AtomicBool::new(false),
            fence: None,
        }
    }

    /// Like [`Allocation::foreign`], but keeping the resource the memory came from.
    ///
    /// # Safety
    /// As for [`Allocation::foreign`], and the memory must be of `resource`'s kind.
    pub(crate) unsafe fn owned_by(
        ptr: u64,
        size: usize,
        resource: MemoryResource,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        Allocation {
            ptr,
            size,
            resource,
            release: Release::Owner(owner),
            ipc_handle: OnceLock::new(),
            exported: AtomicBool::new(false),
            fence: None,
        }
    }

    /// Whether the allocation spans the buffers of one owner ([`Allocation::spanning`]), so that
    /// only its views are memory.
    pub(crate) fn is_span(&self) -> bool {
        matches!(self.release, Release::Span(_))
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's CUDA IPC handle: `export` makes it the first time, later calls return the
    /// same bytes.
    pub(crate) fn ipc_handle(&self, export: impl FnOnce() -> Result<[u8; 64]>) -> Result<[u8; 64]> {
        if let Some(h) = self.ipc_handle.get() {
            return Ok(*h);
        }
        let h = export()?;
        self.mark_exported();
        Ok(*self.ipc_handle.get_or_init(|| h))
    }

    /// Records that a handle of the allocation was made for another process.
    pub(crate) fn mark_exported(&self) {
        self.exported.store(true, Ordering::Release);
    }

    /// The fence of memory another process lent, if any.
    pub(crate) fn fence(&self) -> Option<&Arc<dyn Fence>> {
        self.fence.as_ref()
    }

    /// Whether a handle of the allocation was ever made for another process.
    pub(crate) fn is_exported(&self) -> bool {
        self.exported.load(Ordering::Acquire)
    }

    pub(crate) fn size(&self) -> usize {
        self.size
    }

    pub(crate) fn resource(&self) -> MemoryResource {
        self.resource
    }

    /// Frees pool memory in the order of `stream` rather than the stream it was allocated on
    /// (other kinds of memory are freed at once).
    pub(crate) fn free_on(mut self, stream: &Stream) {
        if let Release::Pool(s) = &mut self.release
            && stream
                .cuda()
                .is_some_and(|c| Some(c.context().ordinal()) == self.resource.device().ordinal())
        {
            *s = stream.clone();
        }
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Allocation({:#x}, {} bytes, {:?})",
            self.ptr, self.size, self.resource
        )
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // Errors cannot be reported from here and must not panic; the driver keeps them sticky for
        // the context, where the next call reports them.
        match &self.release {
            Release::Nothing | Release::Owner(_) | Release::Span(_) => {}
            Release::Host(layout) => {
                // SAFETY: allocated with exactly this layout in `allocate`.
                unsafe { std::alloc::dealloc(self.ptr as *mut u8, *layout) }
            }
            Release::Device(ctx) => {
                if ctx.bind_to_thread().is_ok() {
                    // SAFETY: allocated by cuMemAlloc / cuMemAllocManaged in this context, freed once.
                    let _ = unsafe { driver::mem_free(self.ptr) };
                }
            }
            Release::Pool(stream) => {
                if let Ok(raw) = stream.bind() {
                    // SAFETY: allocated by cuMemAllocAsync on this device, freed once in stream order.
                    let _ = unsafe { driver::mem_free_async(self.ptr, raw) };
                }
            }
            Release::WriteCombinedHost(ctx) => {
                if ctx.bind_to_thread().is_ok() {
                    // SAFETY: allocated by cuMemHostAlloc, freed once.
                    let _ = unsafe { driver::mem_free_host(self.ptr as *mut std::ffi::c_void) };
                }
            }
        }
    }
}
