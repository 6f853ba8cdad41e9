# vidspec: `make setup` once, then `make run` (the demo) or `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints-cpu.txt
PIP_EXTRA ?=
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TRANSFORMERS_SDPA_FORCE_GQA := 1
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/runtime/inductor
export RAY_AUTH_MODE := disabled

.PHONY: setup run test test-slow lint format bench clean

$(BIN)/.installed: pyproject.toml requirements.lock $(CONSTRAINTS)
	$(PY) -m venv $(VENV)
	# torch first, from the pinned constraints, so nothing can pull a CUDA build by accident
	$(BIN)/pip install -q -c $(CONSTRAINTS) $(PIP_EXTRA) torch==2.13.0
	$(BIN)/pip install -q -c $(CONSTRAINTS) $(PIP_EXTRA) -r requirements.lock
	$(BIN)/pip install -q -c $(CONSTRAINTS) --no-deps -e .
	touch $@

# on AMD CPUs: a one-line library that lets torch's MKL use its fast kernels (infra/cpu.py); needs cc
$(BIN)/.mkl-shim: $(BIN)/.installed infra/cpu.py
	$(BIN)/python -m infra.cpu build
	touch $@

# the native decode kernels (decoders/kernels), built for this CPU; without a C++ compiler the torch paths run
$(BIN)/.kernels: $(BIN)/.installed decoders/kernels/attn.cpp decoders/kernels/__init__.py
	$(BIN)/python -m decoders.kernels
	touch $@

setup: $(BIN)/.installed $(BIN)/.mkl-shim $(BIN)/.kernels

run: setup
	$(BIN)/vidspec demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# tests run as the service does: with the MKL shim preloaded where it applies
test: lint
	LD_PRELOAD="$$($(BIN)/python -m infra.cpu preload)" $(BIN)/pytest -q

test-slow: setup
	LD_PRELOAD="$$($(BIN)/python -m infra.cpu preload)" $(BIN)/pytest -q -m slow

clean:
	rm -rf runtime .pytest_cache .ruff_cache
