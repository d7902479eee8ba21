/* Device stages: what every generated stage kernel shares (src/datafusion/stage/codegen.rs). It follows
   the predicate prelude; the generated kernels `stage_groups`, `stage_accumulate` and `stage_init`
   follow it. Built with NVRTC's `--device-int128`. */
typedef __int128 i128;
#define NO_GROUP 0xFFFFFFFFu
/* A slot of the group table: 0 empty, 1 being written, DEAD abandoned, else group id + 2. */
#define SLOT_BUSY 1u
#define SLOT_DEAD 0xFFFFFFFFu
/* Bits of the flags word a stage reads back after each batch. */
#define FLAG_TABLE_FULL 1u
#define FLAG_LONG_KEY 2u
#define FLAG_OVERFLOW 4u
#define FLAG_DIV_ZERO 8u

__device__ __forceinline__ u64 mix64(u64 x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The id of the group whose key words are `kw[0..nw)`, inserted when new. Returns NO_GROUP and
   raises FLAG_TABLE_FULL when the table holds `max_groups` groups: the host grows it and runs the
   batch again (inserting is idempotent). */
__device__ u32 group_of(const u64* kw, int nw, u32* state, u64* keys, u64 mask, u64* group_keys,
                        u32* count, u32 max_groups, u32* flags) {
    u64 h = 0x9e3779b97f4a7c15ull;
    for (int j = 0; j < nw; j++) h = mix64(h ^ kw[j]);
    u64 s = h & mask;
    for (u64 probe = 0; probe <= mask; probe++) {
        u32 st = ((volatile u32*)state)[s];
        if (st == 0) {
            if (*(volatile u32*)count >= max_groups) { atomicOr(flags, FLAG_TABLE_FULL); return NO_GROUP; }
            st = atomicCAS(&state[s], 0u, SLOT_BUSY);
            if (st == 0) {
                for (int j = 0; j < nw; j++) keys[s * nw + j] = kw[j];
                u32 id = atomicAdd(count, 1u);
                if (id >= max_groups) {
                    atomicOr(flags, FLAG_TABLE_FULL);
                    __threadfence();
                    atomicExch(&state[s], SLOT_DEAD);
                    return NO_GROUP;
                }
                for (int j = 0; j < nw; j++) group_keys[(u64)id * nw + j] = kw[j];
                __threadfence();
                atomicExch(&state[s], id + 2);
                return id;
            }
        }
        while (st == SLOT_BUSY) st = ((volatile u32*)state)[s];
        __threadfence();
        if (st != SLOT_DEAD) {
            bool eq = true;
            for (int j = 0; j < nw; j++) eq = eq && ((volatile u64*)keys)[s * nw + j] == kw[j];
            if (eq) return st - 2;
        }
        s = (s + 1) & mask;
    }
    atomicOr(flags, FLAG_TABLE_FULL);
    return NO_GROUP;
}

/* 128-bit sums without a 128-bit atomic: bits 0-31 and 32-63 go to two unsigned 64-bit
   accumulators (at most 2^32 additions each before the host folds them), bits 64-127 to a third
   that wraps; (p0 + (p1 << 32) + (p2 << 64)) mod 2^128 is the wrapping sum. */
__device__ __forceinline__ void add128(u64* p0, u64* p1, u64* p2, i128 x) {
    u64 lo = (u64)x, hi = (u64)(x >> 64);
    if (lo & 0xffffffffull) atomicAdd((unsigned long long*)p0, lo & 0xffffffffull);
    if (lo >> 32) atomicAdd((unsigned long long*)p1, lo >> 32);
    if (hi) atomicAdd((unsigned long long*)p2, hi);
}
__device__ __forceinline__ void add_u64(u64* p, u64 x) { atomicAdd((unsigned long long*)p, x); }
__device__ __forceinline__ void add_f64(u64* p, double x) { atomicAdd((double*)p, x); }
__device__ __forceinline__ void min_i64(u64* p, long long x) { atomicMin((long long*)p, x); }
__device__ __forceinline__ void max_i64(u64* p, long long x) { atomicMax((long long*)p, x); }

/* Checked 128-bit arithmetic, as arrow's decimal kernels check it. */
__device__ __forceinline__ i128 add_checked(i128 a, i128 b, bool* ovf) {
    i128 r = (i128)((unsigned __int128)a + (unsigned __int128)b);
    if ((a >= 0) == (b >= 0) && (r >= 0) != (a >= 0)) *ovf = true;
    return r;
}
__device__ __forceinline__ i128 sub_checked(i128 a, i128 b, bool* ovf) {
    i128 r = (i128)((unsigned __int128)a - (unsigned __int128)b);
    if ((a >= 0) != (b >= 0) && (r >= 0) != (a >= 0)) *ovf = true;
    return r;
}
__device__ __forceinline__ i128 mul_checked(i128 a, i128 b, bool* ovf) {
    const i128 lim = (i128)1 << 62;
    if (a > -lim && a < lim && b > -lim && b < lim) return a * b;
    if (a == 0 || b == 0) return 0;
    i128 r = (i128)((unsigned __int128)a * (unsigned __int128)b);
    i128 min = (i128)((unsigned __int128)1 << 127);
    if ((a == -1 && b == min) || (b == -1 && a == min) || r / b != a) *ovf = true;
    return r;
}
__device__ __forceinline__ i128 div_checked(i128 a, i128 b, bool* ovf, bool* dz) {
    if (b == 0) { *dz = true; return 0; }
    i128 min = (i128)((unsigned __int128)1 << 127);
    if (a == min && b == -1) { *ovf = true; return 0; }
    return a / b;
}
__device__ __forceinline__ i128 rem_checked(i128 a, i128 b, bool* ovf, bool* dz) {
    if (b == 0) { *dz = true; return 0; }
    i128 min = (i128)((unsigned __int128)1 << 127);
    if (a == min && b == -1) { *ovf = true; return 0; }
    return a % b;
}
__device__ __forceinline__ i128 pow10_128(int k) {
    i128 r = 1;
    for (int j = 0; j < k; j++) r *= 10;
    return r;
}
/* Whether |x| < 10^p. */
__device__ __forceinline__ bool fits_precision(i128 x, int p) {
    i128 lim = pow10_128(p);
    return x < lim && x > -lim;
}
/* Strings: byte-wise order, and SQL LIKE with % and _ (one UTF-8 character). */
__device__ __forceinline__ int str_cmp(const unsigned char* a, u64 la, const unsigned char* b, u64 lb) {
    u64 n = la < lb ? la : lb;
    for (u64 k = 0; k < n; k++) if (a[k] != b[k]) return a[k] < b[k] ? -1 : 1;
    return la == lb ? 0 : (la < lb ? -1 : 1);
}
__device__ __forceinline__ u64 utf8_next(const unsigned char* s, u64 i, u64 n) {
    i++;
    while (i < n && (s[i] & 0xC0) == 0x80) i++;
    return i;
}
__device__ bool like_match(const unsigned char* s, u64 n, const unsigned char* p, u64 m) {
    u64 i = 0, j = 0, star_j = (u64)-1, star_i = 0;
    while (i < n) {
        if (j < m && p[j] == '_') { i = utf8_next(s, i, n); j++; }
        else if (j < m && p[j] == '%') { star_j = j++; star_i = i; }
        else if (j < m && p[j] == s[i]) { i++; j++; }
        else if (star_j != (u64)-1) { j = star_j + 1; star_i = utf8_next(s, star_i, n); i = star_i; }
        else return false;
    }
    while (j < m && p[j] == '%') j++;
    return j == m;
}
/* Year and month of days since 1970-01-01 (proleptic Gregorian). */
__device__ __forceinline__ void civil_from_days(long long z, long long* y, long long* m) {
    z += 719468;
    long long era = (z >= 0 ? z : z - 146096) / 146097;
    long long doe = z - era * 146097;
    long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    long long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    long long mp = (5 * doy + 2) / 153;
    *m = mp < 10 ? mp + 3 : mp - 9;
    *y = yoe + era * 400 + (*m <= 2);
}
/* Inserts groups 0..count, whose key words are in `group_keys`, into an empty table (when it grows). */
extern "C" __global__ void stage_rehash(const u64* group_keys, u64 nw, u64 count, u32* state, u64* keys, u64 mask) {
    u64 id = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= count) return;
    const u64* kw = group_keys + id * nw;
    u64 h = 0x9e3779b97f4a7c15ull;
    for (u64 j = 0; j < nw; j++) h = mix64(h ^ kw[j]);
    for (u64 s = h & mask;; s = (s + 1) & mask) {
        if (atomicCAS(&state[s], 0u, (u32)id + 2) == 0) {
            for (u64 j = 0; j < nw; j++) keys[s * nw + j] = kw[j];
            return;
        }
    }
}
