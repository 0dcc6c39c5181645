/* The SIMD code built for ISA level x86-64-v4 (see isa.h); empty on other architectures. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(RINGSHM_PORTABLE_ONLY)
#define RINGSHM_ISA_SUFFIX v4
#pragma GCC target("arch=x86-64-v4")
#include "kernels_impl.inc"
#include "kernels_rows.inc"
#include "matmul_impl.inc"
#else
typedef int ringshm_simd_v4_empty; /* ISO C forbids an empty translation unit */
#endif
