// What splitting a small upload into several copies costs: 1.3 MB of pinned host memory copied to
// device memory in one copy, or in k pieces issued back to back on one stream (the device's time
// between events around them, the host's time to issue them and to see them done), then the time
// from issuing one copy of 4 KiB to 1.3 MB to seeing it done.
//
//   nvcc -O2 -o /tmp/split_copies scripts/probes/split_copies.cu && /tmp/split_copies
#include <cuda_runtime.h>
#include <cstdio>
#include <chrono>
int main() {
  const size_t N = 1300 * 1024;
  char *pin, *dev; cudaHostAlloc(&pin, N, 0); cudaMalloc(&dev, N);
  cudaStream_t st; cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int round = 0; round < 2; round++)
  for (int k : {1, 2, 3, 5, 10, 20, 40}) {
    size_t piece = (N + k - 1) / k;
    float gpu = 0; double host = 0, issue = 0; int reps = 200;
    for (int r = 0; r < reps; r++) {
      auto t0 = std::chrono::steady_clock::now();
      cudaEventRecord(a, st);
      for (size_t off = 0; off < N; off += piece) cudaMemcpyAsync(dev + off, pin + off, off + piece > N ? N - off : piece, cudaMemcpyHostToDevice, st);
      auto t1 = std::chrono::steady_clock::now();
      cudaEventRecord(b, st); cudaEventSynchronize(b);
      auto t2 = std::chrono::steady_clock::now();
      float ms; cudaEventElapsedTime(&ms, a, b); gpu += ms * 1000;
      host += std::chrono::duration<double, std::micro>(t2 - t0).count();
      issue += std::chrono::duration<double, std::micro>(t1 - t0).count();
    }
    printf("round %d: %2d pieces of %7zu B: gpu %.1f us, host %.1f us, issue %.1f us\n", round, k, piece, gpu / reps, host / reps, issue / reps);
  }
  // Latency of one copy of 64 KB and 256 KB issued at a known time, polled to the end.
  for (size_t n : {4096ul, 65536ul, 262144ul, N}) {
    double t = 0; int reps = 500;
    for (int r = 0; r < reps; r++) {
      auto t0 = std::chrono::steady_clock::now();
      cudaMemcpyAsync(dev, pin, n, cudaMemcpyHostToDevice, st); cudaEventRecord(b, st);
      while (cudaEventQuery(b) != cudaSuccess) {}
      t += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    printf("one copy of %7zu B, issue to seen done: %.1f us\n", n, t / reps);
  }
}
