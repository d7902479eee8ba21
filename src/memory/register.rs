//! Pinning host memory in place for a scope, like numba's `pinned` / `mapped` context managers.
//!
//! [`register`] page-locks an existing slice (`cuMemHostRegister`, portable and mapped) until the
//! returned guard drops. While it is registered, copies between the slice and device memory run at
//! the speed of pinned memory (the driver recognises registered ranges in every copy, including
//! [`DeviceBuffer::copy_from_host`]) and kernels can read it through
//! [`Registered::device_pointer`].
//!
//! Registering costs about as much as copying the memory over the link (16-23 GB/s on the GPU machine)
//! and unregistering about 20 ms per GiB: worth it for memory that is copied many times, not for one
//! copy. For staging, prefer a [`PinnedPool`](crate::memory::pinned::PinnedPool).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::device::{self, Device};
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};

/// A page-locked registration of a host range; unregistered on drop.
#[derive(Debug)]
struct Registration {
    /// The host address (an integer, so the guard is `Send` and `Sync` like the slice it covers).
    address: usize,
    len: usize,
    ordinal: usize,
    /// The context it was registered in; `None` for an empty range, which registers nothing.
    ctx: Option<Arc<CudaContext>>,
}

impl Registration {
    fn new(address: usize, len: usize, ordinal: usize) -> Result<Registration> {
        let ctx = device::context(ordinal)?;
        if len == 0 {
            return Ok(Registration {
                address,
                len,
                ordinal,
                ctx: None,
            });
        }
        // SAFETY: `address..address + len` is a live slice that the guard borrows for as long as the
        // registration lasts; registering does not read or write it. The context is bound (by
        // `context`).
        unsafe { driver::mem_host_register(address as *mut c_void, len) }
            .map_err(Error::alloc(Device::CudaHost(ordinal), len))?;
        Ok(Registration {
            address,
            len,
            ordinal,
            ctx: Some(ctx),
        })
    }

