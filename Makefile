# make demo   the main job on its embedded default (sets everything up first)
# make test   all tests: GoogleTest (CTest; also of a build without CUDA) and pytest (sets
#             everything up first)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CPP_BUILD := build/cpp
CPP_CPU_BUILD := build/cpp-cpu
GENERATOR := $(shell command -v ninja >/dev/null 2>&1 && echo "-G Ninja")
SOURCES := $(shell find csrc python -type f -not -path '*/__pycache__/*') CMakeLists.txt pyproject.toml

.PHONY: build-cpp build-cpp-cpu demo test test-cpp ctest-cpp test-cpp-cpu test-py bench venv install \
  gpu-carry clean

demo: install
	$(VENV)/bin/pimhbm demo

test: test-cpp test-py

venv: $(VENV)/.ready
$(VENV)/.ready: requirements.txt scripts/setup-venv scripts/find-python
	scripts/setup-venv $(VENV)
	touch $@

# pip without -q: its build line and spinner show that the minutes of compiling are going on.
install: $(VENV)/.installed
$(VENV)/.installed: $(VENV)/.ready $(SOURCES)
	@echo "setup: [3/3] building the package into $(VENV) (C++, and CUDA kernels for sm_80 and" \
	  "sm_90 where a CUDA toolkit is found; a few minutes)"
	$(PY) -m pip install --no-build-isolation --no-deps .
	touch $@

# The C++ suite is built on its own (CUDA tests compile everywhere and skip without a GPU).
build-cpp: $(VENV)/.ready
	@mkdir -p build
	@echo "test: building the C++ suite in $(CPP_BUILD) (with CUDA where a toolkit is found)"
	cmake -S . -B $(CPP_BUILD) $(GENERATOR) -DPIMHBM_BUILD_TESTS=ON -DPIMHBM_BUILD_PYTHON=OFF \
	  -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS) > $(CPP_BUILD).configure.log 2>&1 || \
	  { cat $(CPP_BUILD).configure.log; exit 1; }
	cmake --build $(CPP_BUILD) -j $$(nproc)

# Both builds of the C++ suite: the default one (with CUDA where a toolkit is found) and the
# one without CUDA.
test-cpp: ctest-cpp test-cpp-cpu

ctest-cpp: build-cpp
	ctest --test-dir $(CPP_BUILD) --output-on-failure -j $$(nproc)

# The same sources built without CUDA (-DPIMHBM_CUDA=OFF), as on a machine without a toolkit:
# the library, its C++ tests, and the Python module, which then runs the update's and the
# scan's Python tests (on JAX's CPU platform, on every core where pytest-xdist is installed)
# from a copy of the package beside it.
build-cpp-cpu: $(VENV)/.ready
	@mkdir -p build
	@echo "test: building the C++ suite and the Python module without CUDA in $(CPP_CPU_BUILD)"
	cmake -S . -B $(CPP_CPU_BUILD) $(GENERATOR) -DPIMHBM_CUDA=OFF -DPIMHBM_BUILD_TESTS=ON \
	  -DPIMHBM_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_BUILD_TYPE=Release \
	  $(CMAKE_ARGS) > $(CPP_CPU_BUILD).configure.log 2>&1 || \
	  { cat $(CPP_CPU_BUILD).configure.log; exit 1; }
	cmake --build $(CPP_CPU_BUILD) -j $$(nproc)

test-cpp-cpu: build-cpp-cpu
	ctest --test-dir $(CPP_CPU_BUILD) --output-on-failure -j $$(nproc)
	rm -rf $(CPP_CPU_BUILD)/python && mkdir -p $(CPP_CPU_BUILD)/python
	cp -r python/pimhbm $(CPP_CPU_BUILD)/python/ && cp $(CPP_CPU_BUILD)/_core*.so $(CPP_CPU_BUILD)/python/pimhbm/
	PYTHONPATH=$(abspath $(CPP_CPU_BUILD)/python) $(PY) -c \
	  'import pimhbm, sys; print("pimhbm built without CUDA:", pimhbm.__file__); sys.exit(pimhbm._core.with_cuda)'
	JAX_PLATFORMS=cpu PYTHONPATH=$(abspath $(CPP_CPU_BUILD)/python) $(PY) -m pytest -q \
	  -p no:cacheprovider $$($(PY) -c 'import xdist' 2>/dev/null && printf -- '-n %s' \
	  $(PYTEST_WORKERS)) tests/test_update.py tests/test_scan.py

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
