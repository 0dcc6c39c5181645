/* The SIMD code built for the compiler's baseline ISA (see isa.h): the portable path, on every CPU. */
#define RINGSHM_ISA_SUFFIX v1
/* GCC's RTL PRE spends minutes on the attention loops' spilled 64-byte vectors below AVX-512 (5 x the
 * build time here); the loops run as fast without it. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#endif
#include "kernels_impl.inc"
#include "kernels_rows.inc"
#include "matmul_impl.inc"
