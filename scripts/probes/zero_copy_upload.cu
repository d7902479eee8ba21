// Whether a kernel that reads pinned staging over the link (zero-copy) can carry a small upload
// faster than copies: 1.3 MB packed by four host threads in parts of 64 KiB from pageable memory
// into pinned staging, then
//   copies:     the main thread issues a copy of each run of at least 256 KiB packed, in order, and
//               of the rest at the end, records an event and polls it (what an upload does);
//   persistent: a kernel launched before the packing starts, one block per part, each block waiting
//               for its part's flag in mapped memory, copying the part and counting it done; the
//               last block sets a flag the host spins on;
//   after:      the same kernel launched once every part is packed;
// each timed from the start of the packing (the persistent kernel's launch included) to the host
// seeing the bytes on the device. Also the kernel alone on staging packed long before, and one copy
// of it. The argument is the number of blocks per part (1 if none).
//
//   nvcc -O2 -std=c++17 -o /tmp/zero_copy_upload scripts/probes/zero_copy_upload.cu && /tmp/zero_copy_upload 1
#include "probe.h"
#include <cuda_runtime.h>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

__global__ void copy_parts(const uint4* staging, uint4* dev, const volatile unsigned* ready, unsigned gen,
                           unsigned long long part, unsigned long long n, unsigned* count, volatile unsigned* done) {
  // `k` blocks per part (gridDim.x / parts), each copying every k-th run of 4 x 16 bytes per thread.
  unsigned parts = (unsigned)((n + part - 1) / part), k = gridDim.x / parts;
  unsigned p = blockIdx.x / k, sub = blockIdx.x % k;
  if (threadIdx.x == 0) {
    while (ready[p] != gen) {
    }
  }
  __syncthreads();
  __threadfence_system();
  unsigned long long start = p * part / 16, end = min((p + 1) * part, n) / 16;
  unsigned long long b = blockDim.x, stride = b * k * 4;
  for (unsigned long long i = start + sub * b * 4 + threadIdx.x; i < end; i += stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = i + j * b < end ? staging[i + j * b] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 4; j++)
      if (i + j * b < end) dev[i + j * b] = v[j];
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(count, 1) == gridDim.x - 1) {
      *count = 0;
      __threadfence_system();
      *done = gen;
    }
  }
}

