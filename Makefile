# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export MALLOC_MMAP_THRESHOLD_ ?= 4294967296
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test bench check-transformers clean

$(BIN)/.installed: pyproject.toml requirements-offline.txt
	$(PY) -m venv $(VENV)
	# The CPU build of torch lies on local disk; pin it first so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[train,eval,models,kernels,serve,notebooks,dev]"
	$(BIN)/pip install -q --no-deps -r requirements-offline.txt
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/dynts demo

test: install
	$(BIN)/pytest

bench: install
	$(BIN)/python scripts/bench_decode.py

# The core tests on another transformers release (pyproject's lower bound is the oldest that passes):
#   make check-transformers TF=5.23.0   (5.18.0, 5.22.0, 5.23.0 fail test_eviction's explicit-mask check; 5.24.0 passes)
TF ?= 5.24.0
check-transformers: install
	$(BIN)/pip install -q --target /tmp/dynts-transformers-$(TF) --no-deps transformers==$(TF)
	PYTHONPATH=/tmp/dynts-transformers-$(TF) $(BIN)/pytest -q -m "not slow" tests/test_exactness.py tests/test_eviction.py tests/test_baselines.py

clean:
	rm -rf $(VENV) .pytest_cache
