/* The SIMD code built for ISA level x86-64-v3 (see isa.h); empty on other architectures. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(RINGSHM_PORTABLE_ONLY)
#define RINGSHM_ISA_SUFFIX v3
#pragma GCC target("arch=x86-64-v3")
/* GCC's RTL PRE spends minutes on the attention loops' spilled 64-byte vectors below AVX-512 (5 x the
 * build time here); the loops run as fast without it. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#endif
#include "kernels_impl.inc"
#include "kernels_rows.inc"
#include "matmul_impl.inc"
#else
typedef int ringshm_simd_v3_empty; /* ISO C forbids an empty translation unit */
#endif
