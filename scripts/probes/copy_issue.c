// What issuing one copy of pinned host memory to the device costs the calling thread: the time
// spent inside cuMemcpyAsync (unified addresses) and cuMemcpyHtoDAsync, for copies of 256 KiB
// (a 1.3 MB batch sent in five copies, as an upload of the small batch sends it), with the
// stream drained after each batch of five and with copies still queued.
//
//   nvcc -O2 -o /tmp/copy_issue scripts/probes/copy_issue.c -lcuda && /tmp/copy_issue
#include "probe.h"

enum { ROUNDS = 2000, DRAIN_EVERY_QUEUED = 8 };

// Issues ROUNDS batches of copies (unified if `unified`), draining the stream every `drain`
// batches; prints the mean time inside the copy calls.
static int run(const char* name, int unified, int drain, CUdeviceptr dev, char* host, CUstream s) {
    const size_t total = 1300000, part = 256 << 10;
    double inside = 0;
    long copies = 0;
    for (int round = 0; round < ROUNDS; round++) {
        for (size_t off = 0; off < total; off += part) {
            double t0 = micros();
            if (unified) {
                CHECK(cuMemcpyAsync(dev + off, (CUdeviceptr)(host + off), part, s));
            } else {
                CHECK(cuMemcpyHtoDAsync(dev + off, host + off, part, s));
            }
            inside += micros() - t0;
            copies++;
        }
        if (round % drain == drain - 1) CHECK(cuStreamSynchronize(s));
    }
    CHECK(cuStreamSynchronize(s));
    printf("%-40s %.2f us per copy (%ld copies)\n", name, inside / copies, copies);
    return 0;
}

int main(void) {
    CUdevice device;
    CUcontext ctx;
    CUstream s;
    CUdeviceptr dev;
    void* host;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&device, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, device));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuMemAlloc(&dev, 2 << 20));
    CHECK(cuMemHostAlloc(&host, 2 << 20, CU_MEMHOSTALLOC_PORTABLE));
    for (int rep = 0; rep < 2; rep++) {
        if (run("cuMemcpyAsync, drained", 1, 1, dev, host, s)) return 1;
        if (run("cuMemcpyHtoDAsync, drained", 0, 1, dev, host, s)) return 1;
        if (run("cuMemcpyAsync, copies queued", 1, DRAIN_EVERY_QUEUED, dev, host, s)) return 1;
        if (run("cuMemcpyHtoDAsync, copies queued", 0, DRAIN_EVERY_QUEUED, dev, host, s)) return 1;
    }
    CHECK(cuMemFreeHost(host));
    CHECK(cuMemFree(dev));
    CHECK(cuStreamDestroy(s));
    CHECK(cuDevicePrimaryCtxRelease(device));
    return 0;
}
