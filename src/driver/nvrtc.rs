//! The run-time compiler (NVRTC) and the driver entry points that load and launch what it compiles.
//!
//! Without the NVRTC library, or with a driver or library that lacks an entry point cudarc calls to
//! compile, load or launch, kernels are [`Error::Unsupported`]; the rest of the crate still works.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::CompileOptions;

use super::symbols::{KERNELS, NVRTC};
use crate::error::{Error, Result};

fn probe() -> Result<()> {
    super::available()?;
    for &s in KERNELS {
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

/// Compiles the CUDA C `source` for `ctx`'s device with NVRTC and loads it: [`Error::Unsupported`]
/// where NVRTC is unusable ([`nvrtc_available`]) or rejects the source. Compiling takes tens of
/// milliseconds: callers keep what they load.
pub(crate) fn load_module(ctx: &Arc<CudaContext>, source: &str) -> Result<Arc<CudaModule>> {
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
