//! The lists of entry points the probes check: the wrappers' own (recorded by `driver_calls!`), and
//! those cudarc's safe types call on the crate's behalf.

use super::{device, event, ipc, memory, pointer};

/// Driver entry points that cudarc's safe types call for the crate (cudarc 0.19,
/// `src/driver/safe/core.rs`), by the method that calls them. Wrappers of this module cover
/// some of them too; listing them here keeps the list a record of what cudarc needs. When the crate
/// starts using another safe method, add what it calls (read its source): the test below fails when
/// a call's name (`Error::driver("cuXxx")`) is missing, but it cannot see calls cudarc makes silently.
const CUDARC: &[&str] = &[
    // CudaContext::new: initialise, find the device, retain its primary context, ask whether it
    // has memory pools; Drop releases the context.
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRelease_v2",
    // CudaContext::bind_to_thread, called by almost every safe method.
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    // CudaContext::name, ::attribute and ::compute_capability (cuDeviceGetAttribute), ::mem_get_info.
    "cuDeviceGetName",
    "cuMemGetInfo_v2",
    // CudaContext::new_stream (the first stream of a context synchronises it first); Drop.
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    // CudaStream::synchronize, ::record_event (a new event, recorded), CudaStream::wait.
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventRecord",
    "cuStreamWaitEvent",
    // CudaEvent::synchronize, ::try_is_complete, Drop.
    "cuEventSynchronize",
    "cuEventQuery",
    "cuEventDestroy_v2",
    // DriverError's Debug and Display, which every driver error message goes through.
    "cuGetErrorString",
];

/// Every group of entry points the crate calls outside kernels, checked before the first CUDA call.
const REQUIRED: &[&[&str]] = &[
    device::SYMBOLS,
    memory::SYMBOLS,
    pointer::SYMBOLS,
    event::SYMBOLS,
    ipc::SYMBOLS,
    CUDARC,
];

/// Every driver entry point the crate calls outside kernels.
pub(super) fn required() -> impl Iterator<Item = &'static str> {
    REQUIRED.iter().flat_map(|g| g.iter().copied())
}

/// Driver entry points that load and launch kernels, called by cudarc's `CudaContext::load_module`,
/// `CudaModule::load_function`, `CudaModule`'s Drop and `LaunchArgs::launch` (after binding the
/// context and, for timed launches, recording events). Checked, with [`NVRTC`], only by the probe of
/// kernels: a driver without them still serves everything else.
pub(super) const KERNELS: &[&str] = &[
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
];

/// NVRTC entry points cudarc calls to compile a program (`cudarc::nvrtc::compile_ptx_with_opts`).
pub(super) const NVRTC: &[&str] = &[
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcDestroyProgram",
];

