#![doc = include_str!("../README.md")]

pub mod abi;
pub mod array;
pub mod device;
pub mod ffi;
pub mod ipc;
mod error;
pub mod memory;
pub mod transfer;
#[cfg(feature = "polars")]
pub mod polars;
#[cfg(feature = "datafusion")]
pub mod datafusion;

pub use array::{DeviceArrayData, DeviceRecordBatch};
pub use device::{Device, Event, Stream};
pub use error::{Error, Result};
pub use memory::{DeviceBuffer, MemoryResource};
