//! Loading the driver library and checking, once, every entry point the crate calls.
//!
//! cudarc loads each entry point on its first call and panics when the library or the symbol is
//! missing; the probe looks every symbol of [`super::symbols::required`] up first, so an old driver is
//! an [`Error::DriverTooOld`] and a machine without one an [`Error::NoDriver`], never a panic.

use std::sync::OnceLock;

use cudarc::driver::sys;

use super::symbols;
use crate::error::{Error, Result};

/// Why the driver is unusable, kept so every later call reports the same thing.
#[derive(Clone, Debug)]
enum Unavailable {
    NoLibrary(String),
    MissingSymbol(&'static str),
    /// `cuInit` or `cuDeviceGetCount` failed: what the driver said.
    Init(String),
    NoDevice,
}

/// Whether the loaded driver library exports `symbol`.
///
/// # Safety
/// The driver library is present (`is_culib_present` returned true), so `culib` returns it without
/// panicking.
pub(super) unsafe fn has_symbol(symbol: &str) -> bool {
    // SAFETY: the library is present (caller); the symbol is only looked up, never called through
    // this type.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol.as_bytes()) }.is_ok()
}

/// The reason an initialisation call failed, as the driver put it.
fn init_failure(e: Error) -> Unavailable {
    Unavailable::Init(match e {
        Error::Driver { call, source } => format!("{call} failed: {source}"),
        other => other.to_string(),
    })
}

fn probe() -> Result<(), Unavailable> {
    // SAFETY: loading the driver library runs its initialisers, which is what any CUDA program does.
    if !unsafe { sys::is_culib_present() } {
        let mut names = cudarc::get_lib_name_candidates("cuda");
        names.sort();
        names.dedup();
        return Err(Unavailable::NoLibrary(names.join(", ")));
    }
    for symbol in symbols::required() {
        // SAFETY: the library is present (checked above).
        if !unsafe { has_symbol(symbol) } {
            return Err(Unavailable::MissingSymbol(symbol));
        }
    }
    // SAFETY: the library is present and exports both entry points (checked above).
    unsafe { super::device::init() }.map_err(init_failure)?;
    // SAFETY: the driver is initialised (above).
    match unsafe { super::device_count() } {
        Ok(0) => Err(Unavailable::NoDevice),
        Ok(_) => Ok(()),
        Err(e) => Err(init_failure(e)),
    }
}

/// Checks once that a CUDA driver with every entry point the crate calls and at least one GPU are
/// present; every later call returns the same answer. Every wrapper of this module needs it to have
/// returned `Ok`.
pub(crate) fn available() -> Result<()> {
    static PROBE: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    PROBE.get_or_init(probe).clone().map_err(|u| match u {
        Unavailable::NoLibrary(looked_for) => Error::NoDriver { looked_for },
        Unavailable::MissingSymbol(symbol) => Error::DriverTooOld { symbol },
        Unavailable::Init(reason) => Error::NoDevice { reason },
        Unavailable::NoDevice => Error::NoDevice {
            reason: "the driver reports 0 devices".into(),
        },
    })
}
