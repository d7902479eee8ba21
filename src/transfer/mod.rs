//! Copies of whole record batches between the host and a device.
//!
//! Host to device ([`htod`], [`htod_async`], [`htod_array`]): plan every buffer (64-byte aligned,
//! only the bytes a slice views), pack the batch into pinned staging (a small batch on the calling
//! thread, a larger one on other threads too, in parts packed while the rest is planned and sent as
//! they are packed, then in chunks while the previous chunk's DMA runs), and issue as few DMAs as
//! that allows into one device allocation; the device arrays are views of it.
//!
//! Device to host ([`dtoh`], [`dtoh_async`], [`dtoh_array`]): the buffers of each allocation are
//! copied in one DMA per contiguous span into one pinned block, whose ranges become the arrow
//! buffers without another copy. The block goes back to the pinned pool when the last arrow buffer
//! drops.
//!
//! On the CPU device the same plans run with `memcpy`.
//!
//! The code: `upload` (the host-to-device entry points and their DMAs), `plan` (where each buffer
//! of an upload goes), `pack` (producing its bytes in staging, on several threads), `crew` (the
//! threads that pack parts of uploads, kept awake between them), `download` (the device-to-host
//! entry points and [`PendingBatch`]), `gather` (the spans of a download and their DMAs), `layout`
//! (an array's buffer ranges in one allocation, and the arrays built from them on either side),
//! `offsets` (scattered offsets read from a device at once), `packed` (a batch packed on one thread
//! and sent by another, for staging), `deferred` (memory kept until the copies that use it are
//! done), `times` (where staging's time goes, when asked).

mod crew;
mod deferred;
mod download;
mod gather;
mod layout;
pub(crate) mod offsets;
mod pack;
#[cfg(feature = "datafusion")]
mod packed;
mod plan;
pub(crate) mod times;
mod upload;

pub use download::{PendingBatch, dtoh, dtoh_array, dtoh_async};
#[cfg(feature = "datafusion")]
pub(crate) use packed::Packed;
#[cfg(feature = "datafusion")]
pub(crate) use upload::htod_async_timed;
pub use upload::{htod, htod_array, htod_async};
