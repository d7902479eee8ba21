//! The run-time compiler (NVRTC) and the driver entry points that load and launch what it compiles
//! (through `cuLaunchKernel` or a [`KernelGraph`](super::KernelGraph)).
//!
//! Without the NVRTC library, or with a driver or library that lacks an entry point cudarc calls to
//! compile, load or launch, kernels are [`Error::Unsupported`]; the rest of the crate still works.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use super::symbols::{KERNELS, NVRTC};
use crate::error::{Error, Result};

fn probe() -> Result<()> {
    super::available()?;
    for &s in KERNELS.iter().chain(super::graph::SYMBOLS) {
        // SAFETY: the driver library is present (checked by `available`).
        if !unsafe { super::probe::has_symbol(s) } {
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
    for &s in NVRTC {
        // SAFETY: the symbol is only looked up, never called through this type.
        if unsafe { nvrtc.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err() {
            return Err(Error::Unsupported(format!("the NVRTC library has no `{s}`")));
        }
    }
    Ok(())
}

/// Checks once that the driver, a GPU and NVRTC are usable for compiling, loading and launching
/// kernels: every failure is an [`Error::Unsupported`] carrying the reason.
pub(crate) fn nvrtc_available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| probe().map_err(|e| e.to_string()))
        .clone()
        .map_err(Error::Unsupported)
}

/// The kernel `name` of the CUDA C `source`, compiled for `ctx`'s device with NVRTC and loaded on
/// first use (tens of milliseconds), then from a cache of modules per (device, source) kept for the
/// life of the process: [`Error::Unsupported`] where NVRTC is unusable ([`nvrtc_available`]) or
/// rejects the source.
pub(crate) fn function(ctx: &Arc<CudaContext>, source: &str, name: &str) -> Result<CudaFunction> {
    static CACHE: OnceLock<FunctionCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (ctx.ordinal(), source.as_ptr() as usize);
    let lock = || cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(loaded) = lock().get(&key)
        && let Some((.., f)) = loaded.iter().find(|(s, n, _)| **n == *name && **s == *source)
    {
        return Ok(f.clone());
    }
    let f = module(ctx, source)?
        .load_function(name)
        .map_err(Error::driver("cuModuleGetFunction"))?;
    let mut cache = lock();
    let loaded = cache.entry(key).or_default();
    // Functions of another source that lay at this address are not asked for again.
    loaded.retain(|(s, ..)| **s == *source);
    loaded.push((source.into(), name.into(), f.clone()));
    Ok(f)
}

/// Functions loaded, by device ordinal and the address of their source, each with the source and
/// name it was loaded for: a lookup hashes no source text (kilobytes, hashed by the module cache)
/// and compares the source's bytes, so another source at a reused address is never mistaken for it.
type FunctionCache = Mutex<HashMap<(usize, usize), Vec<(Box<str>, Box<str>, CudaFunction)>>>;

/// Compiled modules, per device ordinal and source (looked up without copying the source).
type ModuleCache = Mutex<HashMap<usize, HashMap<String, Arc<CudaModule>>>>;

fn module(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<CudaModule>> {
    static CACHE: OnceLock<ModuleCache> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let modules = cache.entry(ctx.ordinal()).or_default();
    if let Some(m) = modules.get(source) {
        return Ok(m.clone());
    }
    let m = compile(ctx, source)?;
    modules.insert(source.to_string(), m.clone());
    Ok(m)
}

/// Compiles `source` for `ctx`'s device with NVRTC and loads it.
fn compile(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<CudaModule>> {
    static ARCHS: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    nvrtc_available()?;
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
        name: Some("arrow_cuda.cu".into()),
        options: if source.contains("__int128") {
            vec!["--device-int128".into()]
        } else {
            vec![]
        },
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, options)
        .map_err(|e| Error::Unsupported(format!("NVRTC could not compile a kernel: {e}")))?;
    ctx.load_module(ptx).map_err(Error::driver("cuModuleLoadData"))
}

/// Launches `f` on `stream` with 8-byte arguments (device pointers and `unsigned long long`).
#[cfg_attr(not(feature = "datafusion"), allow(dead_code))]
pub(crate) fn launch(stream: &Arc<CudaStream>, f: &CudaFunction, grid: u64, block: u32, args: &[u64]) -> Result<()> {
    launch_shared(stream, f, grid, block, 0, args)
}

/// Launches `f` with 8-byte arguments and `shared` bytes of dynamic shared memory per block; a
/// grid of no blocks launches nothing.
#[cfg_attr(not(feature = "datafusion"), allow(dead_code))]
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
    // stream's device (or mapped pinned memory), kept alive by the caller until the stream is
    // synchronised, the sizes passed bound every access the kernels make, and `shared` is what
    // the kernel indexes.
    unsafe { b.launch(cfg) }.map_err(Error::driver("cuLaunchKernel"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use cudarc::driver::DevicePtr;

    use super::*;

    /// A function is found again by its source's address only where the source there is the same
    /// text: a kernel written over another at the same address is compiled and loaded as its own.
    #[test]
    fn a_source_at_a_reused_address_gets_its_own_function() {
        if nvrtc_available().is_err() {
            assert!(
                !std::path::Path::new("/dev/nvidia0").exists(),
                "this machine has a GPU but cannot compile kernels"
            );
            eprintln!("skipped: no CUDA device");
            return;
        }
        let ctx = CudaContext::new(0).unwrap();
        let stream = ctx.default_stream();
        let out = stream.alloc_zeros::<u64>(1).unwrap();
        let mut source = String::with_capacity(256);
        for value in [7u64, 9, 7] {
            source.clear();
            source.push_str(&format!(
                "extern \"C\" __global__ void put(unsigned long long* out) {{ *out = {value}ULL; }}"
            ));
            let address = source.as_ptr();
            let f = function(&ctx, &source, "put").unwrap();
            assert_eq!(source.as_ptr(), address, "the source stays where it was");
            {
                let (ptr, _sync) = out.device_ptr(&stream);
                launch(&stream, &f, 1, 1, &[ptr]).unwrap();
            }
            assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![value]);
        }
    }
}
