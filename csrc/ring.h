/*
 * ringshm ring: a lock-free single-producer / single-consumer ring of variable-length records
 * laid over caller-given memory (a POSIX shared-memory segment in practice).
 *
 * The C code never allocates, prints or exits, and makes no system call but futex(2). Every function
 * returns a status (enum ringshm_status); the Python layer maps it to an exception in one place.
 *
 * Memory layout (offsets in bytes; each line is RINGSHM_LINE = 128 bytes, two 64-byte cache lines so that
 * the adjacent-line prefetcher never couples producer and consumer):
 *
 *   0    +-------------------------------------------------------------+
 *        | config line (written once by init, read-only after)         |
 *        |   magic u64 | version u32 | record_align u32 | capacity u64  |
 *        |   header_bytes u64                                          |
 *   128  +-------------------------------------------------------------+
 *        | producer line: head u64 (atomic) | cached_tail u64          |
 *   256  +-------------------------------------------------------------+
 *        | consumer line: tail u64 (atomic) | cached_head u64          |
 *   384  +-------------------------------------------------------------+
 *        | wait line: data_futex u32 | space_futex u32                 |
 *        |   consumer_parked u32 | producer_parked u32                 |
 *        |   producer_closed u32 | consumer_closed u32                 |
 *        |   producer_pid i32 | consumer_pid i32                       |
 *        |   producer_start u64 | consumer_start u64  (process start   |
 *        |   times, so a reused pid is not taken for the peer)         |
 *   512  +-------------------------------------------------------------+
 *        | data area: capacity bytes (a power of two)                  |
 *        |  [hdr|payload..pad8][hdr|payload..pad8]...[PAD hdr .......] |
 *        +-------------------------------------------------------------+
 *
 * head and tail are 64-bit byte counters that only grow (and wrap modulo 2^64); a position in the data
 * area is counter & (capacity - 1), which is why capacity must be a power of two. 0 <= head - tail <=
 * capacity always holds; a reader that sees otherwise reports RINGSHM_ERR_CORRUPT.
 *
 * Record: an 8-byte header {u32 len, u32 tag} then len payload bytes, padded to RINGSHM_ALIGN (8). A record
 * never wraps: when header + payload does not fit before the end of the data area, the producer writes a
 * PAD header there (it covers everything up to the end) and puts the record at offset 0. The consumer skips
 * PAD records itself, so every record it sees is one contiguous span (zero-copy reads).
 *
 * Record states, as the consumer sees the span [tail, head):
 *
 *   state      | who moves it  | how
 *   -----------+---------------+---------------------------------------------------------------
 *   free       | producer      | try_reserve: space checked against tail (acquire)
 *   reserved   | producer      | bytes written; invisible to the consumer (head not moved)
 *   published  | producer      | commit: header written, then head stored with release
 *   peeked     | consumer      | try_peek: head loaded with acquire, header bounds-checked
 *   free       | consumer      | release: tail stored with release
 *
 * Waiting: a side spins for `spin` iterations, then declares itself parked (seq_cst store), re-checks, and
 * sleeps on its futex word with a timeout. The other side, after publishing, issues a seq_cst fence and only
 * makes the wake system call when it sees the parked flag (Dekker-style: one of the two always sees the
 * other's store). Wait calls return RINGSHM_WOULD_BLOCK when they wake without progress; the caller (Python)
 * owns the deadline and checks the peer's liveness between waits of at most 100 ms.
 */
#ifndef RINGSHM_RING_H
#define RINGSHM_RING_H

#include <stdint.h>

#define RINGSHM_MAGIC 0x31474E4952534852ull /* "RHSRING1" little-endian */
#define RINGSHM_VERSION 1u
#define RINGSHM_LINE 128u
#define RINGSHM_ALIGN 8u
#define RINGSHM_HEADER_BYTES (4u * RINGSHM_LINE)
#define RINGSHM_RECORD_HEADER 8u
#define RINGSHM_TAG_DATA 0x41544144u /* "DATA" */
#define RINGSHM_TAG_PAD 0x44444150u  /* "PADD" */

/* CDEF BEGIN */
enum ringshm_status {
    RINGSHM_OK = 0,
    RINGSHM_WOULD_BLOCK = 1,
    RINGSHM_READY_AFTER_SLEEP = 2, /* wait_*: ready, but only after parking on the futex */
    RINGSHM_ERR_TOO_BIG = -1,
    RINGSHM_ERR_CORRUPT = -2,
    RINGSHM_ERR_BAD_MAGIC = -3,
    RINGSHM_ERR_BAD_VERSION = -4,
    RINGSHM_ERR_BAD_CAPACITY = -5,
    RINGSHM_ERR_STATE = -6,
    RINGSHM_ERR_PEER_CLOSED = -7
};

