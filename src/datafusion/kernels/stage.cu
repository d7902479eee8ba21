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
/* A row-reference slot (a MIN or MAX kept as `batch << 32 | element`) without a row yet. */
#define NO_ROW 0xFFFFFFFFFFFFFFFFull

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
/* A float as a signed integer that orders as IEEE 754's total order (layout.rs `ordered_f64`). */
__device__ __forceinline__ long long ordered_f64(double x) {
    long long b = __double_as_longlong(x);
    return b ^ (long long)(((unsigned long long)(b >> 63)) >> 1);
}

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
/* Strings: byte-wise order (LIKE is in the predicate prelude). */
__device__ __forceinline__ int str_cmp(const unsigned char* a, u64 la, const unsigned char* b, u64 lb) {
    u64 n = la < lb ? la : lb;
    for (u64 k = 0; k < n; k++) if (a[k] != b[k]) return a[k] < b[k] ? -1 : 1;
    return la == lb ? 0 : (la < lb ? -1 : 1);
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
/* Hash joins. The build side's rows sit in an open-addressing table of `mask + 1` slots, each the
   row + 1 (0: empty) with the row's key words beside it; rows with equal keys take a slot each, so
   a probe walks the slots from the key's home to the first empty one. The table has at least
   twice as many slots as rows, so it never fills. */
#define NO_MATCH 0xFFFFFFFFu
#define NO_SLOT 0xFFFFFFFFFFFFFFFFull
#define FLAG_DUPLICATE_KEY 16u
/* Raised by a build kernel for a row whose key is null (such rows stay out of the table). */
#define FLAG_NULL_BUILD_KEY 32u
/* What a probe knows of a join's build side (its `jr` argument): empty, rows, or a row whose key
   is null (for NOT IN's null rule). */
#define BUILD_EMPTY 0ull
#define BUILD_ROWS 1ull
#define BUILD_NULL_KEY 2ull
__device__ __forceinline__ u64 key_hash(const u64* kw, int nw) {
    u64 h = 0x9e3779b97f4a7c15ull;
    for (int j = 0; j < nw; j++) h = mix64(h ^ kw[j]);
    return h;
}
__device__ __forceinline__ void join_insert(const u64* kw, int nw, u32 row, u32* slots, u64* keys, u64 mask) {
    u64 s = key_hash(kw, nw) & mask;
    while (atomicCAS(&slots[s], 0u, row + 1) != 0u) s = (s + 1) & mask;
    for (int j = 0; j < nw; j++) keys[s * nw + j] = kw[j];
}
/* The first slot at or after `s` (walking from the key's home) whose key words are `kw`, or
   NO_SLOT at an empty one. */
__device__ __forceinline__ u64 join_next(const u64* kw, int nw, const u32* slots, const u64* keys, u64 mask, u64 s) {
    for (;; s = (s + 1) & mask) {
        if (slots[s] == 0) return NO_SLOT;
        bool eq = true;
        for (int j = 0; j < nw; j++) eq = eq && keys[s * nw + j] == kw[j];
        if (eq) return s;
    }
}
/* Raises FLAG_DUPLICATE_KEY when two rows of a built table have equal keys: each row looks for an
   equal key between its key's home and its own slot. */
extern "C" __global__ void join_unique(u64 mask, const u32* slots, const u64* keys, u64 nw, u32* flags) {
    u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s > mask || slots[s] == 0) return;
    const u64* kw = keys + s * nw;
    u64 t = join_next(kw, (int)nw, slots, keys, mask, key_hash(kw, (int)nw) & mask);
    if (t != s) atomicOr(flags, FLAG_DUPLICATE_KEY);
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
/* DataFusion's substr: the characters [from, to) of the UTF-8 bytes s[0..n) (0-based character
   positions, both already clamped at 0; to < 0: to the end), as a byte offset and length. A
   position at or past the last character is the end of the string. */
__device__ __forceinline__ void utf8_substr(const unsigned char* s, u64 n, long long from, long long to,
                                            u64* off, u64* len) {
    u64 bs = n, be = n;
    long long ci = 0;
    for (u64 i = 0; i < n; i++) {
        if ((s[i] & 0xC0) == 0x80) continue;
        if (ci == from) { bs = i; if (to < 0) break; }
        if (ci == to) { be = i; break; }
        ci++;
    }
    *off = bs;
    *len = be - bs;
}
/* Days since 1970-01-01 of a proleptic Gregorian year, month and day. */
__device__ __forceinline__ long long days_from_civil(long long y, long long m, long long d) {
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    long long yoe = y - era * 400;
    long long doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
    long long doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}
/* The range of chrono's NaiveDate (years -262143 to 262142), in days since 1970-01-01: arrow's date
   arithmetic goes through it, and a date or step outside it is an error. */
#define CHRONO_MIN_DAYS (-96465292LL)
#define CHRONO_MAX_DAYS 95026236LL
/* arrow's Date32 + interval (Date32Type::add_month_day_nano_opt and its kin): `months` first, the
   day clamped to the new month's last day, then `days`, then `days2` (the whole days of the
   interval's time part); each step outside chrono's range raises `ovf`. */
__device__ long long date_add_interval(long long date, long long months, long long days, long long days2,
                                       bool* ovf) {
    if (date < CHRONO_MIN_DAYS || date > CHRONO_MAX_DAYS) { *ovf = true; return 0; }
    if (months != 0) {
        long long z = date + 719468;
        long long era = (z >= 0 ? z : z - 146096) / 146097;
        long long doe = z - era * 146097;
        long long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
        long long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        long long mp = (5 * doy + 2) / 153;
        long long d = doy - (153 * mp + 2) / 5 + 1;
        long long m = mp < 10 ? mp + 3 : mp - 9;
        long long y = yoe + era * 400 + (m <= 2);
        long long total = y * 12 + (m - 1) + months;
        long long ny = total >= 0 ? total / 12 : -((-total + 11) / 12);
        long long nm = total - ny * 12 + 1;
        bool leap = (ny % 4 == 0 && ny % 100 != 0) || ny % 400 == 0;
        const int mdays[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
        long long dmax = nm == 2 && leap ? 29 : mdays[nm - 1];
        if (d > dmax) d = dmax;
        if (ny < -262143 || ny > 262142) { *ovf = true; return 0; }
        date = days_from_civil(ny, nm, d);
    }
    date += days;
    if (date < CHRONO_MIN_DAYS || date > CHRONO_MAX_DAYS) { *ovf = true; return 0; }
    date += days2;
    if (date < CHRONO_MIN_DAYS || date > CHRONO_MAX_DAYS) { *ovf = true; return 0; }
    return date;
}
/* A stage's groups as Arrow columns (src/datafusion/stage/emit.rs): one thread per group writes
   each state column's value and, through a warp vote, its validity bitmap (32 groups a word) and
   null count. Columns are described by `EmitColumn`s; `a`, `b` and `c` mean what the kind says. */
#define EMIT_KEY_INT 0      /* key word a (key b's null bit), `width` bytes */
#define EMIT_KEY_BOOL 1     /* key word a (key b's null bit), bits */
#define EMIT_KEY_DEC 2      /* key words a, a + 1 (key b's null bit), 16 bytes */
#define EMIT_KEY_STR 3      /* key words a..a + c (key b's null bit), views over 8 * c bytes a group */
#define EMIT_COUNT 4        /* slot a, never null */
#define EMIT_COUNT_OR_NULL 5 /* slot a, null when 0 */
#define EMIT_SUM128 6       /* count slot a, 32-bit-shifted parts a + 1..a + 3, `width` bytes */
#define EMIT_I64 7          /* count slot a, value slot a + 1, `width` bytes */
#define EMIT_F64 8          /* count slot a, f64 slot a + 1 */
#define EMIT_ORDERED_F64 9  /* count slot a, ordered f64 slot a + 1, `width` 4 or 8 */
struct EmitColumn { u64 kind, a, b, c, width; unsigned char *values, *validity, *data; };
__device__ __forceinline__ void emit_int(unsigned char* p, u64 width, i128 v) {
    switch (width) {
        case 1: *(signed char*)p = (signed char)v; break;
        case 2: *(short*)p = (short)v; break;
        case 4: *(int*)p = (int)v; break;
        case 8: *(long long*)p = (long long)v; break;
        default: *(i128*)p = v; break;
    }
}
/* Row g of the columns is group rows[g] (group g where `rows` is null). */
extern "C" __global__ void stage_emit(u64 count, const u64* group_keys, u64 nw, const u64* acc, u64 stride,
                                      const EmitColumn* cols, u64 ncols, unsigned long long* null_counts,
                                      const u32* rows) {
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool live = g < count;
    unsigned lane = threadIdx.x & 31;
    unsigned live_mask = __ballot_sync(0xffffffffu, live);
    u64 src = live ? (rows ? rows[g] : g) : 0;
    const u64* kw = group_keys + src * nw;
    for (u64 c = 0; c < ncols; c++) {
        EmitColumn col = cols[c];
        bool valid = true, bit = false;
        if (live) {
            u64 cnt = col.kind >= EMIT_COUNT ? acc[col.a * stride + src] : 0;
            switch (col.kind) {
                case EMIT_KEY_INT: case EMIT_KEY_BOOL: case EMIT_KEY_DEC: case EMIT_KEY_STR:
                    valid = !((kw[nw - 1] >> col.b) & 1);
                    break;
                case EMIT_COUNT: break;
                default: valid = cnt > 0; break;
            }
            unsigned char* out = col.values + g * col.width;
            switch (col.kind) {
                case EMIT_KEY_INT: emit_int(out, col.width, (i128)(long long)kw[col.a]); break;
                case EMIT_KEY_BOOL: bit = kw[col.a] != 0; break;
                case EMIT_KEY_DEC: emit_int(out, 16, (i128)(((unsigned __int128)kw[col.a + 1] << 64) | kw[col.a])); break;
                case EMIT_KEY_STR: {
                    /* An inline view holds up to 12 bytes; a longer string is a prefix and an offset. */
                    u64 len = valid ? kw[col.a + col.c - 1] >> 56 : 0;
                    const unsigned char* s = (const unsigned char*)(kw + col.a);
                    unsigned char view[16];
                    for (int t = 0; t < 16; t++) view[t] = 0;
                    *(u32*)view = (u32)len;
                    if (len <= 12) {
                        for (u64 t = 0; t < len; t++) view[4 + t] = s[t];
                    } else {
                        u64 at = g * 8 * col.c;
                        for (u64 t = 0; t < len; t++) col.data[at + t] = s[t];
                        for (int t = 0; t < 4; t++) view[4 + t] = s[t];
                        *(u32*)(view + 12) = (u32)at;
                    }
                    for (int t = 0; t < 16; t++) out[t] = view[t];
                    break;
                }
                case EMIT_COUNT: case EMIT_COUNT_OR_NULL: emit_int(out, col.width, (i128)cnt); break;
                case EMIT_SUM128: {
                    unsigned __int128 p0 = acc[(col.a + 1) * stride + src], p1 = acc[(col.a + 2) * stride + src],
                                      p2 = acc[(col.a + 3) * stride + src];
                    emit_int(out, col.width, valid ? (i128)(p0 + (p1 << 32) + (p2 << 64)) : 0);
                    break;
                }
                case EMIT_I64: emit_int(out, col.width, valid ? (i128)(long long)acc[(col.a + 1) * stride + src] : 0); break;
                case EMIT_F64: *(double*)out = valid ? __longlong_as_double((long long)acc[(col.a + 1) * stride + src]) : 0.0; break;
                case EMIT_ORDERED_F64: {
                    long long b = (long long)acc[(col.a + 1) * stride + src];
                    double v = valid ? __longlong_as_double(b ^ (long long)(((unsigned long long)(b >> 63)) >> 1)) : 0.0;
                    if (col.width == 4) *(float*)out = (float)v; else *(double*)out = v;
                    break;
                }
            }
        }
        unsigned valid_bits = __ballot_sync(0xffffffffu, valid);
        unsigned value_bits = __ballot_sync(0xffffffffu, bit);
        if (lane == 0 && live_mask != 0) {
            u64 word = g >> 5;
            ((u32*)col.validity)[word] = valid_bits & live_mask;
            if (col.kind == EMIT_KEY_BOOL) ((u32*)col.values)[word] = value_bits & live_mask;
            u32 nulls = __popc(~valid_bits & live_mask);
            if (nulls) atomicAdd(&null_counts[c], (unsigned long long)nulls);
        }
    }
}
