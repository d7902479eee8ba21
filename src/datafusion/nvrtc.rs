//! Compiling and launching the scan's CUDA C: NVRTC at run time, one module per (device, source),
//! cached for the life of the process.
//!
//! Without a driver, a GPU or the NVRTC library, every entry point returns an [`Error`], never
//! panics: the libraries and the entry points cudarc calls are probed first (by `crate::driver`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

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

/// Compiled modules, per (device ordinal, source).
type ModuleCache = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;

fn module(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<CudaModule>> {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    let key = (ctx.ordinal(), source.to_string());
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(m) = cache.get(&key) {
        return Ok(m.clone());
    }
    let m = crate::driver::load_module(ctx, source)?;
    cache.insert(key, m.clone());
    Ok(m)
}

pub(crate) fn function(ctx: &Arc<CudaContext>, source: &str, name: &str) -> Result<CudaFunction> {
    module(ctx, source)?
        .load_function(name)
        .map_err(Error::driver("cuModuleGetFunction"))
}

/// Threads per block of every kernel.
pub(crate) const BLOCK: u32 = 256;
/// Rows per tile of the scan kernels (`BLOCK` threads of 8 rows).
pub(crate) const TILE: u64 = 2048;

/// Launches `f` with 8-byte arguments (device pointers and `unsigned long long`).
pub(crate) fn launch(stream: &Arc<CudaStream>, f: &CudaFunction, grid: u64, block: u32, args: &[u64]) -> Result<()> {
    launch_shared(stream, f, grid, block, 0, args)
}

/// Launches `f` with 8-byte arguments and `shared` bytes of dynamic shared memory per block.
pub(crate) fn launch_shared(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    grid: u64,
    block: u32,
    shared: u32,
    args: &[u64],
) -> Result<()> {
    if grid == 0 {
        return Ok(());
    }
    let grid = u32::try_from(grid).map_err(|_| Error::InvalidArgument(format!("grid of {grid} blocks")))?;
    let mut b = stream.launch_builder(f);
    for a in args {
        b.arg(a);
    }
    let cfg = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    };
    // SAFETY: every kernel of this crate takes exactly these 8-byte parameters (pointers and
    // `unsigned long long`), in this order; the pointers are live device allocations of the
    // stream's device, kept alive by the caller until the stream is synchronised, the sizes
    // passed bound every access the kernels make, and `shared` is what the kernel indexes.
    unsafe { b.launch(cfg) }.map_err(Error::driver("cuLaunchKernel"))?;
    Ok(())
}

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
