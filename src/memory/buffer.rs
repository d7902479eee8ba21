//! [`DeviceBuffer`]: a range of one allocation on some device.

use std::any::Any;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::{Device, Event, Stream};
use crate::driver;
use crate::error::{Error, Result};
use crate::memory::fence::Fence;
use crate::memory::resource::{Allocation, MemoryResource};

/// A contiguous range of memory on a device: a view of one allocation that it shares with every
/// other view of it. The memory is freed when the last view drops.
///
/// Reads are allowed from any view. Writes through safe methods need `&mut self` and a buffer that
/// is the only view of its allocation ([`DeviceBuffer::is_mutable`]), so a host-accessible buffer is
/// never written while something else reads it.
#[derive(Clone)]
pub struct DeviceBuffer {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes from `resource`, in the order of `stream` for pool memory. Host memory
    /// is zeroed; device memory is not initialised.
    pub fn alloc(resource: MemoryResource, len: usize, stream: &Stream) -> Result<Self> {
        Ok(Self::from_allocation(resource.allocate(len, stream)?))
    }

    /// Allocates `len` zeroed bytes.
    pub fn zeroed(resource: MemoryResource, len: usize, stream: &Stream) -> Result<Self> {
        let mut b = Self::alloc(resource, len, stream)?;
        b.fill(0, stream)?;
        Ok(b)
    }

    /// Allocates a buffer from `resource` holding a copy of `data`; returns when the copy is done.
    pub fn from_host(data: &[u8], resource: MemoryResource, stream: &Stream) -> Result<Self> {
        let mut b = Self::alloc(resource, data.len(), stream)?;
        b.copy_from_host(0, data, stream)?;
        Ok(b)
    }

    pub(crate) fn from_allocation(alloc: Allocation) -> Self {
        let len = alloc.size();
        DeviceBuffer {
            alloc: Arc::new(alloc),
            offset: 0,
            len,
        }
    }

    /// Wraps memory allocated elsewhere (another library's device memory, say). `owner` is dropped,
    /// releasing the memory, when the last view of the buffer drops.
    ///
    /// # Safety
    /// `address..address + len` must be memory of `device` that stays valid and is not written by
    /// anyone else while `owner` is alive.
    pub unsafe fn from_raw_parts(address: u64, len: usize, device: Device, owner: impl Any + Send + Sync) -> Self {
        // SAFETY: the caller's contract is the one `foreign` needs.
        Self::from_allocation(unsafe { Allocation::foreign(address, len, device, Box::new(owner)) })
    }

    /// [`DeviceBuffer::from_raw_parts`] for memory another process lent: every read of it (and of
    /// its views) checks `fence` first.
    ///
    /// # Safety
    /// As for [`DeviceBuffer::from_raw_parts`], for as long as `fence` passes.
    pub(crate) unsafe fn from_raw_parts_fenced(
        address: u64,
        len: usize,
        device: Device,
        owner: impl Any + Send + Sync,
        fence: Arc<dyn Fence>,
    ) -> Self {
        // SAFETY: the caller's contract is the one `foreign_fenced` needs.
        Self::from_allocation(unsafe { Allocation::foreign_fenced(address, len, device, Box::new(owner), fence) })
    }

    /// Whether the memory can still be read: an error for memory that another process lent (a batch
    /// received over the IPC channel) and no longer keeps, because it died or reclaimed
    /// it; `Ok` for all other memory. Every read through this crate checks it first (copies,
    /// downloads, exports, messages); code that hands [`DeviceBuffer::address`] on itself (to a
    /// kernel, say) calls it too. A check cannot keep the owner alive afterwards: a read already
    /// under way when the owner goes is not stopped.
    pub fn check_readable(&self) -> Result<()> {
        match self.alloc.fence() {
            Some(fence) => fence.check(),
            None => Ok(()),
        }
    }

    /// The fence of memory another process lent, if any.
    pub(crate) fn fence(&self) -> Option<&Arc<dyn Fence>> {
        self.alloc.fence()
    }