    fn device_pointer(&self) -> Result<u64> {
        match &self.ctx {
            None => Ok(self.address as u64),
            Some(ctx) => {
                ctx.bind_to_thread().map_err(Error::driver("cuCtxSetCurrent"))?;
                host_get_device_pointer(self.address as u64)
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // Errors cannot be reported from here and must not panic.
        if let Some(ctx) = &self.ctx
            && ctx.bind_to_thread().is_ok()
        {
            // SAFETY: the range was registered by `new` at this address and is unregistered once.
            let _ = unsafe { driver::mem_host_unregister(self.address as *mut c_void) };
        }
    }
}

/// Fresh host memory, page-locked and mapped into a device's address space: what
/// [`MemoryResource::PinnedHost`] allocates. Unregistered, then unmapped, on drop.
///
/// Made by mapping anonymous memory (aligned to huge pages and advised to use them, from 2 MiB
/// on), writing one byte of each page on the allocating thread, and registering it
/// (`cuMemHostRegister`). On the GPU machine that pins 1 GiB in 0.30 s on one thread and 0.06 s
/// over 16 threads, against 0.55 s for `cuMemHostAlloc`, which pins one allocation at a time
/// whatever the threads.
pub(crate) struct PinnedRegion {
    // Unregistered before it is unmapped (fields drop in order); the mapping is only dropped.
    registration: Registration,
    _mapping: Mapping,
}

impl PinnedRegion {
    /// At least `len` (> 0) bytes of zeroed pinned memory for CUDA device `ordinal`.
    pub(crate) fn create(ordinal: usize, len: usize) -> Result<PinnedRegion> {
        let mapping = Mapping::new(ordinal, len)?;
        let registration = Registration::new(mapping.address, mapping.len, ordinal)?;
        Ok(PinnedRegion {
            registration,
            _mapping: mapping,
        })
    }

    /// The address of the first byte.
    pub(crate) fn address(&self) -> u64 {
        self.registration.address as u64
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // Unregistering does not wait for the device's work (`cuMemFreeHost` does): a copy still
        // reading or writing the region once it is unmapped would fault, and the context with it.
        // Waiting here gives regions `cuMemFreeHost`'s guarantee; the pinned pool keeps its
        // blocks, so regions are seldom dropped.
        if let Some(ctx) = &self.registration.ctx {
            let _ = ctx.synchronize();
        }
    }
}

/// An anonymous private mapping of its own, unmapped on drop.
struct Mapping {
    address: usize,
    len: usize,
}

impl Mapping {
    /// A mapping of at least `len` (> 0) zero bytes, every page faulted in.
    fn new(ordinal: usize, len: usize) -> Result<Mapping> {
        const HUGE: usize = 2 << 20;
        const PAGE: usize = 4096;
        let out_of_memory = || Error::OutOfMemory {
            device: Device::CudaHost(ordinal),
            requested: len,
        };
        // More than the machine has would be mapped (the kernel overcommits) and then killed
        // while its pages are faulted in.
        if crate::memory::pinned::physical_memory().is_some_and(|bytes| len > bytes) {
            return Err(out_of_memory());
        }
        let align = if len >= HUGE { HUGE } else { PAGE };
        let len = len.checked_next_multiple_of(align).ok_or_else(out_of_memory)?;
        // The mapping starts on a page: mapping `align - PAGE` more bytes leaves room to align it.
        let mapped = len.checked_add(align - PAGE).ok_or_else(out_of_memory)?;
        // SAFETY: a new anonymous private mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(out_of_memory());
        }
        let base = base as usize;
        let address = base.next_multiple_of(align);
        let (head, tail) = (address - base, base + mapped - (address + len));
        // SAFETY: both ranges lie in the mapping just made, outside the part kept; neither is used.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((address + len) as *mut libc::c_void, tail);
            }
        }
        let mapping = Mapping { address, len };
        // Not inherited by child processes, as `cuMemHostAlloc`'s memory is not: Linux copies
        // DMA-pinned pages into the child at fork, so every process spawned would copy the pool.
        // SAFETY: the range is this mapping.
        #[cfg(target_os = "linux")]
        if unsafe { libc::madvise(address as *mut libc::c_void, len, libc::MADV_DONTFORK) } != 0 {
            return Err(out_of_memory());
        }
        #[cfg(target_os = "linux")]
        if align == HUGE {
            // A hint: without transparent huge pages the mapping keeps small pages.
            // SAFETY: the range is this mapping.
            unsafe { libc::madvise(address as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        }
        // Faulting the pages in here, on the allocating thread: threads that allocate at once fault
        // theirs in at once (on the GPU machine 16 threads pin 5 times as fast as one).
        for page in (0..len).step_by(PAGE) {
            // SAFETY: the byte lies in the mapping, which nothing else uses yet; writing the zero it
            // holds changes nothing but makes the kernel back the page.
            unsafe { std::ptr::write_volatile((address + page) as *mut u8, 0) };
        }
        Ok(mapping)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `new`, is unmapped once, and nothing uses it any more
        // (the allocation that owns it is gone, and it was unregistered first).
        unsafe { libc::munmap(self.address as *mut libc::c_void, self.len) };
    }
}

/// A host slice, page-locked and mapped into the device's address space until dropped: `D` is the
/// slice, shared ([`Registered`]) or mutable ([`RegisteredMut`]).
#[derive(Debug)]
pub struct RegisteredSlice<D> {
    data: D,
    reg: Registration,
}

/// A shared host slice, page-locked and mapped into the device's address space until dropped.
pub type Registered<'a> = RegisteredSlice<&'a [u8]>;

/// A mutable host slice, page-locked and mapped into the device's address space until dropped.
pub type RegisteredMut<'a> = RegisteredSlice<&'a mut [u8]>;

/// Page-locks `data` (`cuMemHostRegister`, portable and device-mapped) until the guard drops, with
/// CUDA device `ordinal`'s context current.
///
/// Registration covers whole pages: registering a range that shares a page with one already
/// registered fails with a driver error (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), and so does
/// read-only memory (a `static` in the binary). An empty slice registers nothing. Without a driver or
/// GPU this returns [`Error::NoDriver`] / [`Error::NoDevice`].
pub fn register(data: &[u8], ordinal: usize) -> Result<Registered<'_>> {
    let reg = Registration::new(data.as_ptr() as usize, data.len(), ordinal)?;
    Ok(RegisteredSlice { data, reg })
}

