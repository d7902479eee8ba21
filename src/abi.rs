//! `#[repr(C)]` types of the Arrow C Device Data Interface (apache/arrow `cpp/src/arrow/c/abi.h`).
//!
//! No CUDA here: this module is the spec's layout and nothing else. The host structs `ArrowArray`
//! and `ArrowSchema` are arrow-rs's own.

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

pub use arrow_data::ffi::FFI_ArrowArray;
pub use arrow_schema::ffi::FFI_ArrowSchema;

/// `struct ArrowDeviceArray`: an [`FFI_ArrowArray`] whose buffers live on a device (128 bytes).
///
/// Named as in apache/arrow-rs PR #10754, so that the crate can move onto upstream's type later.
/// Dropping a struct that has not been released calls its release callback.
#[repr(C)]
#[derive(Debug)]
#[allow(non_camel_case_types)]
pub struct FFI_ArrowDeviceArray {
    /// The array; only its buffer pointers are device pointers.
    pub array: FFI_ArrowArray,
    /// The device id (-1 or 0 for the CPU, the ordinal for CUDA).
    pub device_id: i64,
    /// Where the buffers live.
    pub device_type: DeviceType,
    /// For CUDA, a pointer to a `CUevent` that completes when the buffers are ready, or null.
    pub sync_event: *mut std::ffi::c_void,
    /// Zero when produced; any content is accepted when consumed.
    pub reserved: [i64; 3],
}

// SAFETY: the struct is a bundle of pointers whose owner (the release callback's private data) the
// spec requires to be usable from any thread.
unsafe impl Send for FFI_ArrowDeviceArray {}
// SAFETY: shared references only read the fields.
unsafe impl Sync for FFI_ArrowDeviceArray {}

impl FFI_ArrowDeviceArray {
    /// A released (empty) struct, for a consumer to hand to a producer to fill.
    pub fn empty() -> Self {
        FFI_ArrowDeviceArray {
            array: FFI_ArrowArray::empty(),
            device_id: -1,
            device_type: DeviceType::CPU,
            sync_event: std::ptr::null_mut(),
            reserved: [0; 3],
        }
    }

    /// Whether the struct has been released (or was never filled).
    pub fn is_released(&self) -> bool {
        self.array.release.is_none()
    }

    /// Takes the struct out of `ptr`, leaving a released one behind (the spec's move).
    ///
    /// # Safety
    /// `ptr` must point to a valid, properly aligned struct.
    pub unsafe fn from_raw(ptr: *mut FFI_ArrowDeviceArray) -> Self {
        // SAFETY: valid per the caller; the source is left released so it is not released twice.
        unsafe { std::ptr::replace(ptr, FFI_ArrowDeviceArray::empty()) }
    }
}

/// `struct ArrowDeviceArrayStream`: a stream of device arrays of one device type (48 bytes).
#[repr(C)]
#[derive(Debug)]
#[allow(non_camel_case_types)]
pub struct FFI_ArrowDeviceArrayStream {
    /// The device type of every array in the stream.
    pub device_type: DeviceType,
    /// Writes the stream's schema into `out`; returns 0 or an errno value.
    pub get_schema: Option<unsafe extern "C" fn(stream: *mut Self, out: *mut FFI_ArrowSchema) -> i32>,
    /// Writes the next array into `out` (released at the end of the stream); returns 0 or an errno.
    pub get_next: Option<unsafe extern "C" fn(stream: *mut Self, out: *mut FFI_ArrowDeviceArray) -> i32>,
    /// The message of the last error, valid until the next call, or null.
    pub get_last_error: Option<unsafe extern "C" fn(stream: *mut Self) -> *const std::ffi::c_char>,
    /// Releases the stream.
    pub release: Option<unsafe extern "C" fn(stream: *mut Self)>,
    /// The producer's data.
    pub private_data: *mut std::ffi::c_void,
}

// SAFETY: the spec lets a stream move between threads (not be used from two at once).
unsafe impl Send for FFI_ArrowDeviceArrayStream {}

impl FFI_ArrowDeviceArrayStream {
    /// A released (empty) stream.
    pub fn empty() -> Self {
        FFI_ArrowDeviceArrayStream {
            device_type: DeviceType::CPU,
            get_schema: None,
            get_next: None,
            get_last_error: None,
            release: None,
            private_data: std::ptr::null_mut(),
        }
    }

    /// Whether the stream has been released.
    pub fn is_released(&self) -> bool {
        self.release.is_none()
    }

    /// Takes the stream out of `ptr`, leaving a released one behind.
    ///
    /// # Safety
    /// `ptr` must point to a valid, properly aligned struct.
    pub unsafe fn from_raw(ptr: *mut FFI_ArrowDeviceArrayStream) -> Self {
        // SAFETY: valid per the caller; the source is left released.
        unsafe { std::ptr::replace(ptr, FFI_ArrowDeviceArrayStream::empty()) }
    }
}

impl Drop for FFI_ArrowDeviceArrayStream {
    fn drop(&mut self) {
        if let Some(release) = self.release {
            // SAFETY: an unreleased stream's release callback is valid to call once.
            unsafe { release(self) }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of, size_of};

    use super::*;

    #[test]
    fn layouts_match_the_spec() {
        assert_eq!(size_of::<FFI_ArrowArray>(), 80);
        assert_eq!(size_of::<FFI_ArrowDeviceArray>(), 128);
        assert_eq!(align_of::<FFI_ArrowDeviceArray>(), 8);
        assert_eq!(offset_of!(FFI_ArrowDeviceArray, array), 0);
        assert_eq!(offset_of!(FFI_ArrowDeviceArray, device_id), 80);
        assert_eq!(offset_of!(FFI_ArrowDeviceArray, device_type), 88);
        assert_eq!(offset_of!(FFI_ArrowDeviceArray, sync_event), 96);
        assert_eq!(offset_of!(FFI_ArrowDeviceArray, reserved), 104);
        assert_eq!(size_of::<FFI_ArrowDeviceArrayStream>(), 48);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, device_type), 0);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, get_schema), 8);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, get_next), 16);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, get_last_error), 24);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, release), 32);
        assert_eq!(offset_of!(FFI_ArrowDeviceArrayStream, private_data), 40);
        assert_eq!(size_of::<DeviceType>(), 4);
    }

    #[test]
    fn device_type_codes_match_the_spec() {
        let codes = [
            (DeviceType::CPU, 1),
            (DeviceType::CUDA, 2),
            (DeviceType::CUDA_HOST, 3),
            (DeviceType::OPENCL, 4),
            (DeviceType::VULKAN, 7),
            (DeviceType::METAL, 8),
            (DeviceType::VPI, 9),
            (DeviceType::ROCM, 10),
            (DeviceType::ROCM_HOST, 11),
            (DeviceType::EXT_DEV, 12),
            (DeviceType::CUDA_MANAGED, 13),
            (DeviceType::ONEAPI, 14),
            (DeviceType::WEBGPU, 15),
            (DeviceType::HEXAGON, 16),
        ];
        for (t, code) in codes {
            assert_eq!(t.0, code);
            assert!(!t.to_string().starts_with("unknown"));
        }
        assert_eq!(DeviceType(99).to_string(), "unknown (99)");
    }

    #[test]
    fn empty_structs_are_released() {
        assert!(FFI_ArrowDeviceArray::empty().is_released());
        assert!(FFI_ArrowDeviceArrayStream::empty().is_released());
    }
}
