/* The floating-point mode of the calling thread (x86: MXCSR's flush-to-zero, denormals-are-zero and rounding
 * bits; elsewhere the C fenv). OpenMP pool workers keep their own: a parallel kernel copies the caller's into
 * each worker for the region, so a row's bits never depend on which thread computed it. */
#ifndef RINGSHM_FPENV_H
#define RINGSHM_FPENV_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned fpenv_t;
#define FPENV_GET(e) ((e) = _mm_getcsr())
#define FPENV_SET(e) _mm_setcsr(e)
#else
#include <fenv.h>
typedef fenv_t fpenv_t;
#define FPENV_GET(e) fegetenv(&(e))
#define FPENV_SET(e) fesetenv(&(e))
#endif

/* First and last statements of an OpenMP parallel region's body: run it in `caller`'s FP mode (captured with
 * FPENV_GET before the region), then give the worker its own back. */
#define FPENV_WORKER_BEGIN(caller)                                                                              \
    fpenv_t fpenv_worker_saved_;                                                                               \
    FPENV_GET(fpenv_worker_saved_);                                                                            \
    FPENV_SET(caller)
#define FPENV_WORKER_END() FPENV_SET(fpenv_worker_saved_)

#include <stdint.h>

/* fn(ctx, lo, hi) over the items [0, total) on nt OpenMP threads, each thread in the caller's FP mode (FTZ / DAZ /
 * rounding are per thread and pool workers keep theirs: a row's bits must not depend on which thread computed
 * it). dynamic 0: nt contiguous parts, one a thread; 1: one item at a time to whichever thread is free. nt <= 1
 * (or no OpenMP): all of it on the calling thread. Defined in csrc/matmul.c. */
void ringshm_parallel_in_caller_mode(int nt, int64_t total, int dynamic, void (*fn)(const void *, int64_t, int64_t),
                                     const void *ctx);

#endif /* RINGSHM_FPENV_H */
