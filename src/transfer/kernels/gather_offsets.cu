// Offsets read from device memory at once (see `transfer/offsets.rs`): the sizes of string and
// binary data that a C Device import or a concatenation on the device needs, gathered in one launch.
//
// `reads[i]` is the address of offset `i`, with the top bit set for an 8-byte offset and clear for
// a 4-byte one; `out[i]` receives its value, sign-extended. Both arrays live in mapped pinned host
// memory. Offsets are read a byte at a time: a producer's buffer need not be aligned.

typedef unsigned long long u64;

extern "C" __global__ void gather_offsets(const u64* reads, long long* out, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    u64 read = reads[i];
    int width = read >> 63 ? 8 : 4;
    const unsigned char* at = (const unsigned char*)(read & ~(1ull << 63));
    u64 v = 0;
    for (int b = width - 1; b >= 0; --b) {
        v = v << 8 | at[b];
    }
    out[i] = width == 8 ? (long long)v : (long long)(int)v;
}
