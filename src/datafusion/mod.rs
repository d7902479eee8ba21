//! GPU-resident tables for DataFusion 55: columns live in device memory, and the scan does the
//! projection, the pushed-down filters and the limit on the device, so only the selected rows of
//! the projected columns travel to the host.
//!
//! [`GpuTable`] is a [`TableProvider`] whose partitions are lists of
//! [`DeviceRecordBatch`]es, spread round-robin over the devices it was given (every visible GPU by
//! default, the CPU device when there is none). Its scan is a [`GpuScan`], a
//! [`DataSource`](::datafusion::datasource::source::DataSource) under `DataSourceExec`, the way
//! `MemTable` uses `MemorySourceConfig`.
//!
//! # Filters
//!
//! [`GpuTable::supports_filters_pushdown`](TableProvider::supports_filters_pushdown) answers
//! `Exact` only for predicates the device evaluates completely, and `Unsupported` for everything
//! else (DataFusion keeps those in a `FilterExec`):
//!
//! - comparisons (`= != < <= > >=`) of a column with a literal, `BETWEEN`, `IN` lists and
//!   `IS [NOT] NULL`, over integers, floats (compared as DataFusion compares them: arrow-rs's
//!   total order, so `NaN` equals itself and sorts last, after `-0.0` becomes `+0.0`; `IN` lists
//!   of floats stay with DataFusion, whose `IN` keeps the two zeros apart), `Decimal128`, dates,
//!   timestamps and booleans, and a bare boolean column;
//! - `=`, `!=`, `IN` lists and prefix matches (`LIKE 'abc%'`, `starts_with`) on `Utf8`,
//!   `LargeUtf8` and `Utf8View` columns;
//! - `AND`, `OR` and `NOT` of those.
//!
//! A literal of another type than its column is accepted only when it converts to the column's
//! type and back without change. Null semantics are SQL's: a row is kept only where the predicate
//! is true.
//!
//! On a CUDA device the predicate becomes a CUDA C kernel (generated from the expression tree,
//! compiled once per context with NVRTC and cached), followed by a count, a prefix sum and a
//! compaction of the projected columns on the device (see `device_filter.rs`). On the CPU device (and on
//! host-accessible memory) the same predicate is evaluated with arrow-rs compute kernels on a host
//! copy of the columns it needs.
//!
//! # What reaches DataFusion
//!
//! Only host [`RecordBatch`]es, made by an explicit device-to-host copy
//! ([`crate::transfer::dtoh`]): DataFusion's metrics read every batch through `to_data()`, so no
//! device memory may ever be wrapped in an arrow buffer that flows through a plan.
//!
//! # Concurrency
//!
//! Each device has a small pool of streams (four by default) guarded by a semaphore: partitions on
//! one device share it whatever DataFusion's `target_partitions` is, and partitions on different
//! devices run concurrently.

mod device_filter;
mod error;
mod lanes;
mod nvrtc;
mod options;
mod predicate;
mod predicate_codegen;
mod source;
mod stage;
mod staging;
mod stats;
mod table;

pub use nvrtc::gpu_kernels_available;
pub use options::{DEFAULT_BATCH_ROWS, LoadOptions, Progress, ProgressFn, default_devices};
pub use predicate::supports_filter;
pub use source::GpuScan;
pub use stage::{DeviceStageExec, DeviceStageRule, with_device_stages};
pub use table::GpuTable;
