#![doc = include_str!("../README.md")]

pub mod abi;
pub mod array;
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
pub mod transfer;

pub use array::{DeviceArrayData, DeviceRecordBatch};
pub use device::{Device, Event, Stream};
pub use error::{Error, Result};
pub use memory::{DeviceBuffer, MemoryResource};
