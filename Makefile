# make demo   the main job on its embedded default (sets everything up first)
# make test   all tests: GoogleTest (CTest) and pytest (sets everything up first)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CPP_BUILD := build/cpp
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
SOURCES := $(shell find csrc python -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml

.PHONY: build-cpp demo test test-cpp test-py bench venv install gpu-carry clean

demo: install
	$(VENV)/bin/pimhbm demo

test: test-cpp test-py

venv: $(VENV)/.ready
$(VENV)/.ready: requirements.txt scripts/setup-venv scripts/find-python
	scripts/setup-venv $(VENV)
	touch $@

install: $(VENV)/.installed
$(VENV)/.installed: $(VENV)/.ready $(SOURCES)
	@echo "building and installing pimhbm into $(VENV) ..."
	$(PY) -m pip install -q --no-build-isolation --no-deps .
	touch $@

# The C++ suite is built on its own (CUDA tests compile everywhere and skip without a GPU).
build-cpp: $(VENV)/.ready
	@mkdir -p build
	cmake -S . -B $(CPP_BUILD) $(GENERATOR) -DPIMHBM_BUILD_TESTS=ON -DPIMHBM_BUILD_PYTHON=OFF \
	  -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS) > $(CPP_BUILD).configure.log 2>&1 || \
	  { cat $(CPP_BUILD).configure.log; exit 1; }
	cmake --build $(CPP_BUILD) -j $$(nproc)

test-cpp: build-cpp
	ctest --test-dir $(CPP_BUILD) --output-on-failure -j $$(nproc)

# pytest runs on every core (at most 4) where pytest-xdist is installed and no GPU is visible;
# on a GPU each JAX process takes most of the GPU's memory, so there the tests run one by one.
PYTEST_WORKERS := $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
test-py: install
	@if $(PY) -c 'import xdist' 2>/dev/null && ! nvidia-smi -L >/dev/null 2>&1; then \
	  echo "pytest on $(PYTEST_WORKERS) workers (pytest-xdist)"; \
	  $(PY) -m pytest tests -n $(PYTEST_WORKERS) --dist worksteal; \
	else \
	  $(PY) -m pytest tests; \
	fi

bench: install
	$(PY) bench/scan_bench.py

# GoogleTest sources to take along to a GPU machine that has none (see scripts/gpu-check).
gpu-carry:
	mkdir -p .carry && rm -rf .carry/googletest && cp -r /usr/src/googletest .carry/

clean:
	rm -rf build $(VENV)
