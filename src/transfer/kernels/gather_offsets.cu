// Offsets read from device memory at once (see `transfer/offsets.rs`): the sizes of string and
// binary data that a C Device import or a concatenation on the device needs, gathered in one launch.
//
// `reads[i]` is the address of offset `i`, with the top bit set for an 8-byte offset and clear for
// a 4-byte one; `out[i]` receives its value, sign-extended. Then each block sets its flag in
// `done`, once the block's values are visible to the host, which spins on the flags rather than
// synchronising with the stream. All three arrays live in mapped pinned host memory. Offsets are
// read a byte at a time: a producer's buffer need not be aligned.

typedef unsigned long long u64;

extern "C" __global__ void gather_offsets(const u64* reads, long long* out, u64 n, volatile unsigned int* done) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        u64 read = reads[i];
        int width = read >> 63 ? 8 : 4;
        const unsigned char* at = (const unsigned char*)(read & ~(1ull << 63));
        u64 v = 0;
        for (int b = width - 1; b >= 0; --b) {
            v = v << 8 | at[b];
        }
        out[i] = width == 8 ? (long long)v : (long long)(int)v;
    }
    // Every thread's value reaches the host before the block's flag does.
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        done[blockIdx.x] = 1;
    }
}
