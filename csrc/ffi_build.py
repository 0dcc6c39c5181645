"""cffi API-mode build of ``ringshm._C``: the cdef comes from the plain C headers in csrc/.

Each header keeps its declarations between ``/* CDEF BEGIN */`` and ``/* CDEF END */`` so that the
same text is what C code includes and what cffi parses (no second copy of the prototypes).
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
MODULES = ["ring", "kernels", "dequant", "matmul", "layer"]  # csrc/<name>.h + csrc/<name>.c each
# Sources without a header of their own: the matmul's packing (declared in matmul.h), the layer's MoE FFN
# (layer_internal.h) and the SIMD loops, one translation unit per ISA level (isa.h).
EXTRA_SOURCES = ["matmul_pack.c", "layer_moe.c", "simd_v1.c", "simd_v3.c", "simd_v4.c", "simd_v4n.c"]


def _cdef_of(header: Path) -> str:
    text = header.read_text()
    begin, end = "/* CDEF BEGIN */", "/* CDEF END */"
    if begin not in text or end not in text:
        raise RuntimeError(f"{header} has no {begin} ... {end} block for cffi")
    return text.split(begin, 1)[1].split(end, 1)[0]


present = [m for m in MODULES if (HERE / f"{m}.h").exists() and (HERE / f"{m}.c").exists()]
ffibuilder = FFI()
ffibuilder.cdef("\n".join(_cdef_of(HERE / f"{m}.h") for m in present))
ffibuilder.set_source(
    "ringshm._C",
    "\n".join(f'#include "{m}.h"' for m in present),
    # setuptools wants source paths relative to setup.py's folder.
    sources=[f"csrc/{m}.c" for m in present] + [f"csrc/{s}" for s in EXTRA_SOURCES],
    include_dirs=["csrc"],
    # Headers and the per-ISA .inc bodies: a change to any of them rebuilds the extension (setuptools only
    # compares the sources' times otherwise, and an edited .inc would leave a stale build).
    depends=sorted(f"csrc/{p.name}" for p in [*HERE.glob("*.h"), *HERE.glob("*.inc")]),
    # No -march: everything is built for the architecture's baseline, and the SIMD files pick their own target
    # per ISA level (csrc/isa.h), so one build runs on any CPU and uses the best path it has (chosen at run
    # time). OpenMP splits a matmul's output rows across the stage's threads.
    extra_compile_args=["-std=gnu11", "-O3", "-fno-strict-aliasing", "-Wall", "-Wno-psabi", "-fopenmp"],
    extra_link_args=["-fopenmp"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
