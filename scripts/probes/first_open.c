// What a first open of a region of shared device memory costs in the driver, call by call.
//
// A child process makes 24 shareable allocations of 2 and 64 MiB on device 0 (cuMemCreate) and
// exports each as a POSIX file descriptor; this process takes the descriptors (pidfd_getfd) and
// imports each (cuMemImportFromShareableHandle), reserves addresses for it (cuMemAddressReserve;
// every other region in one range reserved ahead instead), maps it (cuMemMap) and lets the device
// read and write it (cuMemSetAccess), timing each call, then the first write to it.
//
//   nvcc -o /tmp/first_open scripts/probes/first_open.c -lcuda && /tmp/first_open
#include <cuda.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#define N 24
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
#define CK(x) do { CUresult r = (x); if (r) { printf("%s: %d\n", #x, r); exit(1); } } while (0)
int main() {
  int up[2], down[2]; pipe(up); pipe(down);
  size_t sizes[N]; for (int i = 0; i < N; i++) sizes[i] = (i % 3 == 2 ? 64ul : 2ul) << 20;
  pid_t child = fork();
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUcontext ctx; CUdevice dev;
  if (child == 0) {
    CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    int fds[N];
    for (int i = 0; i < N; i++) { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, sizes[i], &prop, 0));
      CK(cuMemExportToShareableHandle(&fds[i], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)); }
    write(up[1], fds, sizeof fds); char c; read(down[0], &c, 1); _exit(0);
  }
  int fds[N]; read(up[0], fds, sizeof fds);
  int pidfd = syscall(434, child, 0);
  double t0 = now();
  CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  printf("init %.0f us\n", now() - t0);
  CUdeviceptr pool; CK(cuMemAddressReserve(&pool, 1ul << 34, 0, 0, 0)); size_t used = 0;
  CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  for (int i = 0; i < N; i++) {
    int fd = syscall(438, pidfd, fds[i], 0);
    CUmemGenericAllocationHandle h; CUdeviceptr p;
    double a = now(); CK(cuMemImportFromShareableHandle(&h, (void*)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    double b = now(); int pooled = i % 2;
    if (pooled) { p = pool + used; used += sizes[i]; } else CK(cuMemAddressReserve(&p, sizes[i], 0, 0, 0));
    double c = now(); CK(cuMemMap(p, sizes[i], 0, h, 0));
    double d = now(); CK(cuMemSetAccess(p, sizes[i], &acc, 1));
    double e = now(); CK(cuMemsetD8(p, 1, 16)); CK(cuCtxSynchronize());
    double f = now();
    printf("%2d %3zu MiB %s: import %6.1f reserve %6.1f map %6.1f access %6.1f | total %6.1f | first touch %6.1f us\n",
           i, sizes[i] >> 20, pooled ? "pooled VA" : "own VA   ", b - a, c - b, d - c, e - d, e - a, f - e);
    close(fd);
  }
  write(down[1], "x", 1); waitpid(child, 0, 0);
}
