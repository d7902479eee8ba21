//! The scan's kernels: whether they can run here, their block and tile sizes, and the CUDA stream
//! they launch on. Compiling (NVRTC at run time, one module per device and source, cached for the
//! life of the process) and launching are `crate::driver`'s.
//!
//! Without a driver, a GPU or the NVRTC library, every entry point returns an [`Error`], never
//! panics: the libraries and the entry points cudarc calls are probed first (by `crate::driver`).

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::device::{Device, Stream};
use crate::error::{Error, Result};

/// Checks once that the driver, a GPU and NVRTC are usable (`crate::driver` probes the libraries and
/// every entry point cudarc calls to compile, load and launch); [`Error::Unsupported`] otherwise.
pub(crate) fn available() -> Result<()> {
    crate::driver::nvrtc_available()
}

/// Whether GPU predicate kernels can run here: a CUDA driver, a GPU and the NVRTC library.
pub fn gpu_kernels_available() -> bool {
    available().is_ok()
}

pub(crate) use crate::driver::{function, launch, launch_shared};

/// Threads per block of every kernel.
pub(crate) const BLOCK: u32 = 256;
/// Rows per tile of the scan kernels (`BLOCK` threads of 8 rows).
pub(crate) const TILE: u64 = 2048;

/// `stream` as a stream of `device` (a CUDA device), and its cudarc stream to launch kernels on;
/// `what` names the work in the error for another device.
pub(crate) fn cuda_stream(stream: &Stream, device: Device, what: &str) -> Result<(Stream, Arc<CudaStream>)> {
    let stream = crate::memory::stream_for(stream, device, device)?;
    let cuda = stream
        .cuda()
        .cloned()
        .ok_or_else(|| Error::Unsupported(format!("{what} needs a CUDA stream")))?;
    Ok((stream, cuda))
}
