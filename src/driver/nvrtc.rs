//! The run-time compiler (NVRTC) and the driver entry points that load and launch what it compiles.
//!
//! Without the NVRTC library, or with a driver or library that lacks an entry point cudarc calls to
//! compile, load or launch, kernels are [`Error::Unsupported`]; the rest of the crate still works.

use std::sync::OnceLock;

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
