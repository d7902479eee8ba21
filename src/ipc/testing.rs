//! Hooks for the crate's own tests, benchmarks and tools: not part of the API, and hidden from its
//! documentation.

use crate::ipc::handle::OpenedHandle;
use crate::memory::SharedMapping;

/// The number of peers' CUDA allocations mapped in this process now.
pub fn open_cuda_mappings() -> usize {
    OpenedHandle::open_count()
}

/// The number of peers' shared host regions mapped in this process now.
pub fn open_shared_mappings() -> usize {
    SharedMapping::open_count()
}

/// Whether a download of `array` skips arrow-rs's validation (its bytes are trusted).
pub fn is_trusted(array: &crate::array::DeviceArrayData) -> bool {
    array.is_trusted()
}
