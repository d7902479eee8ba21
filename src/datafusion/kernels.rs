//! The GPU side of a GPU table scan: CUDA C kernels compiled at run time with NVRTC.
//!
//! A scan with a pushed-down predicate runs, on the batch's device and in the order of one stream:
//!
//! 1. `pred`: a kernel generated from the predicate tree (one thread per row) reads the columns it
//!    needs, with their offsets and validity bitmaps, in SQL's three-valued logic, and writes a
//!    selection byte per row: 1 only where the predicate is true. Literals live in a small device
//!    buffer, so the source depends only on the predicate's shape and the column types: each
//!    shape compiles once per context.
//! 2. `tile_count_u8`, `scan_tiles`: the selected rows are counted per tile of 2048 rows and the
//!    tile counts prefix-summed; the total is the only value read back before compaction.
//! 3. `select_indices`: each tile scans its selection in shared memory and writes the indices of
//!    its selected rows, up to the scan's remaining limit.
//! 4. Compaction of every projected column by those indices: `gather_w1` .. `gather_w16` and
//!    `gather_fixed` (fixed-width values), `gather_bits` (validity bitmaps and booleans,
//!    re-packed), and for `Utf8`/`Binary` (`i32` offsets) and their large variants (`i64`):
//!    `string_lengths_*`, `tile_sum_u64` + `scan_tiles` + `scan_write_*` (new offsets from the
//!    prefix sum of the selected lengths) and `gather_bytes_*` (the bytes). `Utf8View` and
//!    `BinaryView` gather their views and keep their data buffers.
//!
//! Only the compacted columns are copied to the host. A projected column of a type the
//! compaction does not handle (lists, structs, dictionaries...) makes the scan download the
//! selection bytes and the projected columns and filter them on the host instead.
//!
//! Compiled modules are cached per (device, source). Without a driver, a GPU or the NVRTC
//! library, every entry point returns an [`Error`], never panics: the libraries and the entry
//! points cudarc calls are probed first.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use ::datafusion::common::ScalarValue;
use arrow_array::{BooleanArray, RecordBatch, RecordBatchOptions};
use arrow_buffer::BooleanBuffer;
use arrow_schema::DataType;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::CompileOptions;

use super::predicate::{CmpOp, Predicate};
use crate::array::{DeviceArrayData, DeviceRecordBatch};
use crate::device::{Device, Stream};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, MemoryResource};

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
fn available() -> Result<()> {
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
    let options = CompileOptions {
        arch: Some(arch),
        name: Some("arrow_cuda_datafusion.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, options)
        .map_err(|e| Error::Unsupported(format!("NVRTC could not compile a scan kernel: {e}")))?;
    let m = ctx.load_module(ptx).map_err(Error::driver("cuModuleLoadData"))?;
    cache.insert(key, m.clone());
    Ok(m)
}

fn function(ctx: &Arc<CudaContext>, source: &str, name: &str) -> Result<CudaFunction> {
    module(ctx, source)?
        .load_function(name)
        .map_err(Error::driver("cuModuleGetFunction"))
}

/// Threads per block of every kernel.
const BLOCK: u32 = 256;
/// Rows per tile of the scan kernels (`BLOCK` threads of 8 rows).
const TILE: u64 = 2048;

/// Launches `f` with 8-byte arguments (device pointers and `unsigned long long`).
fn launch(stream: &Arc<CudaStream>, f: &CudaFunction, grid: u64, block: u32, args: &[u64]) -> Result<()> {
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
        shared_mem_bytes: 0,
    };
    // SAFETY: every kernel in this module takes exactly these 8-byte parameters (pointers and
    // `unsigned long long`), in this order; the pointers are live device allocations of the
    // stream's device, kept alive by the caller until the stream is synchronised, and the sizes
    // passed bound every access the kernels make.
    unsafe { b.launch(cfg) }.map_err(Error::driver("cuLaunchKernel"))?;
    Ok(())
}

/// The kernels every scan shares: counting, prefix sums, index selection and gathers.
const UTIL: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
#define BLOCK 256
#define RPT 8
#define TILE (BLOCK * RPT)

__device__ u64 block_exclusive_scan(u64 c, u64* s) {
    s[threadIdx.x] = c;
    __syncthreads();
    for (int off = 1; off < BLOCK; off <<= 1) {
        u64 x = threadIdx.x >= off ? s[threadIdx.x - off] : 0;
        __syncthreads();
        s[threadIdx.x] += x;
        __syncthreads();
    }
    u64 r = s[threadIdx.x] - c;
    __syncthreads();
    return r;
}

__device__ u64 block_sum(u64 c, u64* s) {
    s[threadIdx.x] = c;
    __syncthreads();
    for (int st = BLOCK / 2; st > 0; st >>= 1) {
        if (threadIdx.x < st) s[threadIdx.x] += s[threadIdx.x + st];
        __syncthreads();
    }
    return s[0];
}

/* The sum of each tile of TILE values of v. */
template <typename T>
__device__ void tile_sums(const T* v, u64 n, u64* tiles) {
    __shared__ u64 s[BLOCK];
    u64 base = (u64)blockIdx.x * TILE + (u64)threadIdx.x * RPT;
    u64 c = 0;
    for (int r = 0; r < RPT; r++) { u64 i = base + r; if (i < n) c += v[i]; }
    u64 t = block_sum(c, s);
    if (threadIdx.x == 0) tiles[blockIdx.x] = t;
}

extern "C" __global__ void tile_count_u8(const unsigned char* v, u64 n, u64* tiles) { tile_sums(v, n, tiles); }

extern "C" __global__ void tile_sum_u64(const u64* v, u64 n, u64* tiles) { tile_sums(v, n, tiles); }

/* One block: exclusive prefix sum of ntiles values in place; the total goes to t[ntiles]. */
extern "C" __global__ void scan_tiles(u64* t, u64 ntiles) {
    __shared__ u64 s[BLOCK];
    u64 per = (ntiles + BLOCK - 1) / BLOCK;
    u64 lo = (u64)threadIdx.x * per;
    u64 hi = lo + per;
    if (lo > ntiles) lo = ntiles;
    if (hi > ntiles) hi = ntiles;
    u64 sum = 0;
    for (u64 i = lo; i < hi; i++) sum += t[i];
    s[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 acc = 0;
        for (int k = 0; k < BLOCK; k++) { u64 x = s[k]; s[k] = acc; acc += x; }
        t[ntiles] = acc;
    }
    __syncthreads();
    u64 acc = s[threadIdx.x];
    for (u64 i = lo; i < hi; i++) { u64 x = t[i]; t[i] = acc; acc += x; }
}

extern "C" __global__ void select_indices(const unsigned char* sel, u64 n, const u64* tiles, u64 limit, u32* idx) {
    __shared__ u64 s[BLOCK];
    u64 base = (u64)blockIdx.x * TILE + (u64)threadIdx.x * RPT;
    u64 c = 0;
    for (int r = 0; r < RPT; r++) { u64 i = base + r; if (i < n) c += sel[i]; }
    u64 pos = tiles[blockIdx.x] + block_exclusive_scan(c, s);
    for (int r = 0; r < RPT; r++) {
        u64 i = base + r;
        if (i < n && sel[i]) { if (pos < limit) idx[pos] = (u32)i; pos++; }
    }
}

#define SCAN_WRITE(NAME, T) \
extern "C" __global__ void NAME(const u64* v, u64 n, const u64* tiles, T* out) { \
    __shared__ u64 s[BLOCK]; \
    u64 base = (u64)blockIdx.x * TILE + (u64)threadIdx.x * RPT; \
    u64 c = 0; \
    for (int r = 0; r < RPT; r++) { u64 i = base + r; if (i < n) c += v[i]; } \
    u64 pos = tiles[blockIdx.x] + block_exclusive_scan(c, s); \
    for (int r = 0; r < RPT; r++) { \
        u64 i = base + r; \
        if (i < n) { out[i] = (T)pos; pos += v[i]; if (i == n - 1) out[n] = (T)pos; } \
    } \
}
SCAN_WRITE(scan_write_i32, int)
SCAN_WRITE(scan_write_i64, long long)

#define GATHER(NAME, T) \
extern "C" __global__ void NAME(const T* src, u64 off, const u32* idx, u64 m, T* dst) { \
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j < m) dst[j] = src[off + idx[j]]; \
}
GATHER(gather_w1, unsigned char)
GATHER(gather_w2, unsigned short)
GATHER(gather_w4, unsigned int)
GATHER(gather_w8, u64)

