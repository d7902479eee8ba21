//! Device memory: allocations, buffers, pinned host memory and strided views.

mod buffer;
pub mod pinned;
pub mod register;
mod resource;
pub mod view;

pub use buffer::DeviceBuffer;
pub(crate) use buffer::{check_range, copy, stream_for};
pub use register::{Registered, RegisteredMut, register, register_mut};
pub(crate) use resource::Allocation;
pub use resource::{ALIGNMENT, MemoryResource};
pub use view::{Element, StridedView};
