# hypershard developer entry points. Every target works from a fresh clone:
#
#   make demo    set up (Debian packages, .venv, pinned deps, build), then run the demo
#   make test    set up, then the C++ tests, the Python unit tests, level0 and level1
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
APT_PACKAGES := g++ libgtest-dev ccache
CPP_BUILD    := build/cpp

REQUIREMENTS_STAMP := $(VENV)/.requirements.stamp
BUILD_STAMP        := $(VENV)/.build.stamp
EXTENSION_INPUTS   := CMakeLists.txt pyproject.toml \
                      $(shell find csrc -type f \( -name '*.cpp' -o -name '*.h' \) 2>/dev/null)

# The venv's cmake, ninja and ctest come first; builds use at most $(JOBS) compile jobs.
export PATH := $(VENV_BIN):$(PATH)
export CMAKE_BUILD_PARALLEL_LEVEL := $(JOBS)

.PHONY: help setup system-packages build test test-cpp test-unit test-level0 test-level1 \
        demo bench clean distclean

help:
	@echo "make demo         set up everything, then run the demo (python -m hypershard.demo)"
	@echo "make test         set up everything, then test-cpp, test-unit, test-level0, test-level1"
	@echo "make setup        Debian packages, .venv, pinned requirements, build the extension"
	@echo "make build        (re)build the extension hypershard._C when its sources changed"
	@echo "make test-cpp     GoogleTest tests of the layout core (no torch), in $(CPP_BUILD)"
	@echo "make test-unit    Python unit tests (tests/python/unit)"
	@echo "make test-level0  single-operator distributed tests (tests/python/level0)"
	@echo "make test-level1  model training tests (tests/python/level1)"
	@echo "make bench        benchmarks"
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

$(REQUIREMENTS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -r requirements.txt
	touch $@

# --no-build-isolation: build against the torch in .venv (never let pip resolve torch itself).
$(BUILD_STAMP): $(REQUIREMENTS_STAMP) $(EXTENSION_INPUTS)
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	touch $@

test: setup test-cpp test-unit test-level0 test-level1

test-cpp: system-packages $(REQUIREMENTS_STAMP)
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DHS_BUILD_TESTS=ON -DHS_BUILD_EXTENSION=OFF
	cmake --build $(CPP_BUILD) -j $(JOBS)
	cd $(CPP_BUILD) && ctest --output-on-failure -j $(JOBS)

# Runs pytest on a folder; a folder without tests yet passes (and runs no pytest at all).
define run_pytest
	@if [[ -z "$$(find $(1) -name 'test_*.py' -print -quit 2>/dev/null)" ]]; then \
	  echo "$(1): no tests yet"; \
	else \
	  rc=0; $(PY) -m pytest -q $(1) || rc=$$?; \
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

demo: setup
	$(PY) -m hypershard.demo

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