    /// Hands the memory out the same way: its address, its length, and an owner that keeps it valid
    /// until dropped.
    pub fn into_raw_parts(self) -> (u64, usize, Box<dyn Any + Send + Sync>) {
        (self.address(), self.len, Box::new(self))
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of the first byte (a device pointer for device memory).
    pub fn address(&self) -> u64 {
        self.alloc.ptr() + self.offset as u64
    }

    /// The offset of this view in its allocation: 0 for the buffers of an imported C Device array,
    /// which lie at addresses of the producer's choosing, each as if an allocation of its own
    /// (see [`DeviceBuffer::parent`]).
    pub fn offset(&self) -> usize {
        match self.alloc.is_span() {
            true => 0,
            false => self.offset,
        }
    }

    /// The device the memory belongs to.
    pub fn device(&self) -> Device {
        self.alloc.resource().device()
    }

    /// The resource the memory came from.
    pub fn resource(&self) -> MemoryResource {
        self.alloc.resource()
    }

    /// Whether the CPU can read the memory directly.
    pub fn is_host_accessible(&self) -> bool {
        self.device().is_host_accessible()
    }

    /// Whether safe writes are allowed: this is the only view of an allocation this crate made.
    pub fn is_mutable(&self) -> bool {
        Arc::strong_count(&self.alloc) == 1 && !matches!(self.resource(), MemoryResource::Foreign(_))
    }

    /// The whole allocation this buffer views, when it views only part of it (never for the
    /// buffers of an imported C Device array: see [`DeviceBuffer::offset`]).
    pub fn parent(&self) -> Option<DeviceBuffer> {
        let part = self.offset != 0 || self.len != self.alloc.size();
        (part && !self.alloc.is_span()).then(|| DeviceBuffer {
            alloc: self.alloc.clone(),
            offset: 0,
            len: self.alloc.size(),
        })
    }

    /// The CUDA IPC handle of the allocation this buffer views: `export` makes it the first time,
    /// later calls (through any view) return the same bytes.
    pub(crate) fn ipc_handle(&self, export: impl FnOnce() -> Result<[u8; 64]>) -> Result<[u8; 64]> {
        self.alloc.ipc_handle(export)
    }

    /// Records that the allocation this buffer views was handed to another process, which may write
    /// it from then on.
    pub(crate) fn mark_exported(&self) {
        self.alloc.mark_exported();
    }

    /// Whether the allocation this buffer views was ever handed to another process (a CUDA IPC
    /// handle or a memfd made for it): its bytes may have changed since they were written.
    pub(crate) fn is_exported(&self) -> bool {
        self.alloc.is_exported()
    }

    /// Whether two buffers view the same allocation, which is one range of memory (never for the
    /// buffers of an imported C Device array: see [`DeviceBuffer::offset`]).
    pub fn shares_allocation(&self, other: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.alloc, &other.alloc) && !self.alloc.is_span()
    }

