// The value at a rank of a sort order, found on the device by radix selection (see
// `stage/narrow.rs`): the first rows of an `ORDER BY ... LIMIT k` over a stage's groups.
//
// A row's key is its value (a 4, 8 or 16-byte signed integer: integers, dates, decimals)
// sign-extended to 128 bits with the sign bit flipped, so that unsigned order is the values'
// order, and complemented for an ascending order: the first rows of the order hold the largest
// keys. Null rows have no key.

typedef unsigned long long u64;
typedef unsigned __int128 u128;

__device__ u128 top_key(const void* values, u64 width, u64 i, u64 ascending) {
    __int128 v;
    if (width == 4) {
        v = ((const int*)values)[i];
    } else if (width == 8) {
        v = ((const long long*)values)[i];
    } else {
        v = ((const __int128*)values)[i];
    }
    u128 k = (u128)v ^ ((u128)1 << 127);
    return ascending ? ~k : k;
}

__device__ bool top_valid(const unsigned char* validity, u64 i) {
    return validity == 0 || ((validity[i >> 3] >> (i & 7)) & 1);
}

// The bitwise AND (`bounds[0]` high word, `bounds[1]` low word, set to all ones before) and OR
// (`bounds[2]`, `bounds[3]`, zero before) of the keys of rows `offset .. offset + n`: the bits
// where they agree are shared by every key.
extern "C" __global__ void top_bounds(const void* values, u64 width, const unsigned char* validity, u64 offset,
                                      u64 n, u64 ascending, u64* bounds) {
    u64 and_hi = ~0ull, and_lo = ~0ull, or_hi = 0, or_lo = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (!top_valid(validity, offset + i)) {
            continue;
        }
        u128 k = top_key(values, width, offset + i, ascending);
        and_hi &= (u64)(k >> 64);
        and_lo &= (u64)k;
        or_hi |= (u64)(k >> 64);
        or_lo |= (u64)k;
    }
    for (int d = 16; d > 0; d >>= 1) {
        and_hi &= __shfl_xor_sync(0xffffffffu, and_hi, d);
        and_lo &= __shfl_xor_sync(0xffffffffu, and_lo, d);
        or_hi |= __shfl_xor_sync(0xffffffffu, or_hi, d);
        or_lo |= __shfl_xor_sync(0xffffffffu, or_lo, d);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAnd(&bounds[0], and_hi);
        atomicAnd(&bounds[1], and_lo);
        atomicOr(&bounds[2], or_hi);
        atomicOr(&bounds[3], or_lo);
    }
}

// Counts, for each value of the 8-bit digit at bit `shift`, the rows whose key equals `prefix`
// on the bits of `mask` (`hist`: 256 counters, zero before).
extern "C" __global__ void top_histogram(const void* values, u64 width, const unsigned char* validity, u64 offset,
                                         u64 n, u64 ascending, u64 prefix_hi, u64 prefix_lo, u64 mask_hi,
                                         u64 mask_lo, u64 shift, unsigned int* hist) {
    __shared__ unsigned int local[256];
    for (unsigned b = threadIdx.x; b < 256; b += blockDim.x) {
        local[b] = 0;
    }
    __syncthreads();
    u128 prefix = ((u128)prefix_hi << 64) | prefix_lo;
    u128 mask = ((u128)mask_hi << 64) | mask_lo;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        if (!top_valid(validity, offset + i)) {
            continue;
        }
        u128 k = top_key(values, width, offset + i, ascending);
        if ((k & mask) == prefix) {
            atomicAdd(&local[(unsigned)(k >> shift) & 255u], 1u);
        }
    }
    __syncthreads();
    for (unsigned b = threadIdx.x; b < 256; b += blockDim.x) {
        if (local[b] != 0) {
            atomicAdd(&hist[b], local[b]);
        }
    }
}