extern "C" __global__ void gather_w16(const u64* src, u64 off, const u32* idx, u64 m, u64* dst) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < m) { u64 i = off + idx[j]; dst[2 * j] = src[2 * i]; dst[2 * j + 1] = src[2 * i + 1]; }
}

extern "C" __global__ void gather_fixed(const unsigned char* src, u64 off, u64 width, const u32* idx, u64 m, unsigned char* dst) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < m) {
        const unsigned char* s = src + (off + idx[j]) * width;
        unsigned char* d = dst + j * width;
        for (u64 k = 0; k < width; k++) d[k] = s[k];
    }
}

extern "C" __global__ void gather_bits(const unsigned char* src, u64 off, const u32* idx, u64 m, unsigned char* dst) {
    u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= (m + 7) / 8) return;
    unsigned int out = 0;
    for (int k = 0; k < 8; k++) {
        u64 j = b * 8 + k;
        if (j < m) { u64 i = off + idx[j]; out |= ((src[i >> 3] >> (i & 7)) & 1u) << k; }
    }
    dst[b] = (unsigned char)out;
}

#define STRINGS(LEN, BYTES, T) \
extern "C" __global__ void LEN(const T* offsets, u64 off, const u32* idx, u64 m, u64* len) { \
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j < m) { u64 i = off + idx[j]; len[j] = (u64)(offsets[i + 1] - offsets[i]); } \
} \
extern "C" __global__ void BYTES(const T* offsets, u64 off, const unsigned char* data, const u32* idx, u64 m, const T* out_offsets, unsigned char* out) { \
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j < m) { \
        u64 i = off + idx[j]; \
        long long s = (long long)offsets[i]; \
        long long e = (long long)offsets[i + 1]; \
        long long d = (long long)out_offsets[j]; \
        for (long long k = 0; k < e - s; k++) out[d + k] = data[s + k]; \
    } \
}
STRINGS(string_lengths_i32, gather_bytes_i32, int)
STRINGS(string_lengths_i64, gather_bytes_i64, long long)
"#;