    /// Shortens the buffer to its first `len` bytes; a buffer no longer than that stays as it is.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// A zero-copy view of `len` bytes from `offset`, sharing ownership of the memory.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceBuffer> {
        check_range(offset, len, self.len)?;
        Ok(DeviceBuffer {
            alloc: self.alloc.clone(),
            offset: self.offset + offset,
            len,
        })
    }

    /// The bytes, when the memory is host-accessible and still readable
    /// ([`DeviceBuffer::check_readable`]).
    pub fn host_slice(&self) -> Option<&[u8]> {
        // SAFETY: host-accessible memory of at least `len` bytes, alive as long as `self`; safe writes
        // need a unique view and `&mut`, and async writes are unsafe with a contract not to read.
        (self.is_host_accessible() && self.check_readable().is_ok())
            .then(|| unsafe { std::slice::from_raw_parts(self.address() as *const u8, self.len) })
    }

    /// The bytes for writing, when the memory is host-accessible and this is its only view.
    pub fn host_slice_mut(&mut self) -> Option<&mut [u8]> {
        // SAFETY: host-accessible memory of `len` bytes that no other view can reach (checked), and
        // `&mut self` keeps this one from being used meanwhile.
        (self.is_host_accessible() && self.is_mutable())
            .then(|| unsafe { std::slice::from_raw_parts_mut(self.address() as *mut u8, self.len) })
    }

    /// Wraps host-accessible memory as an arrow [`Buffer`](arrow_buffer::Buffer) without a copy; the
    /// arrow buffer keeps the memory alive. Device memory is refused: no device pointer ever enters
    /// an arrow buffer through safe code.
    pub fn to_arrow_buffer(&self) -> Result<arrow_buffer::Buffer> {
        if !self.is_host_accessible() {
            return Err(Error::Unsupported(format!(
                "{} memory is not host-accessible; copy it to the host first",
                self.device()
            )));
        }
        self.check_readable()?;
        // SAFETY: the pointer is valid host memory for `len` bytes and the owner keeps it alive.
        Ok(unsafe { self.arrow_buffer_unchecked() })
    }

    /// Wraps the memory as an arrow buffer whatever device it is on.
    ///
    /// # Safety
    /// Device memory in an arrow buffer must never be read by the CPU.
    pub(crate) unsafe fn arrow_buffer_unchecked(&self) -> arrow_buffer::Buffer {
        let ptr = NonNull::new(self.address() as *mut u8).unwrap_or(NonNull::dangling());
        let owner: Arc<AssertUnwindSafe<DeviceBuffer>> = Arc::new(AssertUnwindSafe(self.clone()));
        // SAFETY: the caller vouches for how the memory is used; the owner keeps it alive.
        unsafe { arrow_buffer::Buffer::from_custom_allocation(ptr, self.len, owner) }
    }

    /// Copies the whole buffer into a new host vector; returns when the copy is done.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.copy_to_host(0, &mut out, stream)?;
        Ok(out)
    }

    /// Copies `dst.len()` bytes starting at `position` into `dst`; returns when the copy is done.
    pub fn copy_to_host(&self, position: usize, dst: &mut [u8], stream: &Stream) -> Result<()> {
        // SAFETY: `dst` is not touched again before the copy's event has completed.
        unsafe { self.copy_to_host_async(position, dst, stream)? }.synchronize()
    }

    /// Copies `src` into this buffer at `position`; returns when the copy is done.
    pub fn copy_from_host(&mut self, position: usize, src: &[u8], stream: &Stream) -> Result<()> {
        // SAFETY: neither `src` nor this buffer is touched again before the copy's event has completed.
        unsafe { self.copy_from_host_async(position, src, stream)? }.synchronize()
    }

    /// Copies all of `src` into this buffer at `position`, on any pair of devices; returns when done.
    pub fn copy_from(&mut self, position: usize, src: &DeviceBuffer, stream: &Stream) -> Result<()> {
        // SAFETY: both buffers outlive the copy, whose event is waited on before returning.
        unsafe { self.copy_from_async(position, src, stream)? }.synchronize()
    }

    /// Copies this buffer into a new allocation from `resource`; returns when the copy is done.
    pub fn copy_to(&self, resource: MemoryResource, stream: &Stream) -> Result<DeviceBuffer> {
        let mut out = DeviceBuffer::alloc(resource, self.len, stream)?;
        out.copy_from(0, self, stream)?;
        Ok(out)
    }

    /// Sets every byte to `value`; returns when done.
    pub fn fill(&mut self, value: u8, stream: &Stream) -> Result<()> {
        self.check_mutable()?;
        if self.is_empty() {
            return Ok(());
        }
        if self.is_host_accessible() {
            // Host memory (pageable or not) is written by the CPU, after earlier work on the stream.
            stream.synchronize()?;
            // SAFETY: host-accessible memory of `len` bytes viewed only by `self`.
            unsafe { std::ptr::write_bytes(self.address() as *mut u8, value, self.len) };
            return Ok(());
        }
        let stream = stream_for(stream, self.device(), self.device())?;
        let raw = stream.bind()?;
        // SAFETY: `len` bytes of device memory, in this stream's context.
        unsafe { driver::memset_d8_async(self.address(), value, self.len, raw) }?;
        stream.synchronize()
    }

    /// Starts copying `dst.len()` bytes from `position` into `dst` and returns an event for the copy.
    ///
    /// # Safety
    /// `dst` must stay valid and must not be read or written until the event completes.
    pub unsafe fn copy_to_host_async(&self, position: usize, dst: &mut [u8], stream: &Stream) -> Result<Event> {
        check_range(position, dst.len(), self.len)?;
        self.check_readable()?;
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        // SAFETY: the ranges are valid; the caller keeps `dst` alive and untouched until the event.
        unsafe {
            copy(
                dst.as_mut_ptr() as u64,
                Device::Cpu,
                self.address() + position as u64,
                self.device(),
                dst.len(),
                &stream,
            )?
        };
        stream.record()
    }

    /// Starts copying `src` into this buffer at `position` and returns an event for the copy.
    ///
    /// # Safety
    /// `src` must stay valid and must not be written until the event completes, and nothing may read
    /// this buffer on the host before then.
    pub unsafe fn copy_from_host_async(&mut self, position: usize, src: &[u8], stream: &Stream) -> Result<Event> {
        self.check_mutable()?;
        check_range(position, src.len(), self.len)?;
        let stream = stream_for(stream, self.device(), Device::Cpu)?;
        // SAFETY: the ranges are valid; the caller keeps `src` alive and unchanged until the event.
        unsafe {
            copy(
                self.address() + position as u64,
                self.device(),
                src.as_ptr() as u64,
                Device::Cpu,
                src.len(),
                &stream,
            )?
        };
        stream.record()
    }

    /// Starts copying all of `src` into this buffer at `position` and returns an event for the copy.
    /// Both buffers stay alive until the copy has finished only if the caller keeps them: the event
    /// is the caller's to wait on before dropping either.
    ///
    /// # Safety
    /// Neither buffer may be dropped, nor this one read on the host, until the event completes.
    pub unsafe fn copy_from_async(&mut self, position: usize, src: &DeviceBuffer, stream: &Stream) -> Result<Event> {
        self.check_mutable()?;
        check_range(position, src.len, self.len)?;
        src.check_readable()?;
        let stream = stream_for(stream, self.device(), src.device())?;
        // SAFETY: valid, non-overlapping ranges (self is a unique view); the caller keeps both alive.
        unsafe {
            copy(
                self.address() + position as u64,
                self.device(),
                src.address(),
                src.device(),
                src.len,
                &stream,
            )?
        };
        stream.record()
    }

    /// Drops this view; if it was the last, pool memory is freed in the order of `stream` rather
    /// than of the stream that allocated it.
    pub fn free_on(self, stream: &Stream) {
        if let Ok(alloc) = Arc::try_unwrap(self.alloc) {
            alloc.free_on(stream);
        }
    }

    /// Whether both buffers hold the same bytes (copies both to the host when needed).
    pub fn equals(&self, other: &DeviceBuffer, stream: &Stream) -> Result<bool> {
        if self.len != other.len {
            return Ok(false);
        }
        if self.device() == other.device() && self.address() == other.address() {
            return Ok(true);
        }
        Ok(self.to_vec(stream)? == other.to_vec(stream)?)
    }

    /// The bytes as lowercase hex, for debugging (copies to the host).
    pub fn to_hex(&self, stream: &Stream) -> Result<String> {
        use std::fmt::Write;
        let bytes = self.to_vec(stream)?;
        let mut s = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            let _ = write!(s, "{b:02x}");
        }
        Ok(s)
    }

    fn check_mutable(&self) -> Result<()> {
        if self.is_mutable() {
            Ok(())
        } else {
            Err(Error::Unsupported(format!(
                "buffer is not mutable: {} views share its allocation{}",
                Arc::strong_count(&self.alloc),
                if matches!(self.resource(), MemoryResource::Foreign(_)) {
                    " (foreign memory)"
                } else {
                    ""
                }
            )))
        }
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceBuffer({} bytes at {:#x} on {})",
            self.len,
            self.address(),
            self.device()
        )
    }
}