int main(int argc, char** argv) {
  const unsigned K = argc > 1 ? atoi(argv[1]) : 1;
  const size_t N = 1300 * 1024, PART = 64 << 10, SEND_MIN = 256 << 10;
  const unsigned PARTS = (N + PART - 1) / PART, THREADS = 4;
  std::vector<char> src(N);
  for (size_t i = 0; i < N; i++) src[i] = (char)(i * 7);
  char *staging, *dev;
  unsigned *ready, *done, *count;
  cudaHostAlloc(&staging, N, cudaHostAllocMapped);
  cudaHostAlloc(&ready, PARTS * 4, cudaHostAllocMapped);
  cudaHostAlloc(&done, 4, cudaHostAllocMapped);
  memset(ready, 0, PARTS * 4);
  *done = 0;
  cudaMalloc(&dev, N);
  cudaMalloc(&count, 4);
  cudaMemset(count, 0, 4);
  char *staging_d;
  unsigned *ready_d, *done_d;
  cudaHostGetDevicePointer(&staging_d, staging, 0);
  cudaHostGetDevicePointer(&ready_d, ready, 0);
  cudaHostGetDevicePointer(&done_d, done, 0);
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  // Packers: take parts in order, pack each, publish its flag.
  std::atomic<unsigned> next{0}, go{0};
  std::atomic<bool> quit{false};
  std::vector<std::atomic<unsigned>> packed(PARTS);
  std::atomic<unsigned> finished{0};
  std::vector<std::thread> crew;
  for (unsigned t = 0; t < THREADS; t++)
    crew.emplace_back([&] {
      unsigned seen = 0;
      while (!quit.load()) {
        unsigned g = go.load(std::memory_order_acquire);
        if (g == seen) continue;
        seen = g;
        for (unsigned p; (p = next.fetch_add(1)) < PARTS;) {
          size_t off = p * PART, len = std::min(PART, N - off);
          memcpy(staging + off, src.data() + off, len);
          packed[p].store(g, std::memory_order_release);
          ((volatile unsigned*)ready)[p] = g;
        }
        finished.fetch_add(1, std::memory_order_acq_rel);
      }
    });
  auto pack = [&](unsigned g) {
    finished.store(0);
    next.store(0);
    go.store(g, std::memory_order_release);
  };
  auto packed_all = [&] { while (finished.load(std::memory_order_acquire) < THREADS) {} };
  auto run_kernel = [&](unsigned g) {
    copy_parts<<<PARTS * K, 256, 0, st>>>((const uint4*)staging_d, (uint4*)dev, ready_d, g, PART, N, count, done_d);
  };
  auto wait_done = [&](unsigned g) { while (((volatile unsigned*)done)[0] != g) {} };
  const int REPS = 300;
  double t_copies = 0, t_persistent = 0, t_after = 0, t_kernel = 0, t_dma = 0, n_copies = 0;
  unsigned g = 0;
  for (int round = 0; round < 2; round++) {
    t_copies = t_persistent = t_after = t_kernel = t_dma = n_copies = 0;
    for (int r = 0; r < REPS; r++) {
      // copies
      g++;
      double t0 = micros();
      pack(g);
      unsigned sent = 0;
      while (sent < PARTS) {
        unsigned upto = sent;
        while (upto < PARTS && packed[upto].load(std::memory_order_acquire) == g) upto++;
        size_t from = sent * PART, to = std::min((size_t)upto * PART, N);
        if (upto > sent && (to - from >= SEND_MIN || upto == PARTS)) {
          cudaMemcpyAsync(dev + from, staging + from, to - from, cudaMemcpyHostToDevice, st);
          n_copies++;
          sent = upto;
        }
      }
      cudaEventRecord(ev, st);
      while (cudaEventQuery(ev) != cudaSuccess) {}
      t_copies += micros() - t0;
      packed_all();
      // persistent kernel
      g++;
      t0 = micros();
      run_kernel(g);
      pack(g);
      wait_done(g);
      t_persistent += micros() - t0;
      packed_all();
      cudaStreamSynchronize(st);
      // kernel after the packing
      g++;
      t0 = micros();
      pack(g);
      packed_all();
      run_kernel(g);
      wait_done(g);
      t_after += micros() - t0;
      cudaStreamSynchronize(st);
      // the kernel alone (staging packed long before, flags set)
      g++;
      for (unsigned p = 0; p < PARTS; p++) ready[p] = g;
      t0 = micros();
      run_kernel(g);
      wait_done(g);
      t_kernel += micros() - t0;
      cudaStreamSynchronize(st);
      // one copy of the packed staging
      t0 = micros();
      cudaMemcpyAsync(dev, staging, N, cudaMemcpyHostToDevice, st);
      cudaEventRecord(ev, st);
      while (cudaEventQuery(ev) != cudaSuccess) {}
      t_dma += micros() - t0;
    }
    printf("K=%u round %d (1.3 MB, %u parts, %u packing threads): copies %.1f us (%.1f copies), persistent kernel %.1f us, "
           "kernel after packing %.1f us, kernel alone %.1f us, one copy alone %.1f us\n",
           K, round, PARTS, THREADS, t_copies / REPS, n_copies / REPS, t_persistent / REPS, t_after / REPS, t_kernel / REPS, t_dma / REPS);
  }
  std::vector<char> back(N);
  cudaMemcpy(back.data(), dev, N, cudaMemcpyDeviceToHost);
  printf("bytes on the device %s; %s\n", memcmp(back.data(), src.data(), N) ? "DIFFER" : "match",
         cudaGetErrorString(cudaGetLastError()));
  quit.store(true);
  for (auto& t : crew) t.join();
}