/// Helpers the generated predicate kernels share.
const PREDICATE_PRELUDE: &str = r#"
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ bool bit(const unsigned char* b, u64 i) { return (b[i >> 3] >> (i & 7)) & 1; }
__device__ __forceinline__ bool valid(const unsigned char* b, u64 i) { return b == 0 || bit(b, i); }
/* Keys in arrow's total order of floats, after -0.0 becomes +0.0 as in DataFusion's comparisons. */
__device__ __forceinline__ long long fkey32(float x) {
    if (x == 0.0f) x = 0.0f;
    int b = __float_as_int(x);
    b ^= (int)(((unsigned int)(b >> 31)) >> 1);
    return (long long)b;
}
__device__ __forceinline__ long long fkey64(double x) {
    if (x == 0.0) x = 0.0;
    long long b = __double_as_longlong(x);
    b ^= (long long)(((u64)(b >> 63)) >> 1);
    return b;
}
/* -1, 0 or 1 for two little-endian 128-bit signed integers. */
__device__ __forceinline__ int cmp128(const unsigned char* a, const unsigned char* b) {
    long long ah = *(const long long*)(a + 8), bh = *(const long long*)(b + 8);
    if (ah != bh) return ah < bh ? -1 : 1;
    u64 al = *(const u64*)a, bl = *(const u64*)b;
    return al == bl ? 0 : (al < bl ? -1 : 1);
}
__device__ __forceinline__ bool bytes_eq(const unsigned char* a, const unsigned char* b, u64 n) {
    for (u64 k = 0; k < n; k++) if (a[k] != b[k]) return false;
    return true;
}
__device__ __forceinline__ bool str_eq(const unsigned char* p, u64 n, const unsigned char* lit, u64 slot) {
    u32 o = *(const u32*)(lit + slot), l = *(const u32*)(lit + slot + 4);
    return n == l && bytes_eq(p, lit + o, n);
}
__device__ __forceinline__ bool str_prefix(const unsigned char* p, u64 n, const unsigned char* lit, u64 slot) {
    u32 o = *(const u32*)(lit + slot), l = *(const u32*)(lit + slot + 4);
    return n >= l && bytes_eq(p, lit + o, l);
}
"#;

/// How a column's values are read and compared in a generated kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ValueKind {
    /// Widened to `long long` (signed integers, dates, timestamps, booleans, float keys).
    Signed,
    /// Widened to `unsigned long long`.
    Unsigned,
    /// 16-byte little-endian two's complement.
    Decimal128,
    /// Bytes with `i32` offsets.
    Utf8,
    /// Bytes with `i64` offsets.
    LargeUtf8,
    /// 16-byte views.
    Utf8View,
}

/// A generated predicate kernel and what to launch it with.
struct Generated {
    source: String,
    /// The literal buffer: 16-byte slots, then the bytes of string literals.
    literals: Vec<u8>,
}

struct Codegen<'a> {
    batch: &'a DeviceRecordBatch,
    body: String,
    next: usize,
    slots: Vec<[u8; 16]>,
    strings: Vec<u8>,
    /// Slots holding string literals: their offsets are rebased once the slot count is known.
    string_slots: Vec<usize>,
}

