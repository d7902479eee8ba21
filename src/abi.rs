//! `#[repr(C)]` types of the Arrow C Device Data Interface (apache/arrow `cpp/src/arrow/c/abi.h`).
//!
//! No CUDA here: this module is the spec's layout and nothing else.

use std::fmt;

/// `ArrowDeviceType`: where an array's buffers live.
///
/// An `i32` newtype rather than an enum: values this crate does not know are data, not undefined
/// behaviour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct DeviceType(pub i32);

impl DeviceType {
    /// Host memory.
    pub const CPU: DeviceType = DeviceType(1);
    /// CUDA device memory.
    pub const CUDA: DeviceType = DeviceType(2);
    /// Page-locked host memory registered with CUDA.
    pub const CUDA_HOST: DeviceType = DeviceType(3);
    /// OpenCL.
    pub const OPENCL: DeviceType = DeviceType(4);
    /// Vulkan buffers.
    pub const VULKAN: DeviceType = DeviceType(7);
    /// Apple Metal.
    pub const METAL: DeviceType = DeviceType(8);
    /// Verilator.
    pub const VPI: DeviceType = DeviceType(9);
    /// AMD ROCm device memory.
    pub const ROCM: DeviceType = DeviceType(10);
    /// AMD ROCm pinned host memory.
    pub const ROCM_HOST: DeviceType = DeviceType(11);
    /// Reserved for extension devices.
    pub const EXT_DEV: DeviceType = DeviceType(12);
    /// CUDA managed (unified) memory.
    pub const CUDA_MANAGED: DeviceType = DeviceType(13);
    /// Intel oneAPI unified shared memory.
    pub const ONEAPI: DeviceType = DeviceType(14);
    /// WebGPU.
    pub const WEBGPU: DeviceType = DeviceType(15);
    /// Qualcomm Hexagon DSP.
    pub const HEXAGON: DeviceType = DeviceType(16);
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match *self {
            DeviceType::CPU => "CPU",
            DeviceType::CUDA => "CUDA",
            DeviceType::CUDA_HOST => "CUDA_HOST",
            DeviceType::OPENCL => "OPENCL",
            DeviceType::VULKAN => "VULKAN",
            DeviceType::METAL => "METAL",
            DeviceType::VPI => "VPI",
            DeviceType::ROCM => "ROCM",
            DeviceType::ROCM_HOST => "ROCM_HOST",
            DeviceType::EXT_DEV => "EXT_DEV",
            DeviceType::CUDA_MANAGED => "CUDA_MANAGED",
            DeviceType::ONEAPI => "ONEAPI",
            DeviceType::WEBGPU => "WEBGPU",
            DeviceType::HEXAGON => "HEXAGON",
            DeviceType(other) => return write!(f, "unknown ({other})"),
        };
        f.write_str(name)
    }
}
