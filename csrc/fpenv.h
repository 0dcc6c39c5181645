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

#endif /* RINGSHM_FPENV_H */
