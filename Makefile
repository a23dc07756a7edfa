# hypershard developer entry points. Every target works from a fresh clone:
#
#   make demo    set up (Debian packages, .venv, pinned deps, build), then run the demo
#   make test    set up, then the format check, the C++ tests (plain, sanitized, fuzzed), the Python unit tests,
#                level0 and level1
#
# `setup` is idempotent and incremental: packages are installed only when missing, the pinned
# requirements only when requirements.txt changed, the extension rebuilt only when its sources
# changed (scikit-build-core keeps its CMake build folder under build/).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON3      ?= python3
JOBS         ?= 2
VENV         := .venv
VENV_BIN     := $(CURDIR)/$(VENV)/bin
PY           := $(VENV_BIN)/python
# clang and libclang-rt-14-dev (ASan, UBSan, libFuzzer) for test-sanitize and test-fuzz; llvm
# for llvm-symbolizer (readable sanitizer reports).
APT_PACKAGES := g++ libgtest-dev ccache clang libclang-rt-14-dev llvm
CPP_BUILD    := build/cpp
CPP_ASAN_BUILD := build/cpp-asan
CPP_FUZZ_BUILD := build/cpp-fuzz
SAN_CXX      ?= clang++
# test-sanitize: layout pairs checked per exhaustive case (ASan/UBSan run ~10x slower).
SANITIZE_PAIRS ?= 2000
# test-fuzz: seconds of fuzzing, and fuzzing processes (libFuzzer -fork) beyond 1.
FUZZ_SECONDS ?= 60
FUZZ_JOBS    ?= 1
# Every sanitizer finding stops the run with a stack trace.
SAN_ENV      := ASAN_OPTIONS=check_initialization_order=1:strict_init_order=1 \
                UBSAN_OPTIONS=print_stacktrace=1

REQUIREMENTS_STAMP := $(VENV)/.requirements.stamp
BUILD_STAMP        := $(VENV)/.build.stamp
EXTENSION_INPUTS   := CMakeLists.txt pyproject.toml \
                      $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' \) 2>/dev/null)

# The venv's cmake, ninja and ctest come first; builds use at most $(JOBS) compile jobs.
export PATH := $(VENV_BIN):$(PATH)
export CMAKE_BUILD_PARALLEL_LEVEL := $(JOBS)
# ccache hashes compile commands with paths relative to the checkout, so a fresh clone in another
# folder (CI) reuses what an earlier build of the same sources compiled.
export CCACHE_BASEDIR := $(CURDIR)

.PHONY: help setup system-packages build test test-full test-cpp test-sanitize test-fuzz test-unit \
        test-level0 test-level1 test-gpu format test-format \
        demo bench coverage-docs clean distclean

help:
	@echo "make demo         set up everything, then run the demo (python -m hypershard.demo)"
	@echo "make test         set up everything, then test-format, test-cpp, test-sanitize, test-fuzz,"
	@echo "                  test-unit, test-level0, test-level1"
	@echo "make test-full    make test, then the slow cases it leaves out (pytest marker full)"
	@echo "make setup        Debian packages, .venv, pinned requirements, build the extension"
	@echo "make build        (re)build the extension hypershard._C when its sources changed"
	@echo "make format       apply clang-format (C++) and ruff (Python); test-format checks them"
	@echo "make test-cpp     GoogleTest tests of the layout core (no torch), in $(CPP_BUILD)"
	@echo "make test-sanitize"
	@echo "                  the tests of test-cpp under ASan + UBSan (clang), in $(CPP_ASAN_BUILD)"
	@echo "make test-fuzz    fuzz the layout core with libFuzzer for FUZZ_SECONDS (default $(FUZZ_SECONDS)),"
	@echo "                  e.g. make test-fuzz FUZZ_SECONDS=600 FUZZ_JOBS=2; in $(CPP_FUZZ_BUILD)"
	@echo "make test-unit    Python unit tests (tests/python/unit)"
	@echo "make test-level0  single-operator distributed tests (tests/python/level0)"
	@echo "make test-level1  model training tests (tests/python/level1)"
	@echo "make test-gpu     the GPU check on a GPU machine (GPU_PYTHON=python with CUDA torch; docs/gpu.md)"
	@echo "make coverage-docs  regenerate docs/coverage (ops of every target model on every mesh)"
	@echo "make bench        benchmarks vs plain eager and torch DTensor -> bench/ (results.json, RESULTS.md, PNG)"
	@echo "make clean        remove build outputs; make distclean also removes .venv"

