"""Build and install ringshm; the C ring and kernels become the cffi extension ``ringshm._C``."""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "ringshm" / "version.py").read_text())[1]

setup(
    name="ringshm",
    version=VERSION,
    description="Single-host pipeline-parallel LLM inference over lock-free shared-memory rings",
    packages=find_packages(include=["ringshm", "ringshm.*"]),
    python_requires=">=3.10",
    cffi_modules=["csrc/ffi_build.py:ffibuilder"],
    install_requires=[
        # torch is installed by `make install` (pinned CPU build here; left alone where it is already importable).
        "torch>=2.1",
        "numpy>=1.24",
        "cffi>=1.16",
        "posix_ipc>=1.1",
        "tqdm>=4.60",
        "gguf>=0.10",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "transformers>=4.45",
        "fastapi>=0.110",  # ringshm serve: the OpenAI-compatible server
        "uvicorn>=0.29",
        "prometheus_client>=0.20",
        "setproctitle>=1.3",  # readable stage process titles in ps / top
        "psutil>=5.9",  # available memory, checked before the stages start
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-benchmark>=4",
            "hypothesis>=6",
            "accelerate>=0.30",  # transformers' GGUF loading (the oracle)
            "matplotlib>=3.7",  # bench plots
            "openai>=1.30",  # the official client drives the server in tests
        ],
        # bench/bench_peers.py only (`make bench-peers`): compiles llama.cpp from source, never part of `make test`.
        "peers": ["llama-cpp-python>=0.3"],
    },
    entry_points={"console_scripts": ["ringshm=ringshm.cli:main"]},
)