/// Page-locks `data` as [`register`] does, keeping it writable through the guard.
pub fn register_mut(data: &mut [u8], ordinal: usize) -> Result<RegisteredMut<'_>> {
    let reg = Registration::new(data.as_mut_ptr() as usize, data.len(), ordinal)?;
    Ok(RegisteredSlice { data, reg })
}

impl<D: AsRef<[u8]>> RegisteredSlice<D> {
    /// The registered bytes.
    pub fn host_slice(&self) -> &[u8] {
        self.data.as_ref()
    }

    /// The address through which kernels on the device reach the bytes
    /// (`cuMemHostGetDevicePointer`). Only device work may use it, and only while the guard lives;
    /// only that of a [`RegisteredMut`] may write through it, and the host must not touch the bytes
    /// while such work runs. For an empty slice, the host address.
    pub fn device_pointer(&self) -> Result<u64> {
        self.reg.device_pointer()
    }

    /// The pinned memory's device: [`Device::CudaHost`] of the ordinal it was registered with.
    pub fn device(&self) -> Device {
        Device::CudaHost(self.reg.ordinal)
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.reg.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.reg.len == 0
    }
}

impl RegisteredMut<'_> {
    /// The registered bytes, writable.
    pub fn host_slice_mut(&mut self) -> &mut [u8] {
        self.data
    }
}

/// The device-visible address of mapped page-locked host memory, with a context bound.
fn host_get_device_pointer(host: u64) -> Result<u64> {
    driver::available()?;
    // SAFETY: the driver is loaded (checked above) and a context is bound (caller); the driver only
    // looks the host address up and reports an error for memory it did not pin.
    unsafe { driver::mem_host_get_device_pointer(host as *mut c_void) }
}

impl DeviceBuffer {
    /// The address at which device work reaches this memory:
    ///
    /// - device and managed memory: [`DeviceBuffer::address`] itself;
    /// - pinned host memory ([`MemoryResource::PinnedHost`], [`MemoryResource::WriteCombinedHost`],
    ///   foreign [`Device::CudaHost`] memory): the mapping of the host memory into the device's
    ///   address space (`cuMemHostGetDevicePointer`), through which kernels read and write host
    ///   memory over the link;
    /// - ordinary host memory: [`Error::Unsupported`] (register it first, see [`register`]).
    ///
    /// Without a driver, pinned memory gives the driver's error. An empty buffer gives its address.
    /// Memory that another process lent and no longer keeps is that error
    /// ([`DeviceBuffer::check_readable`]).
    pub fn device_pointer(&self) -> Result<u64> {
        self.check_readable()?;
        match self.resource() {
            MemoryResource::DevicePool(_)
            | MemoryResource::Device(_)
            | MemoryResource::SharedDevice(_)
            | MemoryResource::Managed(_) => Ok(self.address()),
            MemoryResource::Foreign(Device::Cuda(_) | Device::CudaManaged(_)) => Ok(self.address()),
            MemoryResource::PinnedHost(o)
            | MemoryResource::WriteCombinedHost(o)
            | MemoryResource::Foreign(Device::CudaHost(o)) => {
                device::context(o)?;
                if self.is_empty() {
                    return Ok(self.address());
                }
                // Look up the allocation's start, which the driver knows for certain, then add the
                // view's offset: a mapping is one contiguous range.
                let base = self.address() - self.offset() as u64;
                Ok(host_get_device_pointer(base)? + self.offset() as u64)
            }
            MemoryResource::Host | MemoryResource::SharedHost | MemoryResource::Foreign(Device::Cpu) => {
                Err(Error::Unsupported(
                    "ordinary host memory has no device address; register it (memory::register) or copy it".into(),
                ))
            }
        }
    }
}
