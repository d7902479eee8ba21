// What the first pass of frames through a channel's ring costs in page faults: 8 KiB copies (the
// size of the small batch's frame) into a fresh 1 MiB memfd mapping, mapped plainly, with
// MAP_POPULATE, and written once beforehand; and a reader's first pass over every page of the
// same memory, mapped plainly and with MAP_POPULATE.
//
//   cc -O2 -o /tmp/first_touch scripts/probes/first_touch.c && /tmp/first_touch
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define SIZE (1 << 20)
#define FRAME 8192
#define FRAMES 120

static double micros(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

// The mean microseconds of one pass of reads over every page of `p`.
static double read_pages(const volatile char *p) {
    double start = micros();
    long sum = 0;
    for (int i = 0; i < SIZE; i += 4096) sum += p[i];
    (void)sum;
    return micros() - start;
}

int main(void) {
    const char *modes[] = {"plain", "MAP_POPULATE", "written first"};
    static char frame[FRAME];
    memset(frame, 7, sizeof frame);
    for (int mode = 0; mode < 3; mode++) {
        int fd = memfd_create("ring", 0);
        if (fd < 0 || ftruncate(fd, SIZE) != 0) return 1;
        char *p = mmap(0, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED | (mode == 1 ? MAP_POPULATE : 0), fd, 0);
        if (p == MAP_FAILED) return 1;
        if (mode == 2) memset(p, 0, SIZE);
        double total = 0, worst = 0;
        for (int i = 0; i < FRAMES; i++) {
            double start = micros();
            memcpy(p + i * FRAME, frame, FRAME);
            double took = micros() - start;
            total += took;
            worst = took > worst ? took : worst;
        }
        char *plain = mmap(0, SIZE, PROT_READ, MAP_SHARED, fd, 0);
        char *populated = mmap(0, SIZE, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (plain == MAP_FAILED || populated == MAP_FAILED) return 1;
        printf("%-13s: 8 KiB copies %.2f us mean, %.1f us worst; a reader's first pass %.1f us plain, %.1f us populated\n",
               modes[mode], total / FRAMES, worst, read_pages(plain), read_pages(populated));
        munmap(p, SIZE);
        munmap(plain, SIZE);
        munmap(populated, SIZE);
        close(fd);
    }
    return 0;
}
