//! The Arrow C Device Data Interface: export and import of device arrays, batches and streams.
//!
//! Exports follow the spec's move semantics: the exported struct owns references to the memory and
//! its `sync_event`, released exactly once by its release callback. Imports are zero-copy and keep
//! the producer's struct alive until the last imported buffer drops. A malformed struct is an error,
//! and no panic leaves a callback that C calls.

mod export;
mod guard;
mod import;
mod schema;
mod schema_export;
mod stream;

pub use export::{export_array, export_batch, export_field};
pub use import::{import_array, import_batch};
pub use schema::{import_field, import_schema};
pub use stream::{DeviceArrayStreamReader, export_stream};
