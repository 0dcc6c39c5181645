"""Build and install ringshm; the C ring and kernels become the cffi extension ``ringshm._C``."""

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """build_ext that compiles the sources of one extension at once, one compiler process per core.

    ``ringshm._C`` is one extension of ten translation units, and setuptools compiles an extension's sources one
    after another (its ``--parallel`` runs several extensions at once, not the units of one). Three units hold
    nearly all the work: the SIMD code built once per ISA level (csrc/simd_v1.c, v3, v4: 100-160 s each on this
    2-vCPU VM, the attention kernels most of it). Here the compiler's own steps (distutils'
    ``CCompiler.compile``: ``_setup_compile``, ``_get_cc_args``, ``_compile``) run for every unit from a thread
    pool, the largest units first; ``--parallel N`` (``-j N``) sets the jobs, default the usable cores.
    Measured: the README's opening (the build's times).
    """

    def build_extension(self, ext):
        compiler = self.compiler
        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 0 else len(
            os.sched_getaffinity(0))

        def compile_all(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                        extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            todo = sorted((obj for obj in objects if obj in build), key=lambda obj: -_cost(build[obj][0]))
            with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
                for done in [pool.submit(compiler._compile, obj, *build[obj], cc_args, extra_postargs, pp_opts)
                             for obj in todo]:
                    done.result()  # the first compile error, as the serial loop would raise it
            return objects

        compiler.compile = compile_all
        super().build_extension(ext)


def _cost(source: str) -> int:
    """A unit's size with the .inc files it includes: the SIMD units (simd_v*.c) sort first."""
    text = Path(source).read_text(errors="replace")
    return len(text) + sum(Path(source).with_name(inc).stat().st_size
                           for inc in re.findall(r'#include "([\w.]+\.inc)"', text)
                           if Path(source).with_name(inc).exists())

VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "ringshm" / "version.py").read_text())[1]

setup(
    name="ringshm",
    version=VERSION,
    description="Single-host pipeline-parallel LLM inference over lock-free shared-memory rings",
    packages=find_packages(include=["ringshm", "ringshm.*"]),
    python_requires=">=3.10",
    cffi_modules=["csrc/ffi_build.py:ffibuilder"],
    cmdclass={"build_ext": ParallelBuildExt},  # cffi wraps it (its generated source first, then this)
    install_requires=[
        # torch is installed by `make install` (pinned CPU build here; left alone where it is already importable).
        "torch>=2.1",
        "numpy>=1.24",
        "cffi>=1.16",
        "posix_ipc>=1.1",
        "tqdm>=4.60",
        "gguf>=0.18",  # MXFP4 (GGMLQuantizationType 39: gpt-oss's experts), read at import by ringshm.model.dequant
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "transformers>=4.45",
        "fastapi>=0.110",  # ringshm serve: the OpenAI-compatible server
        "uvicorn>=0.29",
        "prometheus_client>=0.20",
        "setproctitle>=1.3",  # readable stage process titles in ps / top
        "psutil>=5.9",  # available memory, checked before the stages start
        "llguidance>=1.2,<2",  # structured output: JSON schema / regex / grammar -> allowed-token masks
        "jsonschema>=4.18",  # a structured output's schema is checked against its meta-schema first
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-benchmark>=4",
            "pytest-xdist>=3",  # make test runs the files on 2 workers
            "hypothesis>=6",
            "accelerate>=0.30",  # transformers' GGUF loading (the oracle)
            "matplotlib>=3.7",  # bench plots
            "openai>=1.30",  # the official client drives the server in tests
            "aiohttp>=3.9",  # bench/serving_load.py's closed-loop HTTP clients
        ],
        # bench/bench_peers.py only (`make bench-peers`): compiles llama.cpp from source, never part of `make test`.
        "peers": ["llama-cpp-python>=0.3"],
    },
    entry_points={"console_scripts": ["ringshm=ringshm.cli:main"]},
)
