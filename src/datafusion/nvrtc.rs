//! Compiling and launching the scan's CUDA C: NVRTC at run time, one module per (device, source),
//! cached for the life of the process.
//!
//! Without a driver, a GPU or the NVRTC library, every entry point returns an [`Error`], never
//! panics: the libraries and the entry points cudarc calls are probed first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use crate::error::{Error, Result};

/// NVRTC entry points cudarc calls to compile a program.
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcDestroyProgram",
];

/// Driver entry points used to load and launch kernels.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

fn probe() -> Result<()> {
    crate::device::driver()?;
    // SAFETY: the driver library is present (checked by `driver`), so `culib` returns it.
    let driver = unsafe { cudarc::driver::sys::culib() };
    for &s in DRIVER_SYMBOLS {
        // SAFETY: the symbol is only looked up, never called through this type.
        if unsafe { driver.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err() {
            return Err(Error::DriverTooOld { symbol: s });
        }
    }
    // SAFETY: trying to load the NVRTC library runs its initialisers, as any CUDA program does.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Unsupported(format!(
            "no NVRTC library: none of {} could be loaded",
            cudarc::get_lib_name_candidates("nvrtc").join(", ")
        )));
    }
    // SAFETY: the library is present (checked above), so `culib` returns it without panicking.
    let nvrtc = unsafe { cudarc::nvrtc::sys::culib() };
    for &s in NVRTC_SYMBOLS {
        // SAFETY: the symbol is only looked up, never called through this type.
        if unsafe { nvrtc.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err() {
            return Err(Error::Unsupported(format!("the NVRTC library has no `{s}`")));
        }
    }
    Ok(())
}

/// Checks once that the driver, a GPU and NVRTC are usable.
pub(crate) fn available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| probe().map_err(|e| e.to_string()))
        .clone()
        .map_err(Error::Unsupported)
}

/// Whether GPU predicate kernels can run here: a CUDA driver, a GPU and the NVRTC library.
pub fn gpu_kernels_available() -> bool {
    available().is_ok()
}

/// Compiled modules, per (device ordinal, source).
type ModuleCache = Mutex<HashMap<(usize, String), Arc<CudaModule>>>;

fn module(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<CudaModule>> {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    static ARCHS: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    available()?;
    let key = (ctx.ordinal(), source.to_string());
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(m) = cache.get(&key) {
        return Ok(m.clone());
    }
    let cc = ctx
        .compute_capability()
        .map_err(Error::driver("cuDeviceGetAttribute"))?;
    let arch = *ARCHS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(cc)
        .or_insert_with(|| Box::leak(format!("compute_{}{}", cc.0, cc.1).into_boxed_str()));
    // Device stages hold decimals in `__int128`, which NVRTC accepts only when asked.
    let options = CompileOptions {
        arch: Some(arch),
        name: Some("arrow_cuda_datafusion.cu".into()),
        options: if source.contains("__int128") {
            vec!["--device-int128".into()]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, options)
        .map_err(|e| Error::Unsupported(format!("NVRTC could not compile a scan kernel: {e}")))?;
    let m = ctx.load_module(ptx).map_err(Error::driver("cuModuleLoadData"))?;
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
