//! Tests only: the crate's CUDA C compiled by the host's C++ compiler, so machines without a GPU
//! (CI) still check that generated kernels parse and that device helpers compute what DataFusion
//! computes. The GPU run compiles the same sources with NVRTC for real.
//!
//! The shim maps CUDA's qualifiers away and gives single-threaded meanings to the intrinsics and
//! atomics the kernels use, which is exact for a helper called once per input.

use std::path::PathBuf;
use std::process::Command;

/// CUDA declarations for a host C++ compiler.
const SHIM: &str = r#"
#include <cstdio>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
struct dim3_ { unsigned int x, y, z; };
static dim3_ threadIdx, blockIdx, blockDim, gridDim;
static void __syncthreads() {}
static void __threadfence() {}
static int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
static double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
static unsigned __ballot_sync(unsigned, bool p) { return p ? 1u : 0u; }
static int __popc(unsigned x) { return __builtin_popcount(x); }
template <class T> T __shfl_xor_sync(unsigned, T v, int) { return v; }
template <class T> T atomicAdd(T* p, T v) { T o = *p; *p += v; return o; }
template <class T> T atomicOr(T* p, T v) { T o = *p; *p |= v; return o; }
template <class T> T atomicAnd(T* p, T v) { T o = *p; *p &= v; return o; }
template <class T> T atomicMin(T* p, T v) { T o = *p; if (v < o) *p = v; return o; }
template <class T> T atomicMax(T* p, T v) { T o = *p; if (v > o) *p = v; return o; }
template <class T> T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
template <class T> T atomicCAS(T* p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }
"#;

/// The host C++ compiler, or `None` (the caller prints `skipped: no C++ compiler`).
pub(crate) fn compiler() -> Option<&'static str> {
    ["g++", "c++"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// A scratch directory for `name`, unique to this process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("arrow-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Checks that `source` parses as C++ with warnings on; `Err` holds the compiler's message.
pub(crate) fn check_syntax(compiler: &str, name: &str, source: &str) -> Result<(), String> {
    let dir = scratch(name);
    let path = dir.join(format!("{name}.cpp"));
    std::fs::write(&path, format!("{SHIM}\n{source}")).unwrap();
    let out = Command::new(compiler)
        .args(["-fsyntax-only", "-Wall", "-Wno-unused-variable"])
        .args([
            "-Wno-unused-but-set-variable",
            "-Wno-sign-compare",
            "-Wno-unused-function",
        ])
        .args(["-x", "c++"])
        .arg(&path)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Builds `source` (which defines `main`) and runs it with `input` on stdin; its stdout, by line.
pub(crate) fn run(compiler: &str, name: &str, source: &str, input: &str) -> Vec<String> {
    let dir = scratch(name);
    let src = dir.join(format!("{name}.cpp"));
    let exe = dir.join(name);
    std::fs::write(&src, format!("{SHIM}\n{source}")).unwrap();
    let out = Command::new(compiler)
        .args(["-O1", "-w", "-x", "c++"])
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The input goes through a file: written to a pipe, it would wait for the program, which
    // waits for its full output pipe to be read.
    let input_path = dir.join("input");
    std::fs::write(&input_path, input).unwrap();
    let out = Command::new(&exe)
        .stdin(std::fs::File::open(&input_path).unwrap())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{name} exited with {}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}