impl Codegen<'_> {
    fn var(&mut self) -> usize {
        self.next += 1;
        self.next
    }

    fn slot(&mut self, bytes: [u8; 16]) -> usize {
        self.slots.push(bytes);
        (self.slots.len() - 1) * 16
    }

    fn string_slot(&mut self, s: &[u8]) -> Result<usize> {
        let rel = u32::try_from(self.strings.len())
            .map_err(|_| Error::InvalidArgument("string literals over 4 GiB".into()))?;
        let len = u32::try_from(s.len()).map_err(|_| Error::InvalidArgument("string literal over 4 GiB".into()))?;
        self.strings.extend_from_slice(s);
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&rel.to_le_bytes());
        b[4..8].copy_from_slice(&len.to_le_bytes());
        self.string_slots.push(self.slots.len());
        Ok(self.slot(b))
    }

    fn kind(&self, col: usize) -> Result<ValueKind> {
        use DataType::*;
        Ok(match self.batch.column(col).data_type() {
            Int8 | Int16 | Int32 | Int64 | Float32 | Float64 | Date32 | Date64 | Timestamp(..) | Boolean => {
                ValueKind::Signed
            }
            UInt8 | UInt16 | UInt32 | UInt64 => ValueKind::Unsigned,
            Decimal128(..) => ValueKind::Decimal128,
            Utf8 => ValueKind::Utf8,
            LargeUtf8 => ValueKind::LargeUtf8,
            Utf8View => ValueKind::Utf8View,
            other => return Err(Error::Unsupported(format!("GPU predicate over {other}"))),
        })
    }

    /// A C expression of column `col`'s value at element `e` in the domain it is compared in.
    fn load(&self, col: usize) -> Result<String> {
        use DataType::*;
        let v = format!("c{col}_v");
        Ok(match self.batch.column(col).data_type() {
            Int8 => format!("(long long)((const signed char*){v})[e{col}]"),
            Int16 => format!("(long long)((const short*){v})[e{col}]"),
            Int32 | Date32 => format!("(long long)((const int*){v})[e{col}]"),
            Int64 | Date64 | Timestamp(..) => format!("((const long long*){v})[e{col}]"),
            UInt8 => format!("(u64)((const unsigned char*){v})[e{col}]"),
            UInt16 => format!("(u64)((const unsigned short*){v})[e{col}]"),
            UInt32 => format!("(u64)((const unsigned int*){v})[e{col}]"),
            UInt64 => format!("((const u64*){v})[e{col}]"),
            Float32 => format!("fkey32(((const float*){v})[e{col}])"),
            Float64 => format!("fkey64(((const double*){v})[e{col}])"),
            Boolean => format!("(long long)bit({v}, e{col})"),
            Decimal128(..) => format!("({v} + 16 * e{col})"),
            other => return Err(Error::Unsupported(format!("GPU comparison over {other}"))),
        })
    }

    /// Stores a literal in a slot: integers as 8 bytes (floats as their total-order key),
    /// decimals as 16, strings as (offset, length).
    fn literal(&mut self, v: &ScalarValue) -> Result<usize> {
        let int = |x: i64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let uint = |x: u64| {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&x.to_le_bytes());
            b
        };
        let bytes = match v {
            ScalarValue::Int8(Some(x)) => int(*x as i64),
            ScalarValue::Int16(Some(x)) => int(*x as i64),
            ScalarValue::Int32(Some(x)) | ScalarValue::Date32(Some(x)) => int(*x as i64),
            ScalarValue::Int64(Some(x))
            | ScalarValue::Date64(Some(x))
            | ScalarValue::TimestampSecond(Some(x), _)
            | ScalarValue::TimestampMillisecond(Some(x), _)
            | ScalarValue::TimestampMicrosecond(Some(x), _)
            | ScalarValue::TimestampNanosecond(Some(x), _) => int(*x),
            ScalarValue::UInt8(Some(x)) => uint(*x as u64),
            ScalarValue::UInt16(Some(x)) => uint(*x as u64),
            ScalarValue::UInt32(Some(x)) => uint(*x as u64),
            ScalarValue::UInt64(Some(x)) => uint(*x),
            ScalarValue::Boolean(Some(x)) => int(*x as i64),
            ScalarValue::Float32(Some(x)) => {
                let x = if *x == 0.0 { 0.0f32 } else { *x };
                let b = x.to_bits() as i32;
                int((b ^ ((((b >> 31) as u32) >> 1) as i32)) as i64)
            }
            ScalarValue::Float64(Some(x)) => {
                let x = if *x == 0.0 { 0.0f64 } else { *x };
                let b = x.to_bits() as i64;
                int(b ^ ((((b >> 63) as u64) >> 1) as i64))
            }
            ScalarValue::Decimal128(Some(x), ..) => x.to_le_bytes(),
            ScalarValue::Utf8(Some(s)) | ScalarValue::LargeUtf8(Some(s)) | ScalarValue::Utf8View(Some(s)) => {
                return self.string_slot(s.as_bytes());
            }
            other => return Err(Error::Unsupported(format!("GPU literal {other:?}"))),
        };
        Ok(self.slot(bytes))
    }

    /// Emits the statements that compute a string column's pointer and length at element `e`.
    fn string_value(&mut self, col: usize) -> Result<(String, String)> {
        let n = self.var();
        let (p, l) = (format!("sp{n}"), format!("sl{n}"));
        let (v, d) = (format!("c{col}_v"), format!("c{col}_d"));
        // Only valid slots are read: a null view's length and buffer index may be anything.
        let read = match self.kind(col)? {
            ValueKind::Utf8 => format!(
                "const int* so{n} = (const int*){v}; {p} = {d} + so{n}[e{col}]; \
                 {l} = (u64)(so{n}[e{col} + 1] - so{n}[e{col}]);"
            ),
            ValueKind::LargeUtf8 => format!(
                "const long long* so{n} = (const long long*){v}; {p} = {d} + so{n}[e{col}]; \
                 {l} = (u64)(so{n}[e{col} + 1] - so{n}[e{col}]);"
            ),
            ValueKind::Utf8View => format!(
                "const unsigned char* vw{n} = {v} + 16 * e{col}; {l} = *(const u32*)vw{n}; \
                 {p} = {l} <= 12 ? vw{n} + 4 : \
                 (const unsigned char*)(((const u64*){d})[*(const u32*)(vw{n} + 8)]) + *(const u32*)(vw{n} + 12);"
            ),
            _ => return Err(Error::Unsupported(format!("column {col} is not a string"))),
        };
        writeln!(
            self.body,
            "    const unsigned char* {p} = 0; u64 {l} = 0;\n    if (valid(c{col}_n, e{col})) {{ {read} }}"
        )
        .map_err(|_| Error::InvalidArgument("formatting a kernel".into()))?;
        Ok((p, l))
    }

    /// An equality (or other comparison) test of column `col` against the literal in `slot`.
    fn compare(&mut self, col: usize, op: CmpOp, lit: &ScalarValue) -> Result<String> {
        let kind = self.kind(col)?;
        let slot = self.literal(lit)?;
        Ok(match kind {
            ValueKind::Signed => format!("({} {} *(const long long*)(lit + {slot}))", self.load(col)?, op.c()),
            ValueKind::Unsigned => format!("({} {} *(const u64*)(lit + {slot}))", self.load(col)?, op.c()),
            ValueKind::Decimal128 => format!("(cmp128({}, lit + {slot}) {} 0)", self.load(col)?, op.c()),
            ValueKind::Utf8 | ValueKind::LargeUtf8 | ValueKind::Utf8View => {
                let (p, l) = self.string_value(col)?;
                match op {
                    CmpOp::Eq => format!("str_eq({p}, {l}, lit, {slot})"),
                    CmpOp::NotEq => format!("!str_eq({p}, {l}, lit, {slot})"),
                    _ => return Err(Error::Unsupported("ordering comparisons of strings".into())),
                }
            }
        })
    }

    /// Emits code for `p`; returns the names of its (value, known) booleans.
    fn emit(&mut self, p: &Predicate) -> Result<(String, String)> {
        let n = self.var();
        let (v, k) = (format!("v{n}"), format!("k{n}"));
        let line = |s: &mut String, text: String| {
            s.push_str("    ");
            s.push_str(&text);
            s.push('\n');
        };
        match p {
            Predicate::And(a, b) | Predicate::Or(a, b) => {
                let (va, ka) = self.emit(a)?;
                let (vb, kb) = self.emit(b)?;
                let text = if matches!(p, Predicate::And(..)) {
                    format!(
                        "bool {k} = ({ka} && {kb}) || ({ka} && !{va}) || ({kb} && !{vb}); \
                         bool {v} = {ka} && {va} && {kb} && {vb};"
                    )
                } else {
                    format!(
                        "bool {k} = ({ka} && {kb}) || ({ka} && {va}) || ({kb} && {vb}); \
                         bool {v} = ({ka} && {va}) || ({kb} && {vb});"
                    )
                };
                line(&mut self.body, text);
            }
            Predicate::Not(a) => {
                let (va, ka) = self.emit(a)?;
                line(&mut self.body, format!("bool {k} = {ka}; bool {v} = !{va};"));
            }
            Predicate::Cmp { col, op, lit } => {
                let test = self.compare(*col, *op, lit)?;
                line(
                    &mut self.body,
                    format!("bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && {test};"),
                );
            }
            Predicate::InList { col, list } => {
                let mut tests = Vec::with_capacity(list.len());
                for item in list {
                    tests.push(self.compare(*col, CmpOp::Eq, item)?);
                }
                line(
                    &mut self.body,
                    format!(
                        "bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && ({});",
                        tests.join(" || ")
                    ),
                );
            }
            Predicate::IsNull { col } => {
                line(
                    &mut self.body,
                    format!("bool {k} = true; bool {v} = !valid(c{col}_n, e{col});"),
                );
            }
            Predicate::StartsWith { col, prefix } => {
                let slot = self.string_slot(prefix.as_bytes())?;
                let (sp, sl) = self.string_value(*col)?;
                line(
                    &mut self.body,
                    format!(
                        "bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && str_prefix({sp}, {sl}, lit, {slot});"
                    ),
                );
            }
            Predicate::Column { col } => {
                line(
                    &mut self.body,
                    format!("bool {k} = valid(c{col}_n, e{col}); bool {v} = {k} && bit(c{col}_v, e{col});"),
                );
            }
        }
        Ok((v, k))
    }
}

