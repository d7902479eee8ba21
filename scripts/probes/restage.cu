// Why packing a small upload's staging is slow, and what makes it faster: 1.3 MB copied from a hot
// host buffer into pinned staging by 1, 4 or 8 threads (each a contiguous share, spinning between
// fills), timed per fill, with the staging last (a) written, no DMA since, (b) read by a DMA to the
// device, (c) read by a DMA and then written once by another thread, (d) read by a DMA and filled
// with non-temporal stores; then, each after a DMA, with each thread's share of the source, of the
// staging or of both moving to the next thread at every fill (last written by another core), as
// parts handed to whichever thread is free move.
//
//   nvcc -O2 -std=c++17 -o /tmp/restage scripts/probes/restage.cu && /tmp/restage
#include <cuda_runtime.h>
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <algorithm>
#include <vector>

static const size_t N = 1300 * 1024;
static char *src, *pin, *dev;

static void nt_copy(char *d, const char *s, size_t n) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
  memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

struct Pool {
  int n;
  std::atomic<int> go{0}, done{0};
  std::atomic<bool> stop{false};
  int mode = 0;  // 0 memcpy, 1 non-temporal, 2 memset (re-touch)
  int src_shift = 0, dst_shift = 0;  // shares of the source and staging, moved by this many threads
  std::vector<std::thread> threads;
  explicit Pool(int n) : n(n) {
    for (int t = 0; t < n; t++)
      threads.emplace_back([this, t] {
        int seen = 0;
        while (true) {
          int g;
          while ((g = go.load()) == seen && !stop.load()) _mm_pause();
          if (stop.load()) return;
          seen = g;
          size_t share = (N + this->n - 1) / this->n;
          size_t at = ((t + dst_shift) % this->n) * share, from = ((t + src_shift) % this->n) * share;
          size_t len = std::min(share, std::min(N - at, N - from));
          if (mode == 0) memcpy(pin + at, src + from, len);
          else if (mode == 1) nt_copy(pin + at, src + at, len);
          else memset(pin + at, 0, len);
          done.fetch_add(1);
        }
      });
  }
  double run(int m) {
    mode = m;
    done.store(0);
    auto t0 = std::chrono::steady_clock::now();
    go.fetch_add(1);
    while (done.load() < n) _mm_pause();
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  ~Pool() {
    stop.store(true);
    for (auto &t : threads) t.join();
  }
};

int main() {
  src = (char *)malloc(N);
  memset(src, 7, N);
  cudaHostAlloc(&pin, N, 0);
  cudaMalloc(&dev, N);
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  auto dma = [&] {
    cudaMemcpyAsync(dev, pin, N, cudaMemcpyHostToDevice, st);
    cudaStreamSynchronize(st);
  };
  Pool other(1);
  for (int round = 0; round < 2; round++)
    for (int threads : {1, 4, 8}) {
      Pool p(threads);
      const char *names[] = {"(a) no DMA since written", "(b) after a DMA", "(c) after a DMA, re-written by another thread",
                             "(d) after a DMA, non-temporal stores"};
      for (int c = 0; c < 4; c++) {
        double t = 0, retouch = 0;
        const int reps = 200;
        for (int r = 0; r < reps; r++) {
          p.run(0);
          if (c > 0) dma();
          if (c == 2) retouch += other.run(2);
          t += p.run(c == 3 ? 1 : 0);
        }
        printf("round %d, %d thread(s): %-48s fill %.1f us", round, threads, names[c], t / reps);
        if (c == 2) printf(" (the re-write %.1f us)", retouch / reps);
        printf("\n");
      }
      if (threads == 1) continue;
      const char *moved[] = {"source moved", "staging moved", "both moved"};
      for (int c = 0; c < 3; c++) {
        double t = 0;
        const int reps = 200;
        for (int r = 0; r < reps; r++) {
          p.src_shift = c != 1 ? r : 0;
          p.dst_shift = c != 0 ? r : 0;
          dma();
          t += p.run(0);
        }
        p.src_shift = p.dst_shift = 0;
        printf("round %d, %d thread(s): after a DMA, %-30s fill %.1f us\n", round, threads, moved[c], t / reps);
      }
    }
}
