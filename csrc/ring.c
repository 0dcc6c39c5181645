/* ringshm ring: see ring.h for the layout, the record states and the waiting protocol. */
#define _GNU_SOURCE
#include "ring.h"

#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct ring_header {
    /* config line: written by init, read once by open */
    uint64_t magic;
    uint32_t version;
    uint32_t record_align;
    uint64_t capacity;
    uint64_t header_bytes;
    uint8_t pad_config[RINGSHM_LINE - 32];
    /* producer line */
    _Atomic uint64_t head;
    _Atomic uint64_t cached_tail; /* producer's last view of tail; only the producer writes it */
    uint8_t pad_producer[RINGSHM_LINE - 16];
    /* consumer line */
    _Atomic uint64_t tail;
    _Atomic uint64_t cached_head; /* consumer's last view of head; only the consumer writes it */
    uint8_t pad_consumer[RINGSHM_LINE - 16];
    /* wait line: futex words, parked flags, liveness */
    _Atomic uint32_t data_futex;
    _Atomic uint32_t space_futex;
    _Atomic uint32_t consumer_parked;
    _Atomic uint32_t producer_parked;
    _Atomic uint32_t producer_closed;
    _Atomic uint32_t consumer_closed;
    _Atomic int32_t producer_pid;
    _Atomic int32_t consumer_pid;
    _Atomic uint64_t producer_start;
    _Atomic uint64_t consumer_start;
    uint8_t pad_wait[RINGSHM_LINE - 48];
} ring_header;