/// Generates the predicate kernel `pred(n, sel, lit, c<i>_v, c<i>_d, c<i>_n, c<i>_o ...)` for the
/// columns `cols` (ascending), with its literal buffer.
fn generate(predicate: &Predicate, batch: &DeviceRecordBatch, cols: &[usize]) -> Result<Generated> {
    let mut g = Codegen {
        batch,
        body: String::new(),
        next: 0,
        slots: vec![],
        strings: vec![],
        string_slots: vec![],
    };
    for &c in cols {
        g.body.push_str(&format!("    u64 e{c} = c{c}_o + i;\n"));
    }
    let (v, k) = g.emit(predicate)?;
    let mut source = String::from(PREDICATE_PRELUDE);
    source.push_str("extern \"C\" __global__ void pred(u64 n, unsigned char* sel, const unsigned char* lit");
    for &c in cols {
        source.push_str(&format!(
            ", const unsigned char* c{c}_v, const unsigned char* c{c}_d, const unsigned char* c{c}_n, u64 c{c}_o"
        ));
    }
    source.push_str(") {\n    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i >= n) return;\n");
    source.push_str(&g.body);
    source.push_str(&format!("    sel[i] = ({k} && {v}) ? 1 : 0;\n}}\n"));
    // Literal buffer: slots, then string bytes; string slots hold offsets from the buffer start.
    let base = g.slots.len() * 16;
    for &s in &g.string_slots {
        let rel = u32::from_le_bytes(g.slots[s][..4].try_into().expect("4 bytes"));
        let abs =
            u32::try_from(base + rel as usize).map_err(|_| Error::InvalidArgument("literals over 4 GiB".into()))?;
        g.slots[s][..4].copy_from_slice(&abs.to_le_bytes());
    }
    let mut literals: Vec<u8> = g.slots.iter().flatten().copied().collect();
    literals.extend_from_slice(&g.strings);
    if literals.is_empty() {
        literals.resize(16, 0);
    }
    Ok(Generated { source, literals })
}

/// What a filtered scan of one batch produced.
pub(crate) enum Filtered {
    /// No row was selected (or the limit was 0).
    Empty,
    /// The selected rows of the projected columns, compacted on the device.
    Device(DeviceRecordBatch),
    /// The selected rows, filtered on the host because a projected column's type has no
    /// compaction kernel.
    Host(RecordBatch),
}

/// Allocations of a scan, in stream order on its device.
struct Scratch {
    resource: MemoryResource,
    stream: Stream,
}

impl Scratch {
    fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::alloc(self.resource, len.max(1), &self.stream)
    }
}

