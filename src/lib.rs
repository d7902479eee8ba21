#![doc = include_str!("../README.md")]

pub mod abi;
pub mod device;
mod error;
pub mod memory;

pub use device::{Device, Event, Stream};
pub use error::{Error, Result};
pub use memory::{DeviceBuffer, MemoryResource};
