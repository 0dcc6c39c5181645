/* The 8-bit-activation loops (matmul_q8.inc) built a second time for x86-64-v4 with AVX-512 VNNI (vpdpbusd: four
 * u8 x s8 products summed into each int32 lane in one instruction, where the v4 copy takes vpmaddubsw + vpmaddwd +
 * vpaddd; exact integers both ways, the same bits) and VBMI (one byte permute turns 4 rows of 16 bytes into 16
 * lanes of 4). Chosen at run time where the CPU has both (matmul.c: AMD Zen 4 / 5, Intel Ice Lake and later;
 * Cascade Lake's VNNI without VBMI takes the v4 copy); empty on other architectures. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(RINGSHM_PORTABLE_ONLY)
#define RINGSHM_ISA_SUFFIX v4n
#define RINGSHM_Q8_ONLY
#pragma GCC target("arch=x86-64-v4,avx512vnni,avx512vbmi")
#include "matmul_impl.inc"
#else
typedef int ringshm_simd_v4n_empty; /* ISO C forbids an empty translation unit */
#endif
