// Whether a small upload split into pieces gets to the device sooner when the pieces alternate
// between two streams (two copy engines, each setting up its copy while the other moves bytes)
// than when they follow each other on one stream. 1.3 MB of pinned host memory to device memory
// in k pieces: the host's time from the first issue until it sees the last piece done (spinning
// on an event), and the device's time between events around the copies.
//
//   nvcc -O2 -o /tmp/two_stream_copies scripts/probes/two_stream_copies.cu && /tmp/two_stream_copies
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
int main() {
  const size_t N = 1300 * 1024;
  char *pin, *dev;
  cudaHostAlloc(&pin, N, 0);
  cudaMalloc(&dev, N);
  cudaStream_t s[2];
  for (auto &x : s) cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking);
  cudaEvent_t a, b, joined;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
  for (int round = 0; round < 3; round++)
    for (int streams : {1, 2})
      for (int k : {1, 2, 3, 5, 10}) {
        if (streams == 2 && k == 1) continue;
        size_t piece = (N + k - 1) / k;
        double host = 0;
        float gpu = 0;
        const int reps = 300;
        for (int r = 0; r < reps; r++) {
          auto t0 = std::chrono::steady_clock::now();
          cudaEventRecord(a, s[0]);
          if (streams == 2) cudaStreamWaitEvent(s[1], a, 0);
          int i = 0;
          for (size_t off = 0; off < N; off += piece, i++)
            cudaMemcpyAsync(dev + off, pin + off, off + piece > N ? N - off : piece, cudaMemcpyHostToDevice,
                            s[i % streams]);
          if (streams == 2) {
            cudaEventRecord(joined, s[1]);
            cudaStreamWaitEvent(s[0], joined, 0);
          }
          cudaEventRecord(b, s[0]);
          while (cudaEventQuery(b) != cudaSuccess) {
          }
          host += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
          float ms;
          cudaEventElapsedTime(&ms, a, b);
          gpu += ms * 1000;
        }
        printf("round %d: %d stream(s), %2d pieces of %7zu B: host %.1f us, device %.1f us\n", round, streams, k,
               piece, host / reps, gpu / reps);
      }
}