setup: system-packages $(BUILD_STAMP)

build: setup

# Debian packages, installed only when dpkg says they are missing.
system-packages:
	@if ! command -v dpkg >/dev/null; then \
	  echo "setup: no dpkg here; make sure these are installed: $(APT_PACKAGES)"; exit 0; \
	fi; \
	missing=(); \
	for p in $(APT_PACKAGES); do dpkg -s "$$p" >/dev/null 2>&1 || missing+=("$$p"); done; \
	if (( $${#missing[@]} )); then \
	  sudo=""; [[ $$(id -u) -eq 0 ]] || sudo=sudo; \
	  echo "setup: installing $${missing[*]}"; \
	  $$sudo apt-get update; \
	  DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y --no-install-recommends "$${missing[@]}"; \
	fi

$(PY):
	$(PYTHON3) -m venv $(VENV)

# requirements-llamafactory.txt: LlamaFactory alone, --no-deps (it pins an older transformers;
# its dependencies are pinned in requirements.txt -- docs/llamafactory.md).
$(REQUIREMENTS_STAMP): requirements.txt requirements-llamafactory.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-llamafactory.txt
	touch $@

# --no-build-isolation: build against the torch in .venv (never let pip resolve torch itself).
$(BUILD_STAMP): $(REQUIREMENTS_STAMP) $(EXTENSION_INPUTS)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

test: setup test-format test-cpp test-sanitize test-fuzz test-unit test-level0 test-level1

# C++ (clang-format, .clang-format) and Python (ruff, pyproject.toml) style: `make format` applies
# both, test-format fails on any file that differs.
CXX_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'tests/cpp/*.cpp' 'tests/cpp/*.h' 2>/dev/null)
format: $(REQUIREMENTS_STAMP)
	$(VENV_BIN)/clang-format -i $(CXX_SOURCES)
	$(VENV_BIN)/ruff check --fix --quiet .
	$(VENV_BIN)/ruff format --quiet .

test-format: $(REQUIREMENTS_STAMP)
	@$(VENV_BIN)/clang-format --dry-run --Werror $(CXX_SOURCES) || \
	  { echo "test-format: C++ differs from .clang-format (run make format)"; exit 1; }
	@$(VENV_BIN)/ruff format --check --quiet . || { echo "test-format: run make format"; exit 1; }
	@$(VENV_BIN)/ruff check --quiet . || { echo "test-format: ruff check failed (make format fixes the import order)"; exit 1; }
	@echo "test-format: C++ and Python formatted"

test-cpp: system-packages $(REQUIREMENTS_STAMP)
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DHS_BUILD_TESTS=ON -DHS_BUILD_EXTENSION=OFF
	cmake --build $(CPP_BUILD) -j $(JOBS)
	cd $(CPP_BUILD) && ctest --output-on-failure -j $(JOBS)

# The GoogleTest tests built with AddressSanitizer and UndefinedBehaviorSanitizer; the exhaustive
# planner test checks a deterministic subset of its pairs (all of them in test-cpp).
test-sanitize: system-packages $(REQUIREMENTS_STAMP)
	cmake -S . -B $(CPP_ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_CXX_COMPILER=$(SAN_CXX) -DHS_SANITIZE=ON -DHS_BUILD_TESTS=ON -DHS_BUILD_EXTENSION=OFF
	cmake --build $(CPP_ASAN_BUILD) -j $(JOBS)
	cd $(CPP_ASAN_BUILD) && HS_EXHAUSTIVE_PAIRS=$(SANITIZE_PAIRS) $(SAN_ENV) \
	  ctest --output-on-failure -j $(JOBS)

# libFuzzer over parsing, conversion and planning (tests/cpp/fuzz/layout_fuzz.cpp), bounded by
# FUZZ_SECONDS. The committed seeds are read from tests/cpp/fuzz/corpus; what the fuzzer finds
# goes to $(CPP_FUZZ_BUILD)/corpus (kept between runs), a failing input to $(CPP_FUZZ_BUILD)/.
FUZZ_FLAGS := -max_total_time=$(FUZZ_SECONDS) -timeout=10 -dict=tests/cpp/fuzz/layout_fuzz.dict \
              -artifact_prefix=$(CPP_FUZZ_BUILD)/ -print_final_stats=1 \
              $(if $(filter-out 0 1,$(FUZZ_JOBS)),-fork=$(FUZZ_JOBS) -ignore_crashes=0 -ignore_timeouts=0 -ignore_ooms=0)
test-fuzz: system-packages $(REQUIREMENTS_STAMP)
	cmake -S . -B $(CPP_FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_CXX_COMPILER=$(SAN_CXX) -DHS_BUILD_FUZZ=ON -DHS_BUILD_EXTENSION=OFF
	cmake --build $(CPP_FUZZ_BUILD) -j $(JOBS)
	@mkdir -p $(CPP_FUZZ_BUILD)/corpus
	@echo "test-fuzz: fuzzing for $(FUZZ_SECONDS) s (log: $(CPP_FUZZ_BUILD)/fuzz.log)"
	@rc=0; $(SAN_ENV) $(CPP_FUZZ_BUILD)/hypershard_layout_fuzz $(FUZZ_FLAGS) \
	  $(CPP_FUZZ_BUILD)/corpus tests/cpp/fuzz/corpus > $(CPP_FUZZ_BUILD)/fuzz.log 2>&1 || rc=$$?; \
	grep -E '^#[0-9]+:?[[:space:]].*(INITED|DONE)|^Done|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
	  $(CPP_FUZZ_BUILD)/fuzz.log || true; \
	if (( rc )); then \
	  tail -n 80 $(CPP_FUZZ_BUILD)/fuzz.log; \
	  echo "test-fuzz: FAILED (exit $$rc). The input is in $(CPP_FUZZ_BUILD)/ (crash-*, leak-*, timeout-*, oom-*);"; \
	  echo "replay it with: $(CPP_FUZZ_BUILD)/hypershard_layout_fuzz <file>"; \
	fi; \
	exit $$rc

# Runs pytest on a folder; a folder without tests yet passes (and runs no pytest at all).
define run_pytest
	@if [[ -z "$$(find $(1) -name 'test_*.py' -print -quit 2>/dev/null)" ]]; then \
	  echo "$(1): no tests yet"; \
	else \
	  rc=0; $(PY) -m pytest -q -m "$(or $(2),not full)" $(1) || rc=$$?; \
	  if (( rc == 5 )); then echo "$(1): no tests collected"; rc=0; fi; \
	  exit $$rc; \
	fi
endef

test-unit: setup
	$(call run_pytest,tests/python/unit)

test-level0: setup
	$(call run_pytest,tests/python/level0)

test-level1: setup
	$(call run_pytest,tests/python/level1)

# The slow cases make test leaves out (marked `full`: more LlamaFactory LoRA models, the
# LlamaFactory fault run); make test-full runs make test, then them.
test-full: test
	$(call run_pytest,tests/python/level1,full)

# The prepared GPU check (docs/gpu.md): on a machine with a GPU and torch + CUDA already installed
# (not the pinned CPU torch of .venv), with GPU_PYTHON that torch's interpreter. Builds hypershard
# against it, then level0 on 1-rank CUDA meshes, the 2-rank slice on NCCL with 2+ GPUs, the dispatch
# bench; report in gpu_check_out/. About 10 minutes. `make test` runs its --dry-run (CPU, reduced)
# through tests/python/level0/test_gpu_check.py.
GPU_PYTHON ?= python3
test-gpu:
	$(GPU_PYTHON) hypershard/testing/gpu_check.py

demo: setup
	$(PY) -m hypershard.demo

# docs/coverage: every target model x mesh's ops and what serves them (a level1 test keeps it current).
coverage-docs: setup
	$(PY) -m hypershard.coverage --all --write docs/coverage

bench:
	@if [[ -f benchmarks/run.py ]]; then \
	  $(MAKE) --no-print-directory setup && $(PY) benchmarks/run.py; \
	else \
	  echo "No benchmark exists yet: benchmarks come with the runtime (see benchmarks/README.md)."; \
	fi

clean:
	rm -rf build demo_out bench_out $(BUILD_STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -rf .pytest_cache

distclean: clean
	rm -rf $(VENV)
