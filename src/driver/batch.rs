//! Batched copies (`cuMemcpyBatchAsync`, CUDA 12.8): many small copies issued in one call. Optional:
//! a driver without it still serves everything else, and callers issue one copy each instead.

use std::sync::OnceLock;

use cudarc::driver::sys::{
    CUdeviceptr, CUmemLocation, CUmemLocationType, CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUstream,
};

driver_calls! {
    /// Copies `sizes[i]` bytes from `srcs[i]` to `dsts[i]` for every `i`, in the order of `stream`
    /// (`cuMemcpyBatchAsync`): the sources are read after the work issued on `stream` before.
    ///
    /// # Safety
    /// [`memcpy_batch_available`] returned true; the three slices have one equal, non-zero length;
    /// every range is valid memory the driver can address, stays valid until the copies are done,
    /// and no destination is accessed meanwhile; `stream` is a live stream (not the legacy default
    /// stream) of the bound context.
    pub(crate) unsafe fn memcpy_batch_async(
        dsts: &[CUdeviceptr],
        srcs: &[CUdeviceptr],
        sizes: &[usize],
        stream: CUstream,
    ) -> () = cuMemcpyBatchAsync {
        // Location hints only matter for managed memory; the copies here read device or pinned memory.
        let nowhere = CUmemLocation {
            type_: CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        };
        let mut attrs = CUmemcpyAttributes {
            srcAccessOrder: CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: nowhere,
            dstLocHint: nowhere,
            flags: 0,
        };
        // One attribute set, for every copy from index 0 on.
        let mut first = 0usize;
        let mut failed = usize::MAX;
        // SAFETY: the slices have `count` elements each (caller), and the driver only reads them
        // (the header's pointers are not const); the attribute set and its index live for the
        // call; the ranges and stream are valid (caller).
        unsafe {
            cuMemcpyBatchAsync(
                dsts.as_ptr().cast_mut(),
                srcs.as_ptr().cast_mut(),
                sizes.as_ptr().cast_mut(),
                dsts.len(),
                &mut attrs,
                &mut first,
                1,
                &mut failed,
                stream,
            )
        }
        .result()
    }
}

/// Whether the driver has [`memcpy_batch_async`]'s entry point (CUDA 12.8 and later); checked once.
pub(crate) fn memcpy_batch_available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: `available` returning Ok means the driver library is present.
        super::available().is_ok() && SYMBOLS.iter().all(|s| unsafe { super::probe::has_symbol(s) })
    })
}