/// The name of an entry point as the driver's documentation (and every error message of the crate)
/// gives it: without the `_v2` or `_v3` suffix of a revised ABI (`cuMemAlloc` for `cuMemAlloc_v2`).
pub(crate) const fn call_name(symbol: &'static str) -> &'static str {
    let b = symbol.as_bytes();
    let n = b.len();
    if n > 3 && b[n - 3] == b'_' && b[n - 2] == b'v' && b[n - 1].is_ascii_digit() {
        match std::str::from_utf8(b.split_at(n - 3).0) {
            Ok(name) => name,
            Err(_) => symbol,
        }
    } else {
        symbol
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;

    /// Driver names that the sources mention in prose without calling them.
    const PROSE_ONLY: &[&str] = &[
        // transfer: why pinned-memory detection uses the plural form.
        "cuPointerGetAttribute",
        // memory views: the pitch limit of the 2D copies.
        "cuMemcpy2D",
        // this module's docs: the placeholder of a new call.
        "cuXxx",
    ];

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "cu") {
                out.push(path);
            }
        }
    }

    /// Every `cu[A-Z]\w*` word of `text`.
    fn driver_names(text: &str) -> Vec<&str> {
        let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
        let b = text.as_bytes();
        let mut names = Vec::new();
        let mut i = 0;
        while i + 2 < b.len() {
            let starts =
                b[i] == b'c' && b[i + 1] == b'u' && b[i + 2].is_ascii_uppercase() && (i == 0 || !ident(b[i - 1]));
            if starts {
                let end = (i..b.len()).find(|&j| !ident(b[j])).unwrap_or(b.len());
                names.push(&text[i..end]);
                i = end;
            } else {
                i += 1;
            }
        }
        names
    }

    fn checked() -> Vec<&'static str> {
        required()
            .chain(KERNELS.iter().copied())
            .chain(crate::driver::batch::SYMBOLS.iter().copied())
            .chain(crate::driver::vmm::SYMBOLS.iter().copied())
            .chain(crate::driver::graph::SYMBOLS.iter().copied())
            .collect()
    }

    #[test]
    fn call_names_drop_abi_revisions() {
        assert_eq!(call_name("cuMemAlloc_v2"), "cuMemAlloc");
        assert_eq!(call_name("cuIpcOpenMemHandle_v2"), "cuIpcOpenMemHandle");
        assert_eq!(call_name("cuMemcpy2DAsync_v2"), "cuMemcpy2DAsync");
        assert_eq!(call_name("cuMemsetD8Async"), "cuMemsetD8Async");
        assert_eq!(call_name("cuInit"), "cuInit");
        assert_eq!(
            driver_names("a cuInit(0) and `cuMemAlloc_v2`, not cuda or acuX"),
            ["cuInit", "cuMemAlloc_v2"]
        );
    }

    #[test]
    fn wrappers_record_their_symbols() {
        let all = checked();
        for symbol in [
            "cuMemAlloc_v2",
            "cuIpcOpenEventHandle",
            "cuEventDestroy_v2",
            "cuMemGetAddressRange_v2",
        ] {
            assert!(all.contains(&symbol), "{symbol}");
        }
        assert_eq!(memory::SYMBOLS.len(), 13);
    }

    /// Every driver name in the sources, whether called through a wrapper, named for an error of a
    /// cudarc safe method, or in prose, is in a checked list: a call cannot escape the probe.
    #[test]
    fn every_driver_name_in_the_sources_is_checked() {
        let all = checked();
        let known = |name: &str| all.iter().any(|&s| s == name || call_name(s) == name);
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&root, &mut files);
        assert!(
            files.len() > 20,
            "found only {} source files under {}",
            files.len(),
            root.display()
        );
        let mut missing = Vec::new();
        for file in &files {
            let text = std::fs::read_to_string(file).expect("a readable source");
            for name in driver_names(&text) {
                if !known(name) && !PROSE_ONLY.contains(&name) {
                    missing.push(format!(
                        "{}: {name}",
                        file.strip_prefix(&root).unwrap_or(file).display()
                    ));
                }
            }
        }
        missing.dedup();
        assert!(
            missing.is_empty(),
            "driver entry points missing from the probe's lists (add a wrapper in src/driver, or the \
             symbol to the list of cudarc's safe calls):\n{}",
            missing.join("\n")
        );
        for name in PROSE_ONLY {
            assert!(!known(name), "{name} is checked now: remove it from PROSE_ONLY");
        }
    }

    /// The raw bindings (`sys`, `result`) that `text` names through `cudarc::driver::` or
    /// `cudarc::nvrtc::` paths, whether as a path or in a `{...}` import group.
    fn raw_binding_uses(text: &str) -> Vec<String> {
        let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let mut uses = Vec::new();
        for prefix in ["cudarc::driver::", "cudarc::nvrtc::"] {
            for (at, _) in text.match_indices(prefix) {
                let rest = &text[at + prefix.len()..];
                // The next path segment, or the `{...}` group of them.
                let end = match rest.strip_prefix('{') {
                    Some(group) => group.find('}').map_or(rest.len(), |e| e + 2),
                    None => rest.find(|c: char| !ident(c)).unwrap_or(rest.len()),
                };
                if rest[..end]
                    .split(|c: char| !ident(c))
                    .any(|w| w == "sys" || w == "result")
                {
                    uses.push(format!("{prefix}{}", &rest[..end]));
                }
            }
        }
        uses
    }

    #[test]
    fn raw_binding_uses_are_found_in_every_form() {
        let text = "use cudarc::driver::{\n    CudaContext,\n    sys,\n};\nuse cudarc::driver::CudaStream;\n\
                    let e = cudarc::driver::result::init(); // a result of cudarc::driver::CudaEvent\n\
                    cudarc::nvrtc::sys::culib();";
        let uses = raw_binding_uses(text);
        assert_eq!(uses.len(), 3, "{uses:?}");
        assert!(
            uses[0].contains("sys") && uses[1].ends_with("result") && uses[2].ends_with("sys"),
            "{uses:?}"
        );
    }

    /// Raw bindings (`cudarc::driver::sys` / `result`, `cudarc::nvrtc::sys` / `result`) are named
    /// only under `src/driver/`.
    #[test]
    fn raw_bindings_stay_in_the_driver_module() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = Vec::new();
        sources(&root, &mut files);
        let mut offenders = Vec::new();
        for file in files.iter().filter(|f| !f.starts_with(root.join("driver"))) {
            let text = std::fs::read_to_string(file).expect("a readable source");
            let shown = file.strip_prefix(&root).unwrap_or(file).display().to_string();
            offenders.extend(raw_binding_uses(&text).into_iter().map(|u| format!("{shown}: {u}")));
        }
        assert!(
            offenders.is_empty(),
            "raw CUDA bindings outside src/driver (add a wrapper there):\n{}",
            offenders.join("\n")
        );
    }
}
