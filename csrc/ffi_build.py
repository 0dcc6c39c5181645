"""cffi API-mode build of ``ringshm._C``: the cdef comes from the plain C headers in csrc/.

Each header keeps its declarations between ``/* CDEF BEGIN */`` and ``/* CDEF END */`` so that the
same text is what C code includes and what cffi parses (no second copy of the prototypes).
"""

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
MODULES = ["ring", "kernels", "dequant"]  # csrc/<name>.h + csrc/<name>.c each


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
    sources=[f"csrc/{m}.c" for m in present],
    include_dirs=["csrc"],
    # Built in place on the machine that runs it (make install), so -march=native is safe.
    extra_compile_args=["-std=gnu11", "-O3", "-march=native", "-fno-strict-aliasing", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
