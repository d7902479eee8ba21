//! Device memory: allocations, buffers, pinned host memory and strided views.

mod buffer;
pub mod pinned;
mod resource;

pub use buffer::DeviceBuffer;
pub(crate) use buffer::{check_range, copy, stream_for};
pub use resource::{ALIGNMENT, MemoryResource};
pub(crate) use resource::Allocation;
