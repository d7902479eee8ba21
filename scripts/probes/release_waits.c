// Whether letting device memory go waits for a copy still queued on it: a copy out of the memory,
// queued behind 8 GiB of other copies, then the memory let go of (cuMemFree of cuMemAlloc memory;
// cuIpcCloseMemHandle of a mapping of another process's memory), then the stream synchronised.
// Both wait (the copy is done when they return, and the stream finishes without a fault);
// cuMemUnmap does not, which `regions_dropped_with_a_copy_queued_wait_for_it` in
// src/memory/shared_device.rs shows.
//
//   nvcc -O2 -o /tmp/release_waits scripts/probes/release_waits.c -lcuda &&
//   (/tmp/release_waits export & sleep 2; /tmp/release_waits open; wait)
#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define CHECK(x)                                              \
    do {                                                      \
        CUresult r_ = (x);                                    \
        if (r_ != CUDA_SUCCESS) {                             \
            const char *name_;                                \
            cuGetErrorName(r_, &name_);                       \
            printf("%s failed: %s\n", #x, name_);             \
            return 1;                                         \
        }                                                     \
    } while (0)

#define SIZE (2 << 20)
#define BUSY (1ul << 30)
#define HANDLE_FILE "/tmp/release_waits.handle"

// Queues 8 GiB of copies from `a` to `b`, then a copy out of `m`; lets `m` go with `release`; says
// whether the copy was queued before and after, and how the stream's synchronisation ended.
static int probe(const char *what, CUdeviceptr m, CUresult (*release)(CUdeviceptr), CUdeviceptr a,
                 CUdeviceptr b, CUdeviceptr out, CUstream s) {
    for (int i = 0; i < 8; i++) CHECK(cuMemcpyAsync(b, a, BUSY, s));
    CHECK(cuMemcpyAsync(out, m, SIZE, s));
    int before = cuStreamQuery(s) == CUDA_ERROR_NOT_READY;
    CHECK(release(m));
    int after = cuStreamQuery(s) == CUDA_ERROR_NOT_READY;
    CUresult r = cuStreamSynchronize(s);
    const char *name;
    cuGetErrorName(r, &name);
    printf("%-20s: queued before %d, still queued after %d, synchronise: %s\n", what, before, after, name);
    return r != CUDA_SUCCESS;
}

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    CUdevice d;
    CUcontext c;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&d, 0));
    CHECK(cuDevicePrimaryCtxRetain(&c, d));
    CHECK(cuCtxSetCurrent(c));
    if (!strcmp(argv[1], "export")) {
        CUdeviceptr p;
        CUipcMemHandle h;
        CHECK(cuMemAlloc(&p, SIZE));
        CHECK(cuMemsetD8(p, 7, SIZE));
        CHECK(cuIpcGetMemHandle(&h, p));
        FILE *f = fopen(HANDLE_FILE, "wb");
        if (!f || fwrite(&h, sizeof h, 1, f) != 1) return 1;
        fclose(f);
        sleep(8);
        return 0;
    }
    CUipcMemHandle h;
    FILE *f = fopen(HANDLE_FILE, "rb");
    if (!f || fread(&h, sizeof h, 1, f) != 1) return 1;
    fclose(f);
    CUstream s;
    CUdeviceptr a, b, out;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&a, BUSY));
    CHECK(cuMemAlloc(&b, BUSY));
    CHECK(cuMemAlloc(&out, SIZE));
    int failed = 0;
    for (int round = 0; round < 3; round++) {
        CUdeviceptr m;
        CHECK(cuIpcOpenMemHandle(&m, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
        failed |= probe("cuIpcCloseMemHandle", m, cuIpcCloseMemHandle, a, b, out, s);
        CHECK(cuMemAlloc(&m, SIZE));
        failed |= probe("cuMemFree", m, cuMemFree, a, b, out, s);
    }
    return failed;
}
