//! Where the crate calls CUDA: every driver entry point, loaded and checked in one place.
//!
//! The layering follows cudarc's own (`sys` raw bindings, `result` thin `Result` wrappers, safe
//! RAII types): this module is the crate's `result` layer, between [`abi`](crate::abi) and
//! [`device`](crate::device). Above it, code uses these wrappers or cudarc's safe types
//! (`CudaContext`, `CudaStream`, `CudaEvent`, `CudaModule`), never the raw bindings: **no file outside
//! `src/driver/` names `cudarc::driver::sys`, `cudarc::driver::result`, `cudarc::nvrtc::sys` or
//! `cudarc::nvrtc::result`** (a unit test here and the CI check enforce it). The handle types those
//! layers pass around (`CUstream`, `CUevent`, ...) are re-exported from here.
//!
//! # Why one place
//!
//! cudarc loads each entry point on first call and panics when the driver lacks it, so a symbol
//! used anywhere but missing from the load-time check turns an old driver into a panic. Here the
//! check covers every call by construction:
//!
//! - each wrapper is declared through `driver_calls!` (in `calls.rs`), which names the one entry
//!   point the wrapper calls, brings only that binding into scope, names it in the wrapper's errors
//!   ([`Error::Driver`](crate::Error::Driver), without the `_v2` suffix: `cuMemAlloc`) and records
//!   it in its file's `SYMBOLS`;
//! - `symbols.rs` lists, with comments, the entry points cudarc's safe types call for the crate,
//!   and gathers every group into the list the probe checks;
//! - a unit test reads every source file under `src/` and fails for any `cu[A-Z]…` name that is in
//!   no checked list, and another for raw bindings named outside this module.
//!
//! # Files
//!
//! | file | holds |
//! |---|---|
//! | `probe.rs` | [`available`]: the driver library, every checked symbol, `cuInit`, at least one GPU |
//! | `nvrtc.rs` | [`nvrtc_available`]: NVRTC and the module/launch entry points; [`function`]: a kernel of CUDA C, compiled once per device; [`launch`] |
//! | `graph.rs` | [`KernelGraph`]: a kernel launched through a one-node graph, for launches on a latency path |
//! | `symbols.rs` | the checked lists, cudarc's safe calls, the source-scanning tests |
//! | `device.rs` | initialisation, device count and handles, UUIDs, driver version, default memory pools |
//! | `memory.rs` | allocation and free of every kind, pinning, memset, 1D and 2D copies |
//! | `batch.rs` | batched copies, where the driver has them (checked on their own, not by the probe) |
//! | `pointer.rs` | address ranges, whether memory is pinned |
//! | `event.rs` | events cudarc does not own, stream waits |
//! | `ipc.rs` | CUDA IPC memory and event handles |
//! | `vmm.rs` | shareable device memory (`cuMemCreate`, POSIX descriptors), where the driver has it (checked on its own) |
//!
//! # Adding a call
//!
//! Write a wrapper inside the `driver_calls!` block of the file of its area: an `unsafe fn` whose
//! `# Safety` section says what the caller guarantees (every wrapper needs at least
//! [`available`] to have returned `Ok`), `= cuXxx` after its signature, and a body that calls
//! `cuXxx` and returns `Result<T, DriverError>`. Re-export it below. For a cudarc safe method the
//! crate starts to use, add the entry points it calls to the cudarc list in `symbols.rs`.

#[macro_use]
mod calls;
mod batch;
mod device;
mod event;
mod graph;
mod ipc;
mod memory;
mod nvrtc;
mod pointer;
mod probe;
mod symbols;
mod vmm;

pub(crate) use batch::{memcpy_batch_async, memcpy_batch_available};
pub(crate) use cudarc::driver::sys::{CUdevice_attribute, CUevent, CUresult, CUstream};
pub(crate) use device::{
    default_mem_pool, device_count, device_get, device_uuid, driver_version, mem_pool_idle_bytes,
    mem_pool_set_release_threshold,
};
pub(crate) use event::{event_create_interprocess, event_destroy, event_record, event_synchronize, stream_wait_event};
pub(crate) use graph::KernelGraph;
pub(crate) use ipc::{
    IPC_HANDLE_BYTES, ipc_close_mem_handle, ipc_get_event_handle, ipc_get_mem_handle, ipc_open_event_handle,
    ipc_open_mem_handle,
};
pub(crate) use memory::{
    mem_alloc, mem_alloc_async, mem_alloc_managed, mem_free, mem_free_async, mem_free_host,
    mem_host_alloc_write_combined, mem_host_get_device_pointer, mem_host_register, mem_host_unregister,
    memcpy_2d_async, memcpy_async, memset_d8_async,
};
pub(crate) use nvrtc::function;
#[cfg(feature = "datafusion")]
pub(crate) use nvrtc::launch;
#[cfg(feature = "datafusion")]
pub(crate) use nvrtc::launch_shared;
#[cfg(feature = "datafusion")]
pub(crate) use nvrtc::nvrtc_available;
pub(crate) use pointer::{is_pinned_host, mem_get_address_range};
pub(crate) use probe::available;
pub(crate) use vmm::{
    ShareableMemory, shareable_alloc, shareable_available, shareable_export, shareable_free, shareable_import,
    shareable_size,
};
