// How a C Device import can read a few words scattered in device memory (the end offsets of a
// batch's string columns) fastest: 33 words of 4 bytes at 33 places in one allocation, read into
// pinned host memory by
//   kernel:       one launch of a kernel that gathers them (its addresses in mapped memory) and
//                 sets a flag the host spins on (what `transfer::offsets` does);
//   batch+sync:   one cuMemcpyBatchAsync of 33 copies, then cuStreamSynchronize;
//   batch+spin:   the same, the host spinning until no word holds the sentinel it wrote first;
//   copies+sync:  33 cuMemcpyDtoHAsync, then cuStreamSynchronize.
// Each prints the calling thread's time issuing, and from the start to the host holding the words
// (mean of 2,000, after 200 unmeasured), and checks the words.
//
//   nvcc -O2 -std=c++17 -o /tmp/batched_reads scripts/probes/batched_reads.cu -lcuda && /tmp/batched_reads
#include "probe.h"
#include <cuda_runtime.h>
#include <cstring>

__global__ void gather(const unsigned long long* addrs, unsigned* out, unsigned n, volatile unsigned* flag) {
  unsigned i = threadIdx.x;
  if (i < n) out[i] = *(const unsigned*)addrs[i];
  __syncthreads();
  if (i == 0) {
    __threadfence_system();
    *flag = 1;
  }
}

int main() {
  const unsigned N = 33, ROUNDS = 2000, WARM = 200;
  const size_t BYTES = 1300 * 1024;
  CHECK(cuInit(0));
  cudaFree(0);  // the runtime's primary context, current for the driver calls too
  unsigned* dev;
  cudaMalloc(&dev, BYTES);
  // Word k of the allocation holds k.
  unsigned* init = new unsigned[BYTES / 4];
  for (size_t k = 0; k < BYTES / 4; k++) init[k] = (unsigned)k;
  cudaMemcpy(dev, init, BYTES, cudaMemcpyHostToDevice);
  unsigned long long *addrs, *addrs_d;
  unsigned *out, *out_d, *flag, *flag_d;
  cudaHostAlloc(&addrs, N * 8, cudaHostAllocMapped);
  cudaHostAlloc(&out, N * 4, cudaHostAllocMapped);
  cudaHostAlloc(&flag, 4, cudaHostAllocMapped);
  cudaHostGetDevicePointer(&addrs_d, addrs, 0);
  cudaHostGetDevicePointer(&out_d, out, 0);
  cudaHostGetDevicePointer(&flag_d, flag, 0);
  size_t word[N];
  CUdeviceptr dsts[N], srcs[N];
  size_t sizes[N];
  for (unsigned i = 0; i < N; i++) {
    word[i] = (i * 9973 + 17) % (BYTES / 4);
    addrs[i] = (unsigned long long)(dev + word[i]);
    srcs[i] = (CUdeviceptr)(dev + word[i]);
    dsts[i] = (CUdeviceptr)(out + i);
    sizes[i] = 4;
  }
  CUmemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  size_t attr_idx = 0;
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  CUstream s = (CUstream)st;
  const char* names[4] = {"kernel", "batch+sync", "batch+spin", "copies+sync"};
  for (int way = 0; way < 4; way++) {
    double issue = 0, total = 0;
    int wrong = 0;
    for (unsigned r = 0; r < ROUNDS + WARM; r++) {
      for (unsigned i = 0; i < N; i++) out[i] = 0xFFFFFFFFu;
      *(volatile unsigned*)flag = 0;
      double t0 = micros();
      if (way == 0) {
        gather<<<1, 64, 0, st>>>(addrs_d, out_d, N, flag_d);
      } else if (way == 3) {
        for (unsigned i = 0; i < N; i++) CHECK(cuMemcpyDtoHAsync(out + i, srcs[i], 4, s));
      } else {
#if CUDA_VERSION >= 13000
        CHECK(cuMemcpyBatchAsync(dsts, srcs, sizes, N, &attr, &attr_idx, 1, s));
#else
        size_t failed;
        CHECK(cuMemcpyBatchAsync(dsts, srcs, sizes, N, &attr, &attr_idx, 1, &failed, s));
#endif
      }
      double t1 = micros();
      if (way == 0) {
        while (*(volatile unsigned*)flag == 0) {}
      } else if (way == 2) {
        for (unsigned i = 0; i < N; i++)
          while (((volatile unsigned*)out)[i] == 0xFFFFFFFFu) {}
      } else {
        CHECK(cuStreamSynchronize(s));
      }
      double t2 = micros();
      if (r >= WARM) {
        issue += t1 - t0;
        total += t2 - t0;
      }
      for (unsigned i = 0; i < N; i++) wrong += out[i] != word[i];
    }
    CHECK(cuStreamSynchronize(s));
    printf("%-12s issue %5.2f us, words on the host %5.2f us after the start (mean of %u)%s\n", names[way],
           issue / ROUNDS, total / ROUNDS, ROUNDS, wrong ? " WRONG WORDS" : "");
  }
  cudaError_t e = cudaGetLastError();
  printf("%s\n", e == cudaSuccess ? "no error" : cudaGetErrorString(e));
  return 0;
}