/// Evaluates `predicate` on `batch` (on a CUDA device) and compacts the `output` columns to the
/// first `limit` selected rows; see the module docs for the kernels.
pub(crate) fn filter_compact(
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    output: &[usize],
    limit: usize,
    stream: &Stream,
) -> Result<Filtered> {
    let device = batch.device();
    let Device::Cuda(_) = device else {
        return Err(Error::Unsupported(format!(
            "GPU filters run on CUDA devices, not {device}"
        )));
    };
    available()?;
    let stream = crate::memory::stream_for(stream, device, device)?;
    let cuda = stream
        .cuda()
        .cloned()
        .ok_or_else(|| Error::Unsupported("a GPU filter needs a CUDA stream".into()))?;
    if cuda.context().ordinal() != device.ordinal().unwrap_or(usize::MAX) {
        return Err(Error::InvalidArgument(format!(
            "stream of cuda:{} for a batch on {device}",
            cuda.context().ordinal()
        )));
    }
    let n = batch.num_rows();
    if n == 0 || limit == 0 {
        return Ok(Filtered::Empty);
    }
    if n > u32::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "a batch of {n} rows (at most 2^32 - 1 per batch)"
        )));
    }
    stream.wait(batch.ready())?;
    let ctx = cuda.context().clone();
    let scratch = Scratch {
        resource: MemoryResource::default_for(device),
        stream: stream.clone(),
    };
    let result = run(&ctx, &cuda, &scratch, batch, predicate, output, limit, n);
    // Scratch memory is freed when this returns: let the kernels finish first, also on error.
    let synced = stream.synchronize();
    let out = result?;
    synced?;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn run(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    batch: &DeviceRecordBatch,
    predicate: &Predicate,
    output: &[usize],
    limit: usize,
    n: usize,
) -> Result<Filtered> {
    let stream = &scratch.stream;
    let n64 = n as u64;
    // 1. The predicate.
    let mut cols = BTreeSet::new();
    predicate.columns(&mut cols);
    let cols: Vec<usize> = cols.into_iter().collect();
    let generated = generate(predicate, batch, &cols)?;
    let pred = function(ctx, &generated.source, "pred")?;
    let lit = DeviceBuffer::from_host(&generated.literals, scratch.resource, stream)?;
    let sel = scratch.alloc(n)?;
    let mut keep = Vec::new();
    let mut args = vec![n64, sel.address(), lit.address()];
    for &c in &cols {
        let a = batch.column(c);
        let values = a.buffers().first().map_or(0, DeviceBuffer::address);
        let data = match a.data_type() {
            DataType::Utf8 | DataType::LargeUtf8 => a.buffers().get(1).map_or(0, DeviceBuffer::address),
            DataType::Utf8View => {
                let table: Vec<u8> = a.buffers()[1..]
                    .iter()
                    .flat_map(|b| b.address().to_le_bytes())
                    .collect();
                let t = DeviceBuffer::from_host(&table, scratch.resource, stream)?;
                let addr = t.address();
                keep.push(t);
                addr
            }
            _ => 0,
        };
        let nulls = match (a.nulls(), a.null_count()) {
            (Some(_), Some(0)) | (None, _) => 0,
            (Some(b), _) => b.address(),
        };
        args.extend([values, data, nulls, a.offset() as u64]);
    }
    launch(cuda, &pred, n64.div_ceil(BLOCK as u64), BLOCK, &args)?;
    // 2. Count and prefix-sum the tiles.
    let (tiles, total) = scan_u8(ctx, cuda, scratch, &sel, n64)?;
    let m = (total as usize).min(limit);
    if m == 0 {
        return Ok(Filtered::Empty);
    }
    // A projected column without a compaction kernel: filter on the host.
    if output.iter().any(|&c| !compactable(batch.column(c).data_type())) {
        let mut bytes = vec![0u8; n];
        sel.copy_to_host(0, &mut bytes, stream)?;
        let mask = BooleanArray::new(BooleanBuffer::collect_bool(n, |i| bytes[i] != 0), None);
        let host = crate::transfer::dtoh(&batch.project(output)?, stream)?;
        let filtered = arrow_select::filter::filter_record_batch(&host, &mask)?;
        return Ok(Filtered::Host(filtered.slice(0, m)));
    }
    // 3. Indices of the first m selected rows.
    let idx = scratch.alloc(m * 4)?;
    let select = function(ctx, UTIL, "select_indices")?;
    launch(
        cuda,
        &select,
        n64.div_ceil(TILE),
        BLOCK,
        &[sel.address(), n64, tiles.address(), m as u64, idx.address()],
    )?;
    // 4. Compact the projected columns.
    let schema = Arc::new(batch.schema().project(output)?);
    let columns = output
        .iter()
        .map(|&c| compact(ctx, cuda, scratch, batch.column(c), &idx, m))
        .collect::<Result<Vec<_>>>()?;
    let out = DeviceRecordBatch::try_new(schema, columns, m, stream.record()?)?;
    // The scratch buffers (selection, indices, literals, view tables) drop on return.
    stream.synchronize()?;
    drop(keep);
    Ok(Filtered::Device(out))
}

/// Counts the nonzero selection bytes: returns the exclusive prefix sums of the tiles (with the
/// total at the end) and the total.
fn scan_u8(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    sel: &DeviceBuffer,
    n: u64,
) -> Result<(DeviceBuffer, u64)> {
    let ntiles = n.div_ceil(TILE);
    let tiles = scratch.alloc((ntiles as usize + 1) * 8)?;
    let count = function(ctx, UTIL, "tile_count_u8")?;
    launch(cuda, &count, ntiles, BLOCK, &[sel.address(), n, tiles.address()])?;
    let scan = function(ctx, UTIL, "scan_tiles")?;
    launch(cuda, &scan, 1, BLOCK, &[tiles.address(), ntiles])?;
    let mut total = [0u8; 8];
    tiles.copy_to_host(ntiles as usize * 8, &mut total, &scratch.stream)?;
    Ok((tiles, u64::from_le_bytes(total)))
}

/// Whether [`compact`] handles a column of this type.
fn compactable(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Boolean
            | DataType::Utf8
            | DataType::Binary
            | DataType::LargeUtf8
            | DataType::LargeBinary
            | DataType::Utf8View
            | DataType::BinaryView
            | DataType::FixedSizeBinary(_)
    ) || (dt.is_primitive() && dt.primitive_width().is_some())
}

