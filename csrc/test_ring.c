/* C-only ring test, built by `make test-c` with -fsanitize=address,undefined.
 * Unit checks of the index arithmetic, then a two-thread stress: the producer sends records of random
 * sizes carrying a sequence number and a checksum; the consumer checks that nothing is lost, torn,
 * duplicated or reordered, across many wraps and with counters started just below 2^64. */
#include "ring.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

static uint64_t mix(uint64_t x) { /* splitmix64 */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fill(uint8_t *p, uint64_t n, uint64_t seq) {
    for (uint64_t i = 0; i < n; i++) p[i] = (uint8_t)mix(seq * 131 + i);
}

static int verify(const uint8_t *p, uint64_t n, uint64_t seq) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] != (uint8_t)mix(seq * 131 + i)) return 0;
    return 1;
}

static void unit_checks(void) {
    const uint64_t cap = 256;
    uint64_t bytes = ringshm_ring_segment_bytes(cap);
    void *mem = aligned_alloc(128, bytes);
    ringshm_ring r;
    uint64_t off, len;
    CHECK(ringshm_ring_init(mem, bytes, 100, 0) == RINGSHM_ERR_BAD_CAPACITY); /* not a power of two */
    CHECK(ringshm_ring_init(mem, bytes - 1, cap, 0) == RINGSHM_ERR_BAD_CAPACITY); /* does not fit */
    CHECK(ringshm_ring_init(mem, bytes, cap, UINT64_MAX - 200) == RINGSHM_OK);
    CHECK(ringshm_ring_open(&r, mem, bytes) == RINGSHM_OK);
    CHECK(ringshm_ring_try_peek(&r, &off, &len) == RINGSHM_WOULD_BLOCK);
    CHECK(ringshm_ring_release(&r) == RINGSHM_ERR_STATE);
    CHECK(ringshm_ring_commit(&r, 0) == RINGSHM_ERR_STATE);
    CHECK(ringshm_ring_try_reserve(&r, cap, &off) == RINGSHM_ERR_TOO_BIG);
    /* exact fit: one record that fills the whole data area. The counters start at offset 56, so the
     * producer first publishes a 200-byte pad, the consumer skips it, and the record lands at offset 0. */
    CHECK(ringshm_ring_try_reserve(&r, cap - 8, &off) == RINGSHM_WOULD_BLOCK);
    CHECK(ringshm_ring_try_peek(&r, &off, &len) == RINGSHM_WOULD_BLOCK);
    CHECK(ringshm_ring_try_reserve(&r, cap - 8, &off) == RINGSHM_OK);
    CHECK(off == 8);
    fill(r.data + off, cap - 8, 1);
    CHECK(ringshm_ring_commit(&r, cap - 8) == RINGSHM_OK);
    CHECK(ringshm_ring_try_reserve(&r, 0, &off) == RINGSHM_WOULD_BLOCK); /* full */
    CHECK(ringshm_ring_try_peek(&r, &off, &len) == RINGSHM_OK);
    CHECK(len == cap - 8 && verify(r.data + off, len, 1));
    CHECK(ringshm_ring_release(&r) == RINGSHM_OK);
    /* many small records across the 2^64 wrap of the counters */
    for (uint64_t seq = 0; seq < 1000; seq++) {
        uint64_t n = mix(seq) % 60;
        CHECK(ringshm_ring_try_reserve(&r, n, &off) == RINGSHM_OK);
        fill(r.data + off, n, seq);
        CHECK(ringshm_ring_commit(&r, n) == RINGSHM_OK);
        CHECK(ringshm_ring_try_peek(&r, &off, &len) == RINGSHM_OK);
        CHECK(len == n && verify(r.data + off, n, seq));
        CHECK(ringshm_ring_release(&r) == RINGSHM_OK);
    }
    /* a corrupted record tag is reported, not followed */
    CHECK(ringshm_ring_try_reserve(&r, 16, &off) == RINGSHM_OK);
    CHECK(ringshm_ring_commit(&r, 16) == RINGSHM_OK);
    ((uint32_t *)(r.data + off - 8))[1] = 0xdeadbeef;
    CHECK(ringshm_ring_try_peek(&r, &off, &len) == RINGSHM_ERR_CORRUPT);
    /* bad magic */
    ((uint64_t *)mem)[0] ^= 1;
    CHECK(ringshm_ring_open(&r, mem, bytes) == RINGSHM_ERR_BAD_MAGIC);
    free(mem);
}

enum { N_RECORDS = 200000, MAX_PAYLOAD = 3000 };
static ringshm_ring ring;

static void *producer(void *arg) {
    (void)arg;
    for (uint64_t seq = 0; seq < N_RECORDS; seq++) {
        uint64_t n = 16 + mix(seq ^ 0xabc) % (MAX_PAYLOAD - 16), off;
        int st;
        while ((st = ringshm_ring_try_reserve(&ring, n, &off)) == RINGSHM_WOULD_BLOCK)
            CHECK(ringshm_ring_wait_writable(&ring, n, 1000000, 64) >= 0);
        CHECK(st == RINGSHM_OK);
        memcpy(ring.data + off, &seq, 8);
        fill(ring.data + off + 8, n - 8, seq);
        CHECK(ringshm_ring_commit(&ring, n) == RINGSHM_OK);
    }
    return NULL;
}

static void *consumer(void *arg) {
    (void)arg;
    for (uint64_t seq = 0; seq < N_RECORDS; seq++) {
        uint64_t off, len, got;
        int st;
        while ((st = ringshm_ring_try_peek(&ring, &off, &len)) == RINGSHM_WOULD_BLOCK)
            CHECK(ringshm_ring_wait_readable(&ring, 1000000, 64) >= 0);
        CHECK(st == RINGSHM_OK);
        memcpy(&got, ring.data + off, 8);
        CHECK(got == seq);
        CHECK(len == 16 + mix(seq ^ 0xabc) % (MAX_PAYLOAD - 16));
        CHECK(verify(ring.data + off + 8, len - 8, seq));
        CHECK(ringshm_ring_release(&ring) == RINGSHM_OK);
    }
    return NULL;
}

int main(void) {
    unit_checks();
    const uint64_t cap = 16384;
    uint64_t bytes = ringshm_ring_segment_bytes(cap);
    void *mem = aligned_alloc(128, bytes);
    CHECK(ringshm_ring_init(mem, bytes, cap, UINT64_MAX - 50000) == RINGSHM_OK);
    CHECK(ringshm_ring_open(&ring, mem, bytes) == RINGSHM_OK);
    pthread_t p, c;
    CHECK(pthread_create(&c, NULL, consumer, NULL) == 0);
    CHECK(pthread_create(&p, NULL, producer, NULL) == 0);
    CHECK(pthread_join(p, NULL) == 0 && pthread_join(c, NULL) == 0);
    free(mem);
    printf("test_ring: unit checks and %d-record two-thread stress passed\n", N_RECORDS);
    return 0;
}
