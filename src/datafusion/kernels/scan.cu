/* The kernels every GPU table scan shares: counting, prefix sums, index selection and gathers.
   Compiled at run time with NVRTC (src/datafusion/nvrtc.rs). */
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

/* Strings given by reference, as the address of their bytes and their length (a device stage's
   computed string columns, whose values point into the columns and literals they come from): the
   bytes copied to their place at the new offsets. */
#define REF_BYTES(NAME, T) \
extern "C" __global__ void NAME(const u64* refs, const u64* len, u64 m, const T* out_offsets, unsigned char* out) { \
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; \
    if (j < m) { \
        const unsigned char* s = (const unsigned char*)refs[j]; \
        long long d = (long long)out_offsets[j]; \
        for (u64 k = 0; k < len[j]; k++) out[d + k] = s[k]; \
    } \
}
REF_BYTES(ref_bytes_i32, int)
REF_BYTES(ref_bytes_i64, long long)

/* The views of strings by reference whose bytes `ref_bytes_i64` copied to `data` at `offsets`: up to
   12 bytes inline, longer ones by their first 4 bytes, buffer 0 and their offset there. */
extern "C" __global__ void ref_views(const u64* refs, const u64* len, u64 m, const long long* offsets, unsigned int* views) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    const unsigned char* s = (const unsigned char*)refs[j];
    u64 l = len[j];
    unsigned int w[3] = {0u, 0u, 0u};
    for (u64 k = 0; k < (l <= 12 ? l : 4); k++) w[k >> 2] |= (unsigned int)s[k] << (8 * (k & 3));
    if (l > 12) { w[1] = 0u; w[2] = (unsigned int)offsets[j]; }
    views[4 * j] = (unsigned int)l;
    views[4 * j + 1] = w[0];
    views[4 * j + 2] = w[1];
    views[4 * j + 3] = w[2];
}

/* Concatenation on the device (device_concat.rs). `concat_bits` ORs bits src_off..src_off + n of a
   bitmap (all ones when `src` is null) into a zeroed bitmap of 32-bit words from bit dst_off;
   `rebase_views` points the long views (more than 12 bytes) among n at the concatenation's data
   buffers: a view of the part's data buffer b (of `buffers`) moves to buffer moves[2 * b], its
   offset raised by moves[2 * b + 1]; a view of no buffer of the part stays as it is. */
extern "C" __global__ void concat_bits(const unsigned char* src, u64 src_off, u64 n, unsigned int* dst, u64 dst_off) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 s = src_off + i;
    if (src == 0 || ((src[s >> 3] >> (s & 7)) & 1)) {
        u64 d = dst_off + i;
        atomicOr(&dst[d >> 5], 1u << (d & 31));
    }
}

/* `rebase_offsets32/64` write n offsets from `src` to `dst`, each plus `delta` (a part's offsets
   moved to start where the previous part's ended), in unsigned arithmetic (no overflow). */
extern "C" __global__ void rebase_offsets32(const u32* src, u64 n, u32* dst, u64 delta) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + (u32)delta;
}

extern "C" __global__ void rebase_offsets64(const u64* src, u64 n, u64* dst, u64 delta) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + delta;
}

extern "C" __global__ void rebase_views(unsigned int* views, u64 n, const unsigned int* moves, u64 buffers) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || views[4 * i] <= 12) return;
    unsigned int b = views[4 * i + 2];
    if (b >= buffers) return;
    views[4 * i + 2] = moves[2 * b];
    views[4 * i + 3] += moves[2 * b + 1];
}
