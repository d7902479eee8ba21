//! Allocating, freeing, pinning, setting and copying memory.
//!
//! Copies take unified (virtual) addresses: with unified addressing the driver infers each side's
//! kind (device, pinned or pageable host) from the address, so one call serves every direction.

use std::ffi::c_void;

use cudarc::driver::sys::{
    CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CU_MEMHOSTALLOC_WRITECOMBINED, CU_MEMHOSTREGISTER_DEVICEMAP,
    CU_MEMHOSTREGISTER_PORTABLE, CUDA_MEMCPY2D, CUdeviceptr, CUmemAttach_flags, CUmemorytype, CUstream,
};

driver_calls! {
    /// Allocates `size` bytes of device memory in the bound context (`cuMemAlloc`): memory that can be
    /// exported through CUDA IPC.
    ///
    /// # Safety
    /// A context is bound to the calling thread. The memory must be freed once, with [`mem_free`].
    pub(crate) unsafe fn mem_alloc(size: usize) -> CUdeviceptr = cuMemAlloc_v2 {
        let mut ptr = 0;
        // SAFETY: a bound context (caller) and a valid out-parameter.
        unsafe { cuMemAlloc_v2(&mut ptr, size) }.result()?;
        Ok(ptr)
    }

    /// Allocates `size` bytes from the device's default pool in the order of `stream`
    /// (`cuMemAllocAsync`).
    ///
    /// # Safety
    /// `stream` is a live stream of the context bound to the calling thread. The memory must be freed
    /// once, with [`mem_free_async`].
    pub(crate) unsafe fn mem_alloc_async(size: usize, stream: CUstream) -> CUdeviceptr = cuMemAllocAsync {
        let mut ptr = 0;
        // SAFETY: a live stream of the bound context (caller) and a valid out-parameter.
        unsafe { cuMemAllocAsync(&mut ptr, size, stream) }.result()?;
        Ok(ptr)
    }

    /// Allocates `size` bytes of managed memory visible to every device and the host
    /// (`cuMemAllocManaged`, `CU_MEM_ATTACH_GLOBAL`).
    ///
    /// # Safety
    /// A context is bound to the calling thread. The memory must be freed once, with [`mem_free`].
    pub(crate) unsafe fn mem_alloc_managed(size: usize) -> CUdeviceptr = cuMemAllocManaged {
        let mut ptr = 0;
        let flags = CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32;
        // SAFETY: a bound context (caller) and a valid out-parameter.
        unsafe { cuMemAllocManaged(&mut ptr, size, flags) }.result()?;
        Ok(ptr)
    }

    /// Allocates `size` bytes of write-combined page-locked host memory (fast to upload from, very
    /// slow for the CPU to read), portable and mapped into the device's address space
    /// (`cuMemHostAlloc`).
    ///
    /// # Safety
    /// A context is bound to the calling thread. The memory must be freed once, with
    /// [`mem_free_host`].
    pub(crate) unsafe fn mem_host_alloc_write_combined(size: usize) -> *mut c_void = cuMemHostAlloc {
        let flags = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: a bound context (caller) and a valid out-parameter.
        unsafe { cuMemHostAlloc(&mut ptr, size, flags) }.result()?;
        Ok(ptr)
    }

    /// Frees memory from [`mem_alloc`] or [`mem_alloc_managed`] (`cuMemFree`).
    ///
    /// # Safety
    /// `ptr` came from one of those, in the bound context, and is freed once; no work uses it.
    pub(crate) unsafe fn mem_free(ptr: CUdeviceptr) -> () = cuMemFree_v2 {
        // SAFETY: as the caller promises.
        unsafe { cuMemFree_v2(ptr) }.result()
    }

    /// Frees pool memory from [`mem_alloc_async`] in the order of `stream` (`cuMemFreeAsync`).
    ///
    /// # Safety
    /// `ptr` came from [`mem_alloc_async`] on this device and is freed once; `stream` is a live stream
    /// of the bound context, after every use of the memory.
    pub(crate) unsafe fn mem_free_async(ptr: CUdeviceptr, stream: CUstream) -> () = cuMemFreeAsync {
        // SAFETY: as the caller promises.
        unsafe { cuMemFreeAsync(ptr, stream) }.result()
    }

    /// Frees page-locked host memory from [`mem_host_alloc_write_combined`] (`cuMemFreeHost`).
    ///
    /// # Safety
    /// `ptr` came from [`mem_host_alloc_write_combined`] and is freed once; nothing uses it any more.
    pub(crate) unsafe fn mem_free_host(ptr: *mut c_void) -> () = cuMemFreeHost {
        // SAFETY: as the caller promises.
        unsafe { cuMemFreeHost(ptr) }.result()
    }

    /// Page-locks `len` bytes of existing host memory at `ptr`, portable and mapped into the device's
    /// address space (`cuMemHostRegister`).
    ///
    /// # Safety
    /// A context is bound; the range is live host memory that stays allocated until
    /// [`mem_host_unregister`]. Registering neither reads nor writes it.
    pub(crate) unsafe fn mem_host_register(ptr: *mut c_void, len: usize) -> () = cuMemHostRegister_v2 {
        let flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: as the caller promises.
        unsafe { cuMemHostRegister_v2(ptr, len, flags) }.result()
    }

    /// Unregisters a range registered by [`mem_host_register`] (`cuMemHostUnregister`).
    ///
    /// # Safety
    /// `ptr` is the start of a range registered by [`mem_host_register`], unregistered once; a context
    /// is bound.
    pub(crate) unsafe fn mem_host_unregister(ptr: *mut c_void) -> () = cuMemHostUnregister {
        // SAFETY: as the caller promises.
        unsafe { cuMemHostUnregister(ptr) }.result()
    }

    /// The device-visible address of mapped page-locked host memory (`cuMemHostGetDevicePointer`).
    ///
    /// # Safety
    /// A context is bound. The driver only looks `host` up, and reports an error for memory it did
    /// not pin.
    pub(crate) unsafe fn mem_host_get_device_pointer(host: *mut c_void) -> CUdeviceptr = cuMemHostGetDevicePointer_v2 {
        let mut ptr = 0;
        // SAFETY: a bound context (caller), a valid out-parameter, flags 0 as the driver requires.
        unsafe { cuMemHostGetDevicePointer_v2(&mut ptr, host, 0) }.result()?;
        Ok(ptr)
    }

    /// Sets `len` bytes at `dst` to `value` in the order of `stream` (`cuMemsetD8Async`).
    ///
    /// # Safety
    /// `dst..dst + len` is memory the driver can address and nothing else accesses until the work is
    /// done; `stream` is a live stream of the bound context.
    pub(crate) unsafe fn memset_d8_async(dst: CUdeviceptr, value: u8, len: usize, stream: CUstream) -> () = cuMemsetD8Async {
        // SAFETY: as the caller promises.
        unsafe { cuMemsetD8Async(dst, value, len, stream) }.result()
    }

    /// Copies `len` bytes from `src` to `dst` in the order of `stream` (`cuMemcpyAsync`), in whichever
    /// direction the unified addresses imply.
    ///
    /// # Safety
    /// Both ranges are valid memory the driver can address, stay valid until the copy is done, and
    /// `dst` is not accessed meanwhile; `stream` is a live stream of the bound context.
    pub(crate) unsafe fn memcpy_async(dst: CUdeviceptr, src: CUdeviceptr, len: usize, stream: CUstream) -> () = cuMemcpyAsync {
        // SAFETY: as the caller promises.
        unsafe { cuMemcpyAsync(dst, src, len, stream) }.result()
    }

    /// Copies `rows` rows of `width` bytes, `src_pitch` bytes apart in the source and `dst_pitch` in
    /// the destination, in the order of `stream` (`cuMemcpy2DAsync`, unified addresses on both
    /// sides).
    ///
    /// # Safety
    /// Every row of both sides is valid memory the driver can address, stays valid until the copy is
    /// done, and the destination rows are not accessed meanwhile; the pitches are at least `width`
    /// and within the driver's limit; `stream` is a live stream of the bound context.
    pub(crate) unsafe fn memcpy_2d_async(
        dst: CUdeviceptr,
        dst_pitch: usize,
        src: CUdeviceptr,
        src_pitch: usize,
        width: usize,
        rows: usize,
        stream: CUstream,
    ) -> () = cuMemcpy2DAsync_v2 {
        let unified = CUmemorytype::CU_MEMORYTYPE_UNIFIED;
        let params = CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: unified,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: unified,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: with unified addressing the driver infers each side's kind from its address; the
        // rows are valid (caller) and `params` lives for the call.
        unsafe { cuMemcpy2DAsync_v2(&params, stream) }.result()
    }
}