/// The rows `idx[0..m]` of `a`, in new device memory.
fn compact(
    ctx: &Arc<CudaContext>,
    cuda: &Arc<CudaStream>,
    scratch: &Scratch,
    a: &DeviceArrayData,
    idx: &DeviceBuffer,
    m: usize,
) -> Result<DeviceArrayData> {
    let m64 = m as u64;
    let off = a.offset() as u64;
    let grid = m64.div_ceil(BLOCK as u64);
    let bits = |src: &DeviceBuffer| -> Result<DeviceBuffer> {
        let out = scratch.alloc(m.div_ceil(8))?;
        let f = function(ctx, UTIL, "gather_bits")?;
        let bytes = m64.div_ceil(8);
        launch(
            cuda,
            &f,
            bytes.div_ceil(BLOCK as u64),
            BLOCK,
            &[src.address(), off, idx.address(), m64, out.address()],
        )?;
        Ok(out)
    };
    let nulls = match (a.nulls(), a.null_count()) {
        (Some(_), Some(0)) | (None, _) => None,
        (Some(b), _) => Some(bits(b)?),
    };
    let null_count = if nulls.is_none() { Some(0) } else { None };
    let buffer = |i: usize| {
        a.buffers()
            .get(i)
            .ok_or_else(|| Error::InvalidData(format!("{} array without buffer {i}", a.data_type())))
    };
    let dt = a.data_type().clone();
    let buffers = match &dt {
        DataType::Boolean => vec![bits(buffer(0)?)?],
        DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary => {
            let large = matches!(dt, DataType::LargeUtf8 | DataType::LargeBinary);
            let (lengths_fn, write_fn, bytes_fn, width) = if large {
                ("string_lengths_i64", "scan_write_i64", "gather_bytes_i64", 8)
            } else {
                ("string_lengths_i32", "scan_write_i32", "gather_bytes_i32", 4)
            };
            let (offsets, data) = (buffer(0)?, buffer(1)?);
            let lengths = scratch.alloc(m * 8)?;
            launch(
                cuda,
                &function(ctx, UTIL, lengths_fn)?,
                grid,
                BLOCK,
                &[offsets.address(), off, idx.address(), m64, lengths.address()],
            )?;
            let ntiles = m64.div_ceil(TILE);
            let tiles = scratch.alloc((ntiles as usize + 1) * 8)?;
            launch(
                cuda,
                &function(ctx, UTIL, "tile_sum_u64")?,
                ntiles,
                BLOCK,
                &[lengths.address(), m64, tiles.address()],
            )?;
            launch(
                cuda,
                &function(ctx, UTIL, "scan_tiles")?,
                1,
                BLOCK,
                &[tiles.address(), ntiles],
            )?;
            let mut total = [0u8; 8];
            tiles.copy_to_host(ntiles as usize * 8, &mut total, &scratch.stream)?;
            let total = u64::from_le_bytes(total) as usize;
            if !large && total > i32::MAX as usize {
                return Err(Error::InvalidData(format!(
                    "{total} bytes of strings overflow i32 offsets"
                )));
            }
            let new_offsets = scratch.alloc((m + 1) * width)?;
            launch(
                cuda,
                &function(ctx, UTIL, write_fn)?,
                ntiles,
                BLOCK,
                &[lengths.address(), m64, tiles.address(), new_offsets.address()],
            )?;
            let new_data = scratch.alloc(total)?;
            launch(
                cuda,
                &function(ctx, UTIL, bytes_fn)?,
                grid,
                BLOCK,
                &[
                    offsets.address(),
                    off,
                    data.address(),
                    idx.address(),
                    m64,
                    new_offsets.address(),
                    new_data.address(),
                ],
            )?;
            vec![new_offsets, new_data.slice(0, total)?]
        }
        DataType::Utf8View | DataType::BinaryView => {
            let views = scratch.alloc(m * 16)?;
            launch(
                cuda,
                &function(ctx, UTIL, "gather_w16")?,
                grid,
                BLOCK,
                &[buffer(0)?.address(), off, idx.address(), m64, views.address()],
            )?;
            let mut b = vec![views];
            b.extend(a.buffers()[1..].iter().cloned());
            b
        }
        other => {
            let width = match other {
                DataType::FixedSizeBinary(w) => *w as usize,
                _ => other
                    .primitive_width()
                    .ok_or_else(|| Error::Unsupported(format!("GPU compaction of {other}")))?,
            };
            let out = scratch.alloc(m * width)?;
            let src = buffer(0)?.address();
            let (name, args) = match width {
                1 => ("gather_w1", vec![src, off, idx.address(), m64, out.address()]),
                2 => ("gather_w2", vec![src, off, idx.address(), m64, out.address()]),
                4 => ("gather_w4", vec![src, off, idx.address(), m64, out.address()]),
                8 => ("gather_w8", vec![src, off, idx.address(), m64, out.address()]),
                16 => ("gather_w16", vec![src, off, idx.address(), m64, out.address()]),
                w => (
                    "gather_fixed",
                    vec![src, off, w as u64, idx.address(), m64, out.address()],
                ),
            };
            launch(cuda, &function(ctx, UTIL, name)?, grid, BLOCK, &args)?;
            vec![out.slice(0, m * width)?]
        }
    };
    DeviceArrayData::try_new(dt, m, 0, null_count, nulls, buffers, vec![])
}

