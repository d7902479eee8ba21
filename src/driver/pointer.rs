//! What the driver knows about an address.

use std::ffi::c_void;

use cudarc::driver::sys::{CUdeviceptr, CUmemorytype, CUpointer_attribute};

driver_calls! {
    /// The base address and size of the allocation (or mapping) that contains `ptr`
    /// (`cuMemGetAddressRange`).
    ///
    /// # Safety
    /// A context is bound to the calling thread; the driver reports an error for an address it does
    /// not know.
    pub(crate) unsafe fn mem_get_address_range(ptr: CUdeviceptr) -> (CUdeviceptr, usize) = cuMemGetAddressRange_v2 {
        let (mut base, mut size) = (0, 0);
        // SAFETY: a bound context (caller); both outputs are valid.
        unsafe { cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
        Ok((base, size))
    }

    /// Whether `ptr` is page-locked host memory the driver knows (`cuPointerGetAttributes` for
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`), and so can be the source of an asynchronous DMA.
    ///
    /// Unlike the singular `cuPointerGetAttribute`, this succeeds for memory the driver does not know
    /// (pageable memory), leaving the type 0, so asking raises no API error.
    ///
    /// # Safety
    /// The driver is loaded and initialised (a context exists).
    pub(crate) unsafe fn is_pinned_host(ptr: CUdeviceptr) -> bool = cuPointerGetAttributes {
        let mut kind = 0u32;
        let mut attribute = CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
        let mut out = (&mut kind as *mut u32).cast::<c_void>();
        // SAFETY: a query about an address with one 4-byte `CUmemorytype` out-parameter.
        unsafe { cuPointerGetAttributes(1, &mut attribute, &mut out, ptr) }.result()?;
        Ok(kind == CUmemorytype::CU_MEMORYTYPE_HOST as u32)
    }
}
