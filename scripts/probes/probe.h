// What the C probes share: a check of each driver call, and a clock in microseconds.
#include <cuda.h>
#include <stdio.h>
#include <time.h>

// Prints the call that failed and returns 1 from the enclosing function.
#define CHECK(x)                                              \
    do {                                                      \
        CUresult r = (x);                                     \
        if (r != CUDA_SUCCESS) {                              \
            printf("%s failed: %d\n", #x, (int)r);            \
            return 1;                                         \
        }                                                     \
    } while (0)

// CLOCK_MONOTONIC in microseconds.
static double micros(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