enum ringshm_role { RINGSHM_PRODUCER = 0, RINGSHM_CONSUMER = 1 };

/* A process-local handle over a mapped ring. Filled by ringshm_ring_open; the capacity is copied out of the
 * shared header once, so a peer that later scribbles on the header cannot widen any bounds check. */
typedef struct ringshm_ring {
    void *base;              /* start of the mapping (the header) */
    uint8_t *data;           /* base + header_bytes */
    uint64_t capacity;       /* data area bytes, power of two */
    uint64_t mask;           /* capacity - 1 */
    uint64_t write_pos;      /* producer: counter of the reserved record (after any pad) */
    uint64_t write_need;     /* producer: bytes reserved (header + payload, aligned); 0 = none */
    uint64_t write_max;      /* producer: payload bytes reserved */
    uint64_t read_need;      /* consumer: bytes of the peeked record; 0 = none */
} ringshm_ring;

/* Bytes a segment needs for a ring of `capacity` data bytes. */
uint64_t ringshm_ring_segment_bytes(uint64_t capacity);

/* Largest payload a ring of `capacity` bytes can ever carry in one record. */
uint64_t ringshm_ring_max_record(uint64_t capacity);

/* Write a fresh header into `mem` (mem_bytes long). Both counters start at `start_index` (tests use values
 * near 2^64 to exercise counter wraparound). capacity: a power of two >= 64. */
int ringshm_ring_init(void *mem, uint64_t mem_bytes, uint64_t capacity, uint64_t start_index);

/* Validate the header in `mem` and fill the local handle. ERR_BAD_MAGIC / ERR_BAD_VERSION /
 * ERR_BAD_CAPACITY when the header is not a ring of this layout that fits in mem_bytes. */
int ringshm_ring_open(ringshm_ring *r, void *mem, uint64_t mem_bytes);

/* Claim one side: record pid and process start time. Returns the pid that holds the side afterwards in
 * *holder (== pid when the claim succeeded or the side already was ours). Never blocks. */
int ringshm_ring_claim(ringshm_ring *r, int role, int32_t pid, uint64_t start_time, int32_t *holder);

/* Read the peer of `role`: its pid (0 = not yet claimed), start time, and whether it closed its side. */
int ringshm_ring_peer(const ringshm_ring *r, int role, int32_t *pid, uint64_t *start_time, int32_t *closed);

/* Mark one side closed and wake the other side if it sleeps. */
int ringshm_ring_close_side(ringshm_ring *r, int role);

/* Producer, phase 1: reserve room for a payload of n bytes. On RINGSHM_OK, *offset is the payload's offset
 * in the data area (contiguous, n bytes writable). RINGSHM_WOULD_BLOCK: not enough free space now (a pad
 * may have been published to make room at offset 0). ERR_TOO_BIG: n > ringshm_ring_max_record.
 * ERR_STATE: a reservation is already open. */
int ringshm_ring_try_reserve(ringshm_ring *r, uint64_t n, uint64_t *offset);

/* Producer, phase 2: publish the first n bytes of the open reservation (n <= reserved). */
int ringshm_ring_commit(ringshm_ring *r, uint64_t n);

/* Consumer, phase 1: the oldest record. On RINGSHM_OK, *offset and *len give its payload in the data area;
 * it stays valid until ringshm_ring_release. RINGSHM_WOULD_BLOCK: empty. ERR_CORRUPT: an index or header
 * failed its bounds checks (nothing outside the data area was read). A peeked record is peeked again. */
int ringshm_ring_try_peek(ringshm_ring *r, uint64_t *offset, uint64_t *len);

/* Consumer, phase 2: free the peeked record. ERR_STATE when nothing is peeked. */
int ringshm_ring_release(ringshm_ring *r);

/* Block until a record (or pad) is readable: spin `spin` iterations, then sleep on the futex for at most
 * timeout_ns (<= 0: do not sleep). RINGSHM_OK: readable while spinning. RINGSHM_READY_AFTER_SLEEP: readable
 * after parking (the caller may shorten its spin: the peer did not answer within it). RINGSHM_WOULD_BLOCK:
 * woke or timed out without data. ERR_PEER_CLOSED: empty and the producer closed its side. */
int ringshm_ring_wait_readable(ringshm_ring *r, int64_t timeout_ns, uint32_t spin);

/* Block until a record with an n-byte payload could be reserved (one pad first, if needed): same rules.
 * ERR_PEER_CLOSED: the consumer closed its side. */
int ringshm_ring_wait_writable(ringshm_ring *r, uint64_t n, int64_t timeout_ns, uint32_t spin);

/* Bytes published and not yet released (head - tail); ERR_CORRUPT through *status if out of bounds. */
uint64_t ringshm_ring_used(const ringshm_ring *r, int *status);
/* CDEF END */

#endif /* RINGSHM_RING_H */
