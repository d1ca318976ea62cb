/*
 * Attaches to a device or view of a running `bulkhead serve`, writes a block, reads it back,
 * and times 4 KiB reads at queue depth 1.
 *
 *   cargo build --release -p bulkhead-capi
 *   cc -O2 -Icrates/capi/include examples/attach.c -Ltarget/release -lbulkhead -o attach-c
 *   LD_LIBRARY_PATH=target/release ./attach-c /run/bulkhead disk0
 */
#include <bulkhead.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s RUN_DIR NAME [READS]\n", argv[0]);
        return 2;
    }
    int reads = argc > 3 ? atoi(argv[3]) : 10000;
    if (reads < 1)
        reads = 1;
    int err = 0;
    bulkhead_device *dev = bulkhead_attach(argv[1], argv[2], 1, &err);
    if (!dev) {
        fprintf(stderr, "attach %s: %s (%s)\n", argv[2], bulkhead_last_error(), strerror(-err));
        return 1;
    }
    uint64_t size = bulkhead_size(dev);
    printf("attached to %s: %llu bytes, read-only: %d\n", argv[2], (unsigned long long)size, bulkhead_read_only(dev));

    static unsigned char block[4096], back[4096];
    for (int i = 0; i < 4096; i++)
        block[i] = (unsigned char)(i * 7 + 3);
    if (!bulkhead_read_only(dev)) {
        int rc = bulkhead_write(dev, 0, block, sizeof block, 0, BULKHEAD_FUA);
        if (rc == 0)
            rc = bulkhead_read(dev, 0, back, sizeof back, 0);
        if (rc != 0 || memcmp(block, back, sizeof block) != 0) {
            fprintf(stderr, "write and read back: %s\n", rc ? bulkhead_last_error() : "data differs");
            bulkhead_detach(dev);
            return 1;
        }
        printf("wrote and read back 4 KiB at offset 0\n");
    }

    uint64_t *lat = malloc(sizeof *lat * (size_t)reads);
    uint64_t x = 0x9e3779b97f4a7c15u, blocks = size / 4096;
    for (int i = 0; i < reads; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint64_t t = now_ns();
        if (bulkhead_read(dev, 0, back, sizeof back, (x % blocks) * 4096) != 0) {
            fprintf(stderr, "read: %s\n", bulkhead_last_error());
            free(lat);
            bulkhead_detach(dev);
            return 1;
        }
        lat[i] = now_ns() - t;
    }
    qsort(lat, (size_t)reads, sizeof *lat, cmp);
    printf("%d reads of 4 KiB at QD1: p50 %.2f us, p99 %.2f us\n", reads, lat[(reads - 1) / 2] / 1000.0,
           lat[(int)((reads - 1) * 0.99)] / 1000.0);
    free(lat);
    bulkhead_detach(dev);
    return 0;
}