/// Wraps a host-filtered batch with the scan's schema and row count.
pub(crate) fn host_batch(batch: RecordBatch, schema: arrow_schema::SchemaRef) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    Ok(RecordBatch::try_new_with_options(
        schema,
        batch.columns().to_vec(),
        &options,
    )?)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{
        ArrayRef, BooleanArray, Date32Array, Decimal128Array, Float32Array, Int8Array, LargeStringArray, RecordBatch,
        StringArray, StringViewArray, UInt16Array,
    };

    use super::*;

    /// Declarations that let a host C++ compiler check the syntax of the CUDA sources.
    const SHIM: &str = r#"
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct dim3_ { unsigned int x, y, z; };
static dim3_ threadIdx, blockIdx, blockDim;
static void __syncthreads() {}
static int __float_as_int(float) { return 0; }
static long long __double_as_longlong(double) { return 0; }
"#;

    fn batch() -> DeviceRecordBatch {
        let columns: Vec<(&str, ArrayRef)> = vec![
            ("i8", Arc::new(Int8Array::from(vec![Some(1), None]))),
            ("u16", Arc::new(UInt16Array::from(vec![1, 2]))),
            ("f32", Arc::new(Float32Array::from(vec![1.0, f32::NAN]))),
            (
                "dec",
                Arc::new(
                    Decimal128Array::from(vec![1, 2])
                        .with_precision_and_scale(10, 2)
                        .unwrap(),
                ),
            ),
            ("date", Arc::new(Date32Array::from(vec![1, 2]))),
            ("flag", Arc::new(BooleanArray::from(vec![Some(true), None]))),
            ("s", Arc::new(StringArray::from(vec!["a", "b"]))),
            ("l", Arc::new(LargeStringArray::from(vec!["a", "b"]))),
            ("v", Arc::new(StringViewArray::from(vec!["a", "a long string of text"]))),
        ];
        let b = RecordBatch::try_from_iter(columns).unwrap();
        crate::transfer::htod(&b, Device::Cpu, &Stream::cpu()).unwrap()
    }

    fn predicate() -> Predicate {
        let cmp = |col, op, lit| Box::new(Predicate::Cmp { col, op, lit });
        let and = |a, b| Box::new(Predicate::And(a, b));
        let or = |a, b| Box::new(Predicate::Or(a, b));
        *and(
            or(
                cmp(0, CmpOp::Gt, ScalarValue::Int8(Some(-3))),
                cmp(1, CmpOp::LtEq, ScalarValue::UInt16(Some(7))),
            ),
            and(
                and(
                    cmp(2, CmpOp::NotEq, ScalarValue::Float32(Some(-0.0))),
                    cmp(3, CmpOp::GtEq, ScalarValue::Decimal128(Some(-12345), 10, 2)),
                ),
                and(
                    or(
                        Box::new(Predicate::InList {
                            col: 4,
                            list: vec![ScalarValue::Date32(Some(1)), ScalarValue::Date32(Some(9))],
                        }),
                        Box::new(Predicate::Not(Box::new(Predicate::Column { col: 5 }))),
                    ),
                    and(
                        or(
                            cmp(6, CmpOp::Eq, ScalarValue::Utf8(Some("abc".into()))),
                            Box::new(Predicate::StartsWith {
                                col: 7,
                                prefix: "ab".into(),
                            }),
                        ),
                        or(
                            Box::new(Predicate::InList {
                                col: 8,
                                list: vec![
                                    ScalarValue::Utf8View(Some("x".into())),
                                    ScalarValue::Utf8View(Some("a long literal string".into())),
                                ],
                            }),
                            Box::new(Predicate::IsNull { col: 8 }),
                        ),
                    ),
                ),
            ),
        )
    }

    #[test]
    fn literals_are_laid_out_in_slots() {
        let b = batch();
        let p = predicate();
        let mut cols = BTreeSet::new();
        p.columns(&mut cols);
        let cols: Vec<usize> = cols.into_iter().collect();
        let g = generate(&p, &b, &cols).unwrap();
        if std::env::var_os("SHOW_KERNEL").is_some() {
            println!("{}", g.source);
        }
        // Slots of 16 bytes, then "abc", "ab", "x", "a long literal string".
        let strings = b"abcabxa long literal string";
        assert!(g.literals.ends_with(strings));
        let base = g.literals.len() - strings.len();
        assert_eq!(base % 16, 0);
        // The string slots point into the tail with their lengths.
        let slots: Vec<(u32, u32)> = g.literals[..base]
            .chunks(16)
            .map(|s| {
                (
                    u32::from_le_bytes(s[..4].try_into().unwrap()),
                    u32::from_le_bytes(s[4..8].try_into().unwrap()),
                )
            })
            .filter(|&(o, l)| o as usize >= base && o as usize + l as usize <= g.literals.len())
            .collect();
        assert_eq!(
            slots,
            vec![
                (base as u32, 3),
                (base as u32 + 3, 2),
                (base as u32 + 5, 1),
                (base as u32 + 6, 21)
            ]
        );
        // -0.0 is compared as +0.0; -123.45 is stored as a 16-byte integer.
        assert!(g.source.contains("fkey32"));
        assert!(g.literals.chunks(16).any(|s| s == (-12345i128).to_le_bytes()));
        // The same shape with other literals compiles to the same source.
        let mut q = p.clone();
        if let Predicate::And(a, _) = &mut q
            && let Predicate::Or(x, _) = a.as_mut()
        {
            **x = Predicate::Cmp {
                col: 0,
                op: CmpOp::Gt,
                lit: ScalarValue::Int8(Some(100)),
            };
        }
        let g2 = generate(&q, &b, &cols).unwrap();
        assert_eq!(g.source, g2.source);
        assert_ne!(g.literals, g2.literals);
    }

    /// The CUDA sources are valid C++ for a host compiler given a few CUDA declarations (a
    /// syntax check for machines without NVRTC; the GPU run compiles them for real).
    #[test]
    fn cuda_sources_parse_as_cpp() {
        let Ok(cxx) = which("g++").or_else(|_| which("c++")) else {
            eprintln!("skipped: no C++ compiler");
            return;
        };
        let b = batch();
        let p = predicate();
        let mut cols = BTreeSet::new();
        p.columns(&mut cols);
        let cols: Vec<usize> = cols.into_iter().collect();
        let g = generate(&p, &b, &cols).unwrap();
        let dir = std::env::temp_dir().join(format!("arrow-cuda-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, src) in [("util.cpp", UTIL), ("pred.cpp", g.source.as_str())] {
            let path = dir.join(name);
            std::fs::write(&path, format!("{SHIM}\n{src}")).unwrap();
            let out = std::process::Command::new(&cxx)
                .args([
                    "-fsyntax-only",
                    "-Wall",
                    "-Wno-unused-variable",
                    "-Wno-sign-compare",
                    "-x",
                    "c++",
                ])
                .arg(&path)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}:\n{}\n{}",
                String::from_utf8_lossy(&out.stderr),
                src
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn which(cmd: &str) -> std::io::Result<String> {
        let out = std::process::Command::new("which").arg(cmd).output()?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(std::io::Error::other("not found"))
        }
    }

    #[test]
    fn entry_points_fail_cleanly_without_a_gpu() {
        if gpu_kernels_available() {
            return;
        }
        let b = batch();
        let r = filter_compact(&b, &predicate(), &[0], 10, &Stream::cpu());
        assert!(r.is_err());
    }
}
