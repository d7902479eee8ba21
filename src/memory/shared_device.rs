//! Shared device memory: GPU memory that other processes map and keep.
//!
//! [`MemoryResource::SharedDevice`](crate::memory::MemoryResource::SharedDevice) allocations are
//! made with CUDA's virtual memory management (`cuMemCreate`) and exported as POSIX file
//! descriptors ([`SharedDeviceHandle`]), which cross a Unix socket with `SCM_RIGHTS` as the CPU
//! device's memfds do. The driver counts the processes that map the physical memory: a peer that
//! mapped a region keeps reading it after its creator freed it or died, which memory exported
//! through a CUDA IPC handle (`cuIpcOpenMemHandle`) does not promise. Sizes are rounded up to the
//! device's granularity (2 MiB on current GPUs).
//!
//! Every live region, created or opened, is registered by address, so the IPC layer finds the
//! region behind any [`DeviceBuffer`] that views it, including buffers received from another
//! process, which can therefore be passed on without a copy. A received descriptor is mapped anew
//! each time (the descriptor says nothing that identifies its memory safely across peers).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::device::{self, Device};
use crate::driver::{self, ShareableMemory};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::memory::cache::{Region, Registry};

/// One region of shared device memory mapped into this process.
#[derive(Debug)]
pub(crate) struct SharedDeviceRegion {
    memory: ShareableMemory,
    ctx: Arc<CudaContext>,
}

/// Live regions by start address (created and opened ones).
static REGISTRY: Registry<SharedDeviceRegion> = Registry::new();

impl Region for SharedDeviceRegion {
    fn address(&self) -> u64 {
        self.memory.ptr
    }

    fn size(&self) -> usize {
        self.memory.size
    }
}

/// Whether device `ordinal` can make shared device memory: the driver has the entry points and
/// the GPU supports virtual memory management with POSIX file descriptors.
pub(crate) fn supported(ordinal: usize) -> bool {
    use driver::CUdevice_attribute as A;
    let Ok(ctx) = device::context(ordinal) else {
        return false;
    };
    let has = |a| ctx.attribute(a).is_ok_and(|v| v != 0);
    driver::shareable_available(|| {
        has(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
            && has(A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    })
}

impl SharedDeviceRegion {
    /// Allocates a region of at least `size` bytes on device `ordinal`.
    pub(crate) fn create(ordinal: usize, size: usize) -> Result<Arc<SharedDeviceRegion>> {
        Self::mapped(ordinal, || {
            // SAFETY: checked `supported`; the context is bound (`mapped`).
            unsafe { driver::shareable_alloc(size, ordinal) }.map_err(Error::alloc(Device::Cuda(ordinal), size))
        })
    }

    /// Binds device `ordinal`'s context, makes the memory with `make` and registers the region.
    fn mapped(ordinal: usize, make: impl FnOnce() -> Result<ShareableMemory>) -> Result<Arc<SharedDeviceRegion>> {
        if !supported(ordinal) {
            return Err(Error::Unsupported(format!(
                "shared device memory on cuda:{ordinal}: the driver or GPU lacks virtual memory \
                 management with POSIX file descriptors; use MemoryResource::Device"
            )));
        }
        let ctx = device::context(ordinal)?;
        ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
        let memory = make()?;
        let region = Arc::new(SharedDeviceRegion { memory, ctx });
        REGISTRY.insert(&region);
        Ok(region)
    }

    /// The address of the first byte in this process.
    pub(crate) fn address(&self) -> u64 {
        self.memory.ptr
    }

    /// The region's size in bytes (a multiple of the device's granularity).
    pub(crate) fn size(&self) -> usize {
        self.memory.size
    }

    /// The device's ordinal in this process.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// A handle for another process: a new descriptor of the memory, and the region's size.
    pub(crate) fn handle(&self) -> Result<SharedDeviceHandle> {
        // SAFETY: the region is live (borrowed) until it drops.
        let fd = unsafe { driver::shareable_export(&self.memory) }?;
        Ok(SharedDeviceHandle { fd, size: self.size() })
    }

    /// The registered region holding `buffer`'s bytes, and the buffer's offset in it.
    pub(crate) fn find(buffer: &DeviceBuffer) -> Option<(Arc<SharedDeviceRegion>, usize)> {
        REGISTRY.find(buffer.address(), buffer.len())
    }

    /// The whole region as a buffer of device `ordinal` that keeps `owner` alive until its last
    /// view drops. The owner must keep this region alive (hold it).
    pub(crate) fn buffer(&self, owner: impl std::any::Any + Send + Sync) -> DeviceBuffer {
        // SAFETY: the region is mapped for `size` bytes while the owner (which holds it) lives.
        unsafe { DeviceBuffer::from_raw_parts(self.address(), self.size(), Device::Cuda(self.ordinal()), owner) }
    }
}

impl Drop for SharedDeviceRegion {
    fn drop(&mut self) {
        REGISTRY.remove(self.memory.ptr);
        // Errors cannot be reported from here; the driver keeps them for the context's next call.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the region's memory, mapped in this context and given back once; every view
            // of it is gone (they own this region).
            let _ = unsafe { driver::shareable_free(&self.memory) };
        }
    }
}

/// What another process needs to map a region of shared device memory: a descriptor of its
/// memory and its size.
#[derive(Debug)]
pub struct SharedDeviceHandle {
    fd: OwnedFd,
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
        let handle = region.handle()?;
        buffer.mark_exported();
        Ok((handle, offset))
    }

    /// A handle from a received descriptor and the size the peer announced.
    pub fn from_fd(fd: OwnedFd, size: usize) -> SharedDeviceHandle {
        SharedDeviceHandle { fd, size }
    }

    /// The descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
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
        SharedDeviceRegion::mapped(ordinal, || {
            // SAFETY: checked `supported`; the context is bound (`mapped`).
            unsafe { driver::shareable_import(self.fd.as_fd(), self.size, ordinal) }
        })
    }
}
