//! Device memory: allocations, buffers, pinned host memory, shared host memory and strided views.
//!
//! Shared host memory ([`SharedMemHandle`], [`SharedMapping`]) is the CPU device's stand-in for
//! CUDA IPC: memfds another process can map. Shared device memory ([`SharedDeviceHandle`]) is GPU
//! memory another process maps through a file descriptor and keeps, whatever becomes of its creator. Mappings opened from another process (memfds here,
//! CUDA IPC handles in the IPC layer) are cached per process by one cache type (`cache.rs`).
//! Memory another process lent can carry a fence (`fence.rs`): every read of it through this crate
//! checks that the process still keeps it ([`DeviceBuffer::check_readable`]).

mod buffer;
pub(crate) mod cache;
pub(crate) mod fence;
pub mod pinned;
mod register;
mod resource;
pub(crate) mod shared_device;
pub(crate) mod shm;
mod view;

pub use buffer::DeviceBuffer;
pub(crate) use buffer::{check_range, copy, stream_for};
pub use register::{Registered, RegisteredMut, RegisteredSlice, register, register_mut};
pub(crate) use resource::Allocation;
pub use resource::{ALIGNMENT, MemoryResource};
pub use shared_device::SharedDeviceHandle;
pub use shm::{SharedMapping, SharedMemHandle};
pub use view::{Element, StridedView, c_strides};
