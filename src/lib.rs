//! Apache Arrow data on NVIDIA GPUs, for Rust.
//!
//! arrow-cuda moves arrow-rs [`RecordBatch`](arrow_array::RecordBatch)es to GPU memory and back at
//! the speed of the PCIe link, hands device arrays to and from any implementation of the Arrow C
//! Device Data Interface (cudf, Arrow C++, nanoarrow, pyarrow), sends record batches between
//! processes as Arrow IPC messages whose bodies never leave the GPU, keeps DataFusion tables on the
//! GPU, and converts polars-arrow data both ways.
//!
//! The CPU is a device too: every layer runs the same code on [`Device::Cpu`] (with `memcpy` for
//! copies), so the same program works on a machine without a GPU. The CUDA driver is loaded at run
//! time: the crate builds without a CUDA toolkit, and without a driver or GPU every CUDA entry point
//! returns an [`Error`], never a panic.
//!
//! # Quick start
//!
//! A batch to the first GPU (or the CPU device when there is none), through the C Device Data
//! Interface and back to the host:
//!
//! ```rust
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int32Array, RecordBatch, StringArray};
//! use arrow_cuda::{Device, DeviceRecordBatch, Stream};
//!
//! # fn main() -> arrow_cuda::Result<()> {
//! let batch = RecordBatch::try_from_iter([
//!     ("id", Arc::new(Int32Array::from(vec![1, 2, 3])) as ArrayRef),
//!     ("name", Arc::new(StringArray::from(vec![Some("a"), None, Some("c")])) as ArrayRef),
//! ])?;
//!
//! // The first GPU if there is one, else the CPU device: the same code runs on both.
//! let device = if arrow_cuda::device::cuda_available() { Device::Cuda(0) } else { Device::Cpu };
//! let on_device = DeviceRecordBatch::from_record_batch(&batch, device)?;
//! assert_eq!(on_device.num_rows(), 3);
//!
//! // Hand it to any consumer of the C Device Data Interface (cudf, Arrow C++, nanoarrow, pyarrow), or
//! // take it back: zero-copy, released exactly once when the last view drops.
//! let stream = Stream::shared(device)?;
//! let (array, schema) = arrow_cuda::ffi::export_batch(&on_device, &stream)?;
//! // SAFETY: the struct was just made by our own exporter.
//! let imported = unsafe { arrow_cuda::ffi::import_batch(array, &schema, &stream)? };
//!
//! // Back to the host, validated, bit for bit.
//! assert_eq!(imported.to_record_batch()?, batch);
//! # Ok(())
//! # }
//! ```
//!
//! With the `datafusion` feature, a table whose columns live on the device, queried with SQL (the
//! scan filters on the device and copies only the selected rows to the host):
//!
//! ```rust
//! # #[cfg(feature = "datafusion")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int64Array, RecordBatch};
//! use arrow_cuda::datafusion::{GpuTable, LoadOptions};
//! use datafusion::prelude::SessionContext;
//!
//! let batch = RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from_iter_values(0..1000)) as ArrayRef)])?;
//! // The first GPU, or the CPU device when there is none.
//! let table = GpuTable::from_batches(batch.schema(), vec![batch], &LoadOptions::new())?;
//!
//! let ctx = SessionContext::new();
//! ctx.register_table("t", Arc::new(table))?;
//! let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
//! let out = runtime.block_on(async { ctx.sql("select count(*) from t where x < 10").await?.collect().await })?;
//! assert_eq!(out[0].column(0).as_any().downcast_ref::<Int64Array>().unwrap().value(0), 10);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "datafusion"))]
//! # fn main() {}
//! ```
//!
//! # Features
//!
//! | cargo feature | what it adds |
//! |---|---|
//! | (none) | devices, memory, device arrays, transfers, the C Device Data Interface, IPC |
//! | `datafusion` | [`datafusion`]: GPU-resident DataFusion tables, filters pushed to the device, device stages for aggregates |
//! | `polars` | [`polars`]: polars-arrow arrays and batches to and from the device |
//! | `ballista` | `ballista`: GPU tables and device stages in Apache DataFusion Ballista (codecs, the executors' table cache, session setup) |
//!
//! The `arrow-cuda` command-line tool (`info`, `bench`, `query`, `send`, `recv`) is a crate of its
//! own, `arrow-cuda-cli`.
//!
//! # Layers
//!
//! Lowest first; each uses only the layers listed before it.
//!
//! - [`abi`]: the `#[repr(C)]` structs and device-type codes of the C Device Data Interface; no CUDA.
//! - `driver` (internal): every raw CUDA driver call, and the check, when the driver is loaded, that
//!   it has every entry point the crate calls.
//! - [`device`]: [`Device`] (CPU, CUDA, CUDA host and managed memory), contexts, [`Stream`] and
//!   [`Event`].
//! - [`memory`]: [`MemoryResource`]s, [`DeviceBuffer`], the pinned pool, shared host memory and strided
//!   views.
//! - [`array`](mod@array): [`DeviceArrayData`] (arrow-rs `ArrayData`'s layout over device buffers) and
//!   [`DeviceRecordBatch`].
//! - [`transfer`]: whole-batch copies between host and device, packed into few DMAs.
//! - [`ffi`]: export and import through the C Device Data Interface, device array streams.
//! - [`ipc`]: Arrow IPC messages in device memory, CUDA IPC handles, a process-to-process channel.
//! - [`datafusion`] and [`polars`] (features): on top of all of them.
//! - `ballista` (feature): on top of [`datafusion`], its tables and stages in Ballista's plans.
//!
//! One error type serves every layer: [`Error`], with [`Result`]; every layer may time its steps
//! for a [`trace::Trace`].
//!
//! # Safety model
//!
//! **Device memory never reaches an arrow-rs [`Buffer`](arrow_buffer::Buffer) by accident.** arrow-rs
//! reads buffers on the host wherever it likes (validation, `to_data()`, its own FFI import,
//! DataFusion's metrics), so a device pointer inside an arrow `Buffer` is a crash or a silent wrong
//! read. In this crate:
//!
//! - device data lives in [`DeviceBuffer`]s and [`DeviceArrayData`], which CPU code never reads;
//! - [`DeviceBuffer::to_arrow_buffer`] refuses device memory, and the one conversion that wraps it
//!   anyway, [`DeviceArrayData::to_array_data_unchecked`], is `unsafe` and meant for APIs that only
//!   move pointers;
//! - data reaches the host as a [`RecordBatch`](arrow_array::RecordBatch) only through an explicit
//!   copy ([`transfer::dtoh`], [`DeviceRecordBatch::to_record_batch`]), which validates every array
//!   on the host unless its bytes were written by this crate from arrays arrow-rs had already
//!   validated and cannot have changed since;
//! - what can be checked without reading the device is checked before anything is built from an
//!   imported or received array (counts, lengths, fixed buffer sizes, that each buffer lies inside
//!   its memory); what depends on the data (offsets, dictionary keys) is validated when the array is
//!   copied to the host. Importing a foreign C struct is `unsafe`: only its producer can vouch for
//!   its pointers.
//!
//! **Synchronisation travels with the data**: every [`DeviceRecordBatch`] carries the [`Event`]
//! that marks its contents ready, exports point `sync_event` at it and imports make the consumer's
//! stream wait on it; nothing synchronises a whole device. Nothing panics across `extern "C"` or in
//! `Drop`, and every `unsafe` block in the crate says why it is sound.
//!
//! # Where to go next
//!
//! - The examples in the repository, from `cargo run --example 01_round_trip` to
//!   `06_datafusion_sql` (a TPC-H query on a GPU table); `03_ipc_producer` and `04_ipc_consumer`
//!   lend batches between two processes.
//! - [`transfer`] for pinned memory, asynchronous copies and the resources they allocate from;
//!   [`ffi`] for streams of device arrays; [`ipc`] for the channel's options and its guarantees.
//! - `docs/architecture.md` in the repository: how a batch is planned, packed and copied, and how
//!   the IPC channel works; `docs/benchmarks.md`: measured figures, each with its device, date and
//!   command.

pub mod abi;
pub mod array;
#[cfg(feature = "ballista")]
pub mod ballista;
#[cfg(feature = "datafusion")]
pub mod datafusion;
pub mod device;
mod driver;
mod error;
pub mod ffi;
pub mod ipc;
pub mod memory;
#[cfg(feature = "polars")]
pub mod polars;
pub mod trace;
pub mod transfer;

pub use array::{DeviceArrayData, DeviceRecordBatch};
pub use device::{Device, Event, Stream};
pub use error::{Error, Result};
pub use memory::{DeviceBuffer, MemoryResource};
