/* The least and the greatest valid value of a column on the device, in the order of arrow's `min`
   and `max` (DataFusion's MIN and MAX): integers and decimals by value, floats by IEEE total order
   (negative NaN least, positive NaN greatest), strings and binaries byte by byte, a prefix before
   the longer value. Compiled at run time with NVRTC (src/datafusion/device_extremes.rs).

   Both kernels take the columns of one batch at once, each described by a `Column` in device
   memory. `extremes_blocks` runs `per` blocks per column and reduces each block's share of the
   rows to the places of its least and greatest valid value (-1 for none); `extremes_final`, one
   block per column, reduces those candidates and writes the result (see `Found`). */
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
#define BLOCK 256

#define KIND_INT 0
#define KIND_UINT 1
#define KIND_FLOAT 2
#define KIND_BYTES32 3
#define KIND_BYTES64 4
#define KIND_VIEW 5

/* A column: its kind (KIND_* above); the bytes of one value (integers, decimals, floats); the
   values (fixed width), the offsets (strings) or the views; the bytes the offsets reach, or a
   device array of the view data buffers' addresses; the validity bitmap, or 0 when every value
   is valid; the array's offset (element i of the array is element offset + i of its buffers and
   bit offset + i of its bitmap); its length. */
struct Column {
    u64 kind, width;
    const unsigned char* values;
    const unsigned char* data;
    const unsigned char* nulls;
    u64 offset, len;
};

/* The bytes of a value `Found` holds itself; the host copies longer ones from their address. */
#define INLINE 128

/* What `extremes_final` writes, for the least value ([0]) and the greatest ([1]): its place (-1
   when there is no valid value), the address and length of its bytes, and its first INLINE
   bytes. */
struct Found {
    i64 place[2];
    u64 at[2], len[2];
    unsigned char value[2][INLINE];
};

__device__ bool valid(const Column& c, u64 i) {
    if (!c.nulls) return true;
    u64 bit = c.offset + i;
    return (c.nulls[bit >> 3] >> (bit & 7)) & 1;
}

/* The address and length of the bytes of value i. */
__device__ void bytes_of(const Column& c, u64 i, const unsigned char** at, u64* len) {
    u64 e = c.offset + i;
    switch (c.kind) {
    case KIND_BYTES32: {
        const int* o = (const int*)c.values;
        *at = c.data + o[e];
        *len = (u64)(o[e + 1] - o[e]);
        return;
    }
    case KIND_BYTES64: {
        const i64* o = (const i64*)c.values;
        *at = c.data + o[e];
        *len = (u64)(o[e + 1] - o[e]);
        return;
    }
    case KIND_VIEW: {
        const unsigned char* v = c.values + e * 16;
        u32 n = *(const u32*)v;
        *len = n;
        if (n <= 12) {
            *at = v + 4;
        } else {
            u32 buffer = *(const u32*)(v + 8);
            u32 off = *(const u32*)(v + 12);
            *at = (const unsigned char*)((const u64*)c.data)[buffer] + off;
        }
        return;
    }
    default:
        *at = c.values + e * c.width;
        *len = c.width;
    }
}

/* A fixed-width value of up to eight bytes as a signed key in the column's order. */
__device__ i64 key(const Column& c, u64 i) {
    const unsigned char* p = c.values + (c.offset + i) * c.width;
    switch (c.kind) {
    case KIND_UINT:
        switch (c.width) {
        case 1: return (i64)*p;
        case 2: return (i64) * (const unsigned short*)p;
        case 4: return (i64) * (const u32*)p;
        default: {
            /* Unsigned 64-bit: flip the top bit so that signed order is unsigned order. */
            u64 v = *(const u64*)p;
            return (i64)(v ^ (1ull << 63));
        }
        }
    case KIND_FLOAT:
        /* IEEE total order as signed integers: negative values' other bits flipped. */
        switch (c.width) {
        case 2: {
            short b = *(const short*)p;
            return (i64)(short)(b ^ (short)(((unsigned short)(b >> 15)) >> 1));
        }
        case 4: {
            int b = *(const int*)p;
            return (i64)(b ^ (int)(((u32)(b >> 31)) >> 1));
        }
        default: {
            i64 b = *(const i64*)p;
            return b ^ (i64)(((u64)(b >> 63)) >> 1);
        }
        }
    default:
        switch (c.width) {
        case 1: return (i64) * (const signed char*)p;
        case 2: return (i64) * (const short*)p;
        case 4: return (i64) * (const int*)p;
        default: return *(const i64*)p;
        }
    }
}