/// Checks that `offset..offset + len` lies within `size` bytes.
pub(crate) fn check_range(offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(Error::OutOfBounds { offset, len, size }),
    }
}

/// The stream a copy between `a` and `b` runs on: `stream` if it is a CUDA stream, else the CPU
/// stream when both sides are host-accessible, else the shared stream of the GPU involved.
pub(crate) fn stream_for(stream: &Stream, a: Device, b: Device) -> Result<Stream> {
    if stream.cuda().is_some() || (a.is_host_accessible() && b.is_host_accessible()) {
        return Ok(stream.clone());
    }
    let gpu = if matches!(a, Device::Cuda(_)) { a } else { b };
    Stream::shared(gpu)
}

/// Copies `len` bytes between any two kinds of memory in the order of `stream` (at once on the CPU
/// stream, which needs both sides host-accessible).
///
/// # Safety
/// Both ranges must be valid memory of their devices; host memory in them must not be accessed by
/// anything else until the stream's work completes.
pub(crate) unsafe fn copy(
    dst: u64,
    dst_device: Device,
    src: u64,
    src_device: Device,
    len: usize,
    stream: &Stream,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    match stream.cuda() {
        None => {
            debug_assert!(dst_device.is_host_accessible() && src_device.is_host_accessible());
            // SAFETY: host-accessible ranges (caller); `copy` allows overlap.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
            Ok(())
        }
        Some(_) => {
            let raw = stream.bind()?;
            // SAFETY: with unified addressing the driver infers each side's kind from the address;
            // the ranges are valid (caller).
            unsafe { driver::memcpy_async(dst, src, len, raw) }
        }
    }
}