_Static_assert(sizeof(ring_header) == RINGSHM_HEADER_BYTES, "header is four lines");
_Static_assert(offsetof(ring_header, head) == 1 * RINGSHM_LINE, "head starts the producer line");
_Static_assert(offsetof(ring_header, tail) == 2 * RINGSHM_LINE, "tail starts the consumer line");
_Static_assert(offsetof(ring_header, data_futex) == 3 * RINGSHM_LINE, "futex words start the wait line");
_Static_assert(offsetof(ring_header, producer_start) % 8 == 0, "64-bit fields are aligned");
_Static_assert(sizeof(_Atomic uint64_t) == 8 && ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics are lock-free");
_Static_assert(sizeof(_Atomic uint32_t) == 4 && ATOMIC_INT_LOCK_FREE == 2, "futex words are plain 32-bit");
_Static_assert(RINGSHM_RECORD_HEADER == RINGSHM_ALIGN, "a record header is one alignment unit");

#define HDR(r) ((ring_header *)(r)->base)
#define MIN_CAPACITY 64u

static inline uint64_t align_up(uint64_t n) { return (n + RINGSHM_ALIGN - 1) & ~(uint64_t)(RINGSHM_ALIGN - 1); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wait(_Atomic uint32_t *word, uint32_t expected, int64_t timeout_ns) {
    struct timespec ts = {.tv_sec = timeout_ns / 1000000000, .tv_nsec = timeout_ns % 1000000000};
    /* Shared (not FUTEX_PRIVATE) because the word lives in memory mapped by two processes. Any return
     * (woken, timed out, EAGAIN because the word moved, EINTR) sends the caller back to re-check. */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Called by the side that just made progress. The seq_cst fence pairs with the sleeper's seq_cst store of
 * its parked flag: either the sleeper's re-check sees our progress, or we see its flag and wake it. */
static inline void notify(_Atomic uint32_t *parked, _Atomic uint32_t *word) {
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(parked, memory_order_seq_cst)) {
        atomic_fetch_add_explicit(word, 1, memory_order_seq_cst);
        futex_wake(word);
    }
}

uint64_t ringshm_ring_segment_bytes(uint64_t capacity) { return RINGSHM_HEADER_BYTES + capacity; }

uint64_t ringshm_ring_max_record(uint64_t capacity) {
    uint64_t max = capacity - RINGSHM_RECORD_HEADER;
    return max > UINT32_MAX ? UINT32_MAX : max;
}

static int capacity_ok(uint64_t capacity, uint64_t mem_bytes) {
    return capacity >= MIN_CAPACITY && (capacity & (capacity - 1)) == 0 && mem_bytes >= RINGSHM_HEADER_BYTES &&
           capacity <= mem_bytes - RINGSHM_HEADER_BYTES;
}

int ringshm_ring_init(void *mem, uint64_t mem_bytes, uint64_t capacity, uint64_t start_index) {
    if (!capacity_ok(capacity, mem_bytes)) return RINGSHM_ERR_BAD_CAPACITY;
    start_index = align_up(start_index);
    ring_header *h = mem;
    h->magic = 0; /* an attacher that races init sees a bad magic, never a half-written header */
    h->version = RINGSHM_VERSION;
    h->record_align = RINGSHM_ALIGN;
    h->capacity = capacity;
    h->header_bytes = RINGSHM_HEADER_BYTES;
    atomic_store_explicit(&h->head, start_index, memory_order_relaxed);
    atomic_store_explicit(&h->cached_tail, start_index, memory_order_relaxed);
    atomic_store_explicit(&h->tail, start_index, memory_order_relaxed);
    atomic_store_explicit(&h->cached_head, start_index, memory_order_relaxed);
    atomic_store_explicit(&h->data_futex, 0, memory_order_relaxed);
    atomic_store_explicit(&h->space_futex, 0, memory_order_relaxed);
    atomic_store_explicit(&h->consumer_parked, 0, memory_order_relaxed);
    atomic_store_explicit(&h->producer_parked, 0, memory_order_relaxed);
    atomic_store_explicit(&h->producer_closed, 0, memory_order_relaxed);
    atomic_store_explicit(&h->consumer_closed, 0, memory_order_relaxed);
    atomic_store_explicit(&h->producer_pid, 0, memory_order_relaxed);
    atomic_store_explicit(&h->consumer_pid, 0, memory_order_relaxed);
    atomic_store_explicit(&h->producer_start, 0, memory_order_relaxed);
    atomic_store_explicit(&h->consumer_start, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    *(volatile uint64_t *)&h->magic = RINGSHM_MAGIC;
    return RINGSHM_OK;
}

int ringshm_ring_open(ringshm_ring *r, void *mem, uint64_t mem_bytes) {
    if (mem_bytes < RINGSHM_HEADER_BYTES) return RINGSHM_ERR_BAD_CAPACITY;
    const volatile ring_header *h = mem;
    uint64_t magic = h->magic;
    atomic_thread_fence(memory_order_acquire);
    if (magic != RINGSHM_MAGIC) return RINGSHM_ERR_BAD_MAGIC;
    if (h->version != RINGSHM_VERSION || h->record_align != RINGSHM_ALIGN || h->header_bytes != RINGSHM_HEADER_BYTES)
        return RINGSHM_ERR_BAD_VERSION;
    uint64_t capacity = h->capacity; /* read once: every later bound uses this local copy */
    if (!capacity_ok(capacity, mem_bytes)) return RINGSHM_ERR_BAD_CAPACITY;
    r->base = mem;
    r->data = (uint8_t *)mem + RINGSHM_HEADER_BYTES;
    r->capacity = capacity;
    r->mask = capacity - 1;
    r->write_pos = r->write_need = r->write_max = r->read_need = 0;
    return RINGSHM_OK;
}

int ringshm_ring_claim(ringshm_ring *r, int role, int32_t pid, uint64_t start_time, int32_t *holder) {
    ring_header *h = HDR(r);
    _Atomic int32_t *slot = role == RINGSHM_PRODUCER ? &h->producer_pid : &h->consumer_pid;
    _Atomic uint64_t *start = role == RINGSHM_PRODUCER ? &h->producer_start : &h->consumer_start;
    if (role != RINGSHM_PRODUCER && role != RINGSHM_CONSUMER) return RINGSHM_ERR_STATE;
    int32_t expected = 0;
    if (atomic_compare_exchange_strong(slot, &expected, pid) || expected == pid) {
        atomic_store(start, start_time);
        *holder = pid;
    } else {
        *holder = expected;
    }
    return RINGSHM_OK;
}

int ringshm_ring_peer(const ringshm_ring *r, int role, int32_t *pid, uint64_t *start_time, int32_t *closed) {
    ring_header *h = HDR(r);
    if (role == RINGSHM_PRODUCER) {
        *pid = atomic_load(&h->producer_pid);
        *start_time = atomic_load(&h->producer_start);
        *closed = (int32_t)atomic_load(&h->producer_closed);
    } else if (role == RINGSHM_CONSUMER) {
        *pid = atomic_load(&h->consumer_pid);
        *start_time = atomic_load(&h->consumer_start);
        *closed = (int32_t)atomic_load(&h->consumer_closed);
    } else {
        return RINGSHM_ERR_STATE;
    }
    return RINGSHM_OK;
}

int ringshm_ring_close_side(ringshm_ring *r, int role) {
    ring_header *h = HDR(r);
    if (role == RINGSHM_PRODUCER)
        atomic_store(&h->producer_closed, 1);
    else if (role == RINGSHM_CONSUMER)
        atomic_store(&h->consumer_closed, 1);
    else
        return RINGSHM_ERR_STATE;
    atomic_fetch_add(&h->data_futex, 1);
    atomic_fetch_add(&h->space_futex, 1);
    futex_wake(&h->data_futex);
    futex_wake(&h->space_futex);
    return RINGSHM_OK;
}

/* Free bytes seen from the producer, reloading tail when the cached copy says there is not enough.
 * Returns ERR_CORRUPT when head - tail is out of bounds. */
static int producer_free(ringshm_ring *r, uint64_t head, uint64_t want, uint64_t *free_bytes) {
    ring_header *h = HDR(r);
    uint64_t used = head - atomic_load_explicit(&h->cached_tail, memory_order_relaxed);
    if (used <= r->capacity && r->capacity - used >= want) {
        *free_bytes = r->capacity - used;
        return RINGSHM_OK;
    }
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_acquire);
    used = head - tail;
    if (used > r->capacity || (used & (RINGSHM_ALIGN - 1))) return RINGSHM_ERR_CORRUPT;
    atomic_store_explicit(&h->cached_tail, tail, memory_order_relaxed);
    *free_bytes = r->capacity - used;
    return RINGSHM_OK;
}

/* Where a record of `need` bytes goes when head is at `off`: pad bytes to skip first (0 when it fits). */
static inline uint64_t pad_before(const ringshm_ring *r, uint64_t off, uint64_t need) {
    return off + need > r->capacity ? r->capacity - off : 0;
}

static inline void write_record_header(ringshm_ring *r, uint64_t off, uint32_t len, uint32_t tag) {
    uint32_t *rec = (uint32_t *)(r->data + off);
    rec[0] = len;
    rec[1] = tag;
}

int ringshm_ring_try_reserve(ringshm_ring *r, uint64_t n, uint64_t *offset) {
    ring_header *h = HDR(r);
    if (r->write_need) return RINGSHM_ERR_STATE;
    if (n > ringshm_ring_max_record(r->capacity)) return RINGSHM_ERR_TOO_BIG;
    uint64_t head = atomic_load_explicit(&h->head, memory_order_relaxed);
    if (head & (RINGSHM_ALIGN - 1)) return RINGSHM_ERR_CORRUPT;
    uint64_t need = align_up(RINGSHM_RECORD_HEADER + n);
    uint64_t off = head & r->mask;
    uint64_t pad = pad_before(r, off, need);
    uint64_t free_bytes;
    int st = producer_free(r, head, pad + need, &free_bytes);
    if (st != RINGSHM_OK) return st;
    if (free_bytes < pad + need) {
        if (pad && free_bytes >= pad) {
            /* Publish the pad alone so the consumer can skip it and free the whole ring for this record. */
            write_record_header(r, off, (uint32_t)(pad - RINGSHM_RECORD_HEADER), RINGSHM_TAG_PAD);
            atomic_store_explicit(&h->head, head + pad, memory_order_release);
            notify(&h->consumer_parked, &h->data_futex);
        }
        return RINGSHM_WOULD_BLOCK;
    }
    if (pad) {
        /* Written now, published together with the record by commit's release store of head. */
        write_record_header(r, off, (uint32_t)(pad - RINGSHM_RECORD_HEADER), RINGSHM_TAG_PAD);
        head += pad;
        off = 0;
    }
    r->write_pos = head;
    r->write_need = need;
    r->write_max = n;
    *offset = off + RINGSHM_RECORD_HEADER;
    return RINGSHM_OK;
}

int ringshm_ring_commit(ringshm_ring *r, uint64_t n) {
    ring_header *h = HDR(r);
    if (!r->write_need || n > r->write_max) return RINGSHM_ERR_STATE;
    write_record_header(r, r->write_pos & r->mask, (uint32_t)n, RINGSHM_TAG_DATA);
    atomic_store_explicit(&h->head, r->write_pos + align_up(RINGSHM_RECORD_HEADER + n), memory_order_release);
    r->write_need = 0;
    notify(&h->consumer_parked, &h->data_futex);
    return RINGSHM_OK;
}

int ringshm_ring_try_peek(ringshm_ring *r, uint64_t *offset, uint64_t *len) {
    ring_header *h = HDR(r);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    if (tail & (RINGSHM_ALIGN - 1)) return RINGSHM_ERR_CORRUPT;
    for (;;) {
        uint64_t head = atomic_load_explicit(&h->cached_head, memory_order_relaxed);
        uint64_t avail = head - tail;
        if (avail == 0 || avail > r->capacity) {
            head = atomic_load_explicit(&h->head, memory_order_acquire);
            atomic_store_explicit(&h->cached_head, head, memory_order_relaxed);
            avail = head - tail;
        }
        if (avail == 0) return RINGSHM_WOULD_BLOCK;
        if (avail > r->capacity || (avail & (RINGSHM_ALIGN - 1))) return RINGSHM_ERR_CORRUPT;
        uint64_t off = tail & r->mask;
        /* One 8-byte read of the record header; validate the local copy (the peer may rewrite it). */
        uint64_t word = *(const volatile uint64_t *)(r->data + off);
        uint32_t rec_len = (uint32_t)(word & 0xffffffffu), tag = (uint32_t)(word >> 32);
        if (tag == RINGSHM_TAG_PAD) {
            uint64_t pad = r->capacity - off;
            if (avail < pad) return RINGSHM_ERR_CORRUPT;
            tail += pad;
            atomic_store_explicit(&h->tail, tail, memory_order_release);
            notify(&h->producer_parked, &h->space_futex);
            continue;
        }
        if (tag != RINGSHM_TAG_DATA) return RINGSHM_ERR_CORRUPT;
        if (rec_len > r->capacity - off - RINGSHM_RECORD_HEADER) return RINGSHM_ERR_CORRUPT;
        uint64_t need = align_up(RINGSHM_RECORD_HEADER + rec_len);
        if (need > avail) return RINGSHM_ERR_CORRUPT;
        r->read_need = need;
        *offset = off + RINGSHM_RECORD_HEADER;
        *len = rec_len;
        return RINGSHM_OK;
    }
}

int ringshm_ring_release(ringshm_ring *r) {
    ring_header *h = HDR(r);
    if (!r->read_need) return RINGSHM_ERR_STATE;
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    atomic_store_explicit(&h->tail, tail + r->read_need, memory_order_release);
    r->read_need = 0;
    notify(&h->producer_parked, &h->space_futex);
    return RINGSHM_OK;
}

static inline int readable(ring_header *h, uint64_t tail) {
    return atomic_load_explicit(&h->head, memory_order_seq_cst) != tail;
}

int ringshm_ring_wait_readable(ringshm_ring *r, int64_t timeout_ns, uint32_t spin) {
    ring_header *h = HDR(r);
    uint64_t tail = atomic_load_explicit(&h->tail, memory_order_relaxed);
    for (uint32_t i = 0; i < spin; i++) {
        if (atomic_load_explicit(&h->head, memory_order_acquire) != tail) return RINGSHM_OK;
        cpu_relax();
    }
    uint32_t seen = atomic_load_explicit(&h->data_futex, memory_order_seq_cst);
    atomic_store_explicit(&h->consumer_parked, 1, memory_order_seq_cst);
    int st = RINGSHM_WOULD_BLOCK;
    if (readable(h, tail))
        st = RINGSHM_READY_AFTER_SLEEP;
    else if (atomic_load(&h->producer_closed))
        st = RINGSHM_ERR_PEER_CLOSED;
    else if (timeout_ns > 0) {
        futex_wait(&h->data_futex, seen, timeout_ns);
        if (readable(h, tail)) st = RINGSHM_READY_AFTER_SLEEP;
    }
    atomic_store_explicit(&h->consumer_parked, 0, memory_order_relaxed);
    return st;
}

/* Bytes that must be free before try_reserve(n) makes progress (the pad alone when one is needed). */
static int space_wanted(ringshm_ring *r, uint64_t n, uint64_t *head_out, uint64_t *want) {
    if (n > ringshm_ring_max_record(r->capacity)) return RINGSHM_ERR_TOO_BIG;
    uint64_t head = atomic_load_explicit(&HDR(r)->head, memory_order_relaxed);
    uint64_t need = align_up(RINGSHM_RECORD_HEADER + n);
    uint64_t pad = pad_before(r, head & r->mask, need);
    *head_out = head;
    *want = pad ? pad : need;
    return RINGSHM_OK;
}

/* RINGSHM_OK when `want` bytes are free, RINGSHM_WOULD_BLOCK when not, ERR_CORRUPT when out of bounds. */
static int space_state(ringshm_ring *r, uint64_t head, uint64_t want) {
    uint64_t used = head - atomic_load_explicit(&HDR(r)->tail, memory_order_seq_cst);
    if (used > r->capacity) return RINGSHM_ERR_CORRUPT;
    return r->capacity - used >= want ? RINGSHM_OK : RINGSHM_WOULD_BLOCK;
}

int ringshm_ring_wait_writable(ringshm_ring *r, uint64_t n, int64_t timeout_ns, uint32_t spin) {
    ring_header *h = HDR(r);
    uint64_t head, want;
    int st = space_wanted(r, n, &head, &want);
    if (st != RINGSHM_OK) return st;
    if (atomic_load(&h->consumer_closed)) return RINGSHM_ERR_PEER_CLOSED;
    for (uint32_t i = 0; i < spin; i++) {
        if ((st = space_state(r, head, want)) != RINGSHM_WOULD_BLOCK) return st;
        cpu_relax();
    }
    uint32_t seen = atomic_load_explicit(&h->space_futex, memory_order_seq_cst);
    atomic_store_explicit(&h->producer_parked, 1, memory_order_seq_cst);
    st = space_state(r, head, want);
    if (st == RINGSHM_WOULD_BLOCK) {
        if (atomic_load(&h->consumer_closed)) {
            st = RINGSHM_ERR_PEER_CLOSED;
        } else if (timeout_ns > 0) {
            futex_wait(&h->space_futex, seen, timeout_ns);
            st = space_state(r, head, want);
        }
    }
    atomic_store_explicit(&h->producer_parked, 0, memory_order_relaxed);
    return st == RINGSHM_OK ? RINGSHM_READY_AFTER_SLEEP : st;
}

uint64_t ringshm_ring_used(const ringshm_ring *r, int *status) {
    ring_header *h = HDR(r);
    uint64_t used = atomic_load(&h->head) - atomic_load(&h->tail);
    *status = used > r->capacity ? RINGSHM_ERR_CORRUPT : RINGSHM_OK;
    return used;
}