/* The order of values i and j: negative, zero or positive. */
__device__ int compare(const Column& c, u64 i, u64 j) {
    if (c.kind <= KIND_FLOAT && c.width <= 8) {
        i64 a = key(c, i), b = key(c, j);
        return (a > b) - (a < b);
    }
    if (c.kind == KIND_INT) {
        /* Signed integers of 16 or 32 bytes: the top word signed, the others unsigned. */
        const u64* a = (const u64*)(c.values + (c.offset + i) * c.width);
        const u64* b = (const u64*)(c.values + (c.offset + j) * c.width);
        int words = (int)(c.width / 8);
        i64 ta = (i64)a[words - 1], tb = (i64)b[words - 1];
        if (ta != tb) return ta < tb ? -1 : 1;
        for (int w = words - 2; w >= 0; --w) {
            if (a[w] != b[w]) return a[w] < b[w] ? -1 : 1;
        }
        return 0;
    }
    const unsigned char *a, *b;
    u64 la, lb;
    bytes_of(c, i, &a, &la);
    bytes_of(c, j, &b, &lb);
    u64 n = la < lb ? la : lb;
    for (u64 k = 0; k < n; ++k) {
        if (a[k] != b[k]) return a[k] < b[k] ? -1 : 1;
    }
    return (la > lb) - (la < lb);
}

/* Takes candidate i (or none, -1) into the least and greatest so far. */
__device__ void take(const Column& c, i64 i, i64* least, i64* greatest) {
    if (i < 0) return;
    if (*least < 0 || compare(c, (u64)i, (u64)*least) < 0) *least = i;
    if (*greatest < 0 || compare(c, (u64)i, (u64)*greatest) > 0) *greatest = i;
}

/* Reduces each thread's least and greatest across the block; thread 0 returns the block's. */
__device__ void block_reduce(const Column& c, i64* least, i64* greatest) {
    __shared__ i64 lo[BLOCK], hi[BLOCK];
    lo[threadIdx.x] = *least;
    hi[threadIdx.x] = *greatest;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            i64 l = lo[threadIdx.x], g = hi[threadIdx.x];
            take(c, lo[threadIdx.x + s], &l, &g);
            take(c, hi[threadIdx.x + s], &l, &g);
            lo[threadIdx.x] = l;
            hi[threadIdx.x] = g;
        }
        __syncthreads();
    }
    *least = lo[0];
    *greatest = hi[0];
}

/* Block b of column b / per: the least and greatest valid value of its rows (every per-th
   stretch of BLOCK rows), as places, into candidates[2 * b] and candidates[2 * b + 1]. */
extern "C" __global__ void extremes_blocks(const Column* columns, u64 per, i64* candidates) {
    const Column c = columns[blockIdx.x / per];
    u64 first = (blockIdx.x % per) * BLOCK + threadIdx.x;
    i64 least = -1, greatest = -1;
    for (u64 i = first; i < c.len; i += per * BLOCK) {
        if (valid(c, i)) take(c, (i64)i, &least, &greatest);
    }
    block_reduce(c, &least, &greatest);
    if (threadIdx.x == 0) {
        candidates[2 * blockIdx.x] = least;
        candidates[2 * blockIdx.x + 1] = greatest;
    }
}

/* Block k: the least and greatest of column k's 2 * per candidate places (-1 for none) into
   found[k]. */
extern "C" __global__ void extremes_final(const Column* columns, u64 per, const i64* candidates, Found* found) {
    const Column c = columns[blockIdx.x];
    const i64* mine = candidates + 2 * per * blockIdx.x;
    i64 least = -1, greatest = -1;
    for (u64 k = threadIdx.x; k < 2 * per; k += BLOCK) take(c, mine[k], &least, &greatest);
    block_reduce(c, &least, &greatest);
    if (threadIdx.x != 0) return;
    Found* f = found + blockIdx.x;
    f->place[0] = least;
    f->place[1] = greatest;
    for (int w = 0; w < 2; ++w) {
        if (f->place[w] < 0) continue;
        const unsigned char* at;
        u64 len;
        bytes_of(c, (u64)f->place[w], &at, &len);
        f->at[w] = (u64)at;
        f->len[w] = len;
        for (u64 b = 0; b < len && b < INLINE; ++b) f->value[w][b] = at[b];
    }
}
