"""The vLLM GPU carry bundle (``make vllm-gpu-bundle``) on these CPUs, before a GPU is lent.

Without a GPU nothing here runs an engine. What is checked, the way the feasibility study did, is what would break
first on the GPU after a vLLM, torch or dependency change: the bundle's contents and size, its install into a target
folder exactly as ``scripts/gpu_check.py`` installs it there (with the plugin's entry point), and, in the bundle's own
venv (``make check-vllm-gpu-bundle``: the GPU image's transformers / huggingface-hub / triton, the local CPU torch) with
an H200 faked for vLLM's platform logic (``scripts/vllm_gpu_bundle/fakecuda.py``): the ``_C`` stand-in's ops, every
CUDA-path module's import, the engine configuration the GPU run asks for (compile mode, FULL_AND_PIECEWISE,
TRITON_ATTN, native custom ops) with the dynts plugin loaded through its entry point, FlashAttention's refusal, and a
Llama / Qwen2 built on the Triton backend. Skipped, with the command, where the bundle or its venv is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".vllm-gpu-bundle"
BUILD = "make vllm-gpu-bundle"
FAKECUDA = ROOT / "scripts" / "vllm_gpu_bundle"

needs_bundle = pytest.mark.skipif(not (BUNDLE / "bundle.json").is_file(),
                                  reason=f"no {BUNDLE.name}/: build it with `{BUILD}` (downloads vLLM's CUDA wheel once)")


def _bundle_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None and (Path(spec.origin).parent / "_C_stable_libtorch.py").is_file()


needs_bundle_venv = pytest.mark.skipif(
    not _bundle_vllm(),
    reason=f"not the bundle's venv: `{BUILD}` then `make check-vllm-gpu-bundle` runs these in .venv-vllm-gpu")


def vllm_wheel() -> Path:
    return next((BUNDLE / "wheels").glob("vllm-*.whl"))


@needs_bundle
def test_bundle_fits_a_call_and_holds_no_compiled_vllm():
    meta = json.loads((BUNDLE / "bundle.json").read_text())
    wheels = sorted((BUNDLE / "wheels").glob("*.whl"))
    assert meta["bytes"] == sum(w.stat().st_size for w in wheels) <= 40 * 2**20, meta
    assert meta["wheels"] == len(wheels) and meta["vllm"] == "0.34.0"
    for wheel in wheels:  # CPython 3.12 (the image's), abi3 or pure Python; x86-64 Linux
        tags = wheel.name[:-4].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312", "cp38", "cp39") and tags[1] in ("none", "abi3", "cp312"), wheel.name
        assert tags[2] == "any" or "x86_64" in tags[2], wheel.name
    names = zipfile.ZipFile(vllm_wheel()).namelist()
    assert not [n for n in names if n.endswith((".so", ".cu", ".cuh"))]
    assert "vllm/_C_stable_libtorch.py" in names and "vllm/v1/worker/gpu/model_runner.py" in names
    fa_init = zipfile.ZipFile(vllm_wheel()).read("vllm/vllm_flash_attn/__init__.py").decode()
    assert "_refuse_flash_attention" in fa_init and "raise ImportError" not in fa_init


@needs_bundle
def test_install_into_a_target_folder_as_on_the_gpu(tmp_path):
    """``pip install --target`` with the image's platform tags (whatever this Python is), and the record through
    which vLLM's plugin loader finds ``dynts.vllm:register`` without an install of dynts."""
    from importlib.metadata import distributions

    from eval.perf.vllm_gpu_bundle import install

    done = install(BUNDLE, tmp_path / "site")
    assert done["wheels"] == json.loads((BUNDLE / "bundle.json").read_text())["wheels"] and done["shim"]
    found = {d.metadata["Name"].lower(): d for d in distributions(path=[str(tmp_path / "site")])}
    assert found["vllm"].version == "0.34.0" and "pydantic" in found and "xgrammar" in found
    plugins = [e for e in found["dynts-lrm"].entry_points if e.group == "vllm.general_plugins"]
    assert [(e.name, e.value) for e in plugins] == [("dynts", "dynts.vllm:register")]


def test_child_env_drops_a_transformers_outside_vllms_pin(tmp_path, monkeypatch):
    """A run that carries transformers 5.24 for the serving sections: vLLM 0.34 (<5.23) must import the image's."""
    from eval.perf.vllm_gpu_bundle import ROOT as CHECKOUT
    from eval.perf.vllm_gpu_bundle import child_env

    new, old, other = tmp_path / "new", tmp_path / "old", tmp_path / "other"
    (new / "transformers-5.24.0.dist-info").mkdir(parents=True)
    (old / "transformers-5.17.0.dist-info").mkdir(parents=True)
    other.mkdir()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(map(str, (new, old, other))))
    env = child_env(tmp_path / "site", tmp_path / "cache")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site"), str(CHECKOUT), str(old), str(other)]
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")


def test_refusal_names_what_the_bundle_cannot_run():
    from eval.perf.vllm_gpu_bundle import REFUSED, refusal

    assert refusal() is None
    assert "FlashAttention" in refusal(attention_backend="FLASH_ATTN")
    assert "FlashAttention" in refusal(attention_backend=None)  # vLLM's own choice on an H200
    assert "compiled ops" in refusal(quantization="fp8") and "compiled ops" in refusal(kv_cache_dtype="fp8")
    assert "_moe_C" in refusal(moe=True) and "all-reduce" in refusal(tensor_parallel_size=2)
    assert set(REFUSED) == {"FLASH_ATTN (FA2, FA3)", "fp8 and quantized models", "MoE models", "tensor parallelism > 1"}


def run_faked(code: str, tmp_path: Path, timeout: int = 300) -> str:
    """``code`` in a fresh process of this venv with an H200 faked, the checkout and the plugin's entry point on
    ``PYTHONPATH`` as on the GPU; returns its stdout (a failure shows the traceback)."""
    from eval.perf.vllm_gpu_bundle import _entry_point

    site = tmp_path / "entry"
    _entry_point(site)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKECUDA), str(site), str(ROOT)]),
               VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(tmp_path / "cache"), HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run([sys.executable, "-c", "import fakecuda  # noqa: F401\n" + textwrap.dedent(code)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny Llama and a tiny Qwen2 (the testbed's architecture), head size 64 (TRITON_ATTN takes no 16), saved with
    the testbed tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dynts.models import load_tokenizer
    from eval.perf.random_models import random_llama

    root = tmp_path_factory.mktemp("bundle-models")
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024)
    llama = random_llama(root / "llama", **shape)
    tok = load_tokenizer("testbed")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), **shape)).save_pretrained(root / "qwen2")
    tok.save_pretrained(root / "qwen2")
    return {"llama": str(llama), "qwen2": str(root / "qwen2")}


@needs_bundle_venv
def test_shim_declares_ops_and_implements_the_few_a_graph_run_calls(tmp_path):
    out = run_faked("""
        import torch, vllm._C_stable_libtorch  # noqa: F401
        t = torch.arange(6.0)
        w = torch.ops._C.weak_ref_tensor(t)
        w[0] = 42.0  # same storage, no copy
        print("weak_ref", w.data_ptr() == t.data_ptr(), float(t[0]))
        print("probe", torch.ops._C.cutlass_group_gemm_supported(90))
        try:
            torch.ops._C.rms_norm(torch.empty(2, 4), torch.ones(2, 4), torch.ones(4), 1e-6)
        except (NotImplementedError, RuntimeError) as err:
            print("rms_norm refused", "Could not run" in str(err) or "no kernel" in str(err).lower())
        """, tmp_path)
    assert "weak_ref True 42.0" in out and "probe False" in out and "rms_norm refused True" in out, out


@needs_bundle_venv
def test_cuda_path_modules_import(tmp_path):
    modules = ["vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
               "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.cudagraph_utils", "vllm.v1.worker.gpu.block_table",
               "vllm.v1.attention.backends.triton_attn", "vllm.v1.attention.backends.flash_attn",
               "vllm.compilation.backends", "vllm.compilation.decorators", "vllm.model_executor.models.llama",
               "vllm.model_executor.models.qwen2", "vllm.model_executor.model_loader.dummy_loader",
               "vllm.v1.core.sched.scheduler", "dynts.vllm.patches", "dynts.vllm.worker_v2", "dynts.vllm.selfcheck"]
    out = run_faked(f"""
        import importlib
        for name in {modules!r}:
            importlib.import_module(name)
        import vllm.platforms as vp
        print("platform", type(vp.current_platform).__name__, vp.current_platform.get_device_capability())
        """, tmp_path)
    assert "platform NonNvmlCudaPlatform" in out and "(9, 0)" in out.replace("DeviceCapability(major=9, minor=0)", "(9, 0)")


@needs_bundle_venv
def test_engine_config_is_what_the_gpu_run_asks_for_with_the_plugin_loaded(tmp_path, tiny_models):
    """vLLM's defaults plus TRITON_ATTN: compile mode, FULL_AND_PIECEWISE, native custom ops; the plugin loads
    through the entry-point record and checks the engine (it accepts this one, refuses a quantized KV cache)."""
    out = run_faked(f"""
        from vllm.engine.arg_utils import EngineArgs
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from dynts.vllm.compat import runner_of, unsupported_reason
        print("plugin", unsupported_reason(), runner_of())
        base = dict(model={tiny_models['qwen2']!r}, dtype="float32", max_model_len=512, max_num_seqs=8, seed=0,
                    attention_backend="TRITON_ATTN")
        dynts = {{"dynts": {{"method": "streamingllm", "budget": 128, "local_window": 16}}}}
        c = EngineArgs(**base, additional_config=dynts).create_engine_config()
        cc = c.compilation_config
        print("config", cc.mode, cc.cudagraph_mode, cc.custom_ops, c.attention_config.backend.name,
              c.kernel_config.ir_op_priority.rms_norm, c.scheduler_config.async_scheduling)
        try:
            EngineArgs(**base, kv_cache_dtype="fp8", additional_config=dynts).create_engine_config()
        except ValueError as err:
            print("refused", "dynts.vllm cannot evict" in str(err))
        """, tmp_path)
    assert "plugin None v2" in out, out
    assert "config 3 FULL_AND_PIECEWISE ['none'] TRITON_ATTN ['native'] True" in out, out
    assert "refused True" in out, out


@needs_bundle_venv
def test_flash_attention_is_refused_when_called(tmp_path):
    out = run_faked("""
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_scheduler_metadata
        for fn in (flash_attn_varlen_func, get_scheduler_metadata):
            try:
                fn()
            except RuntimeError as err:
                print("refused", "carry bundle" in str(err) and "TRITON_ATTN" in str(err))
        """, tmp_path)
    assert out.count("refused True") == 2, out


@needs_bundle_venv
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_builds_on_the_triton_backend(tmp_path, tiny_models, arch):
    out = run_faked(f"""
        import torch
        from vllm.engine.arg_utils import EngineArgs
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader import get_model_architecture
        c = EngineArgs(model={tiny_models[arch]!r}, dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                       attention_backend="TRITON_ATTN").create_engine_config()
        torch.cuda.is_available = lambda: False  # build on the CPU: no CUDA tensors exist here
        with set_current_vllm_config(c):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method="tcp://127.0.0.1:29533", backend="gloo")
            initialize_model_parallel(1, 1)
            cls, _ = get_model_architecture(c.model_config)
            torch.set_default_dtype(torch.bfloat16)
            model = cls(vllm_config=c)
            attn = model.model.layers[0].self_attn.attn
            print("built", cls.__name__, attn.attn_backend.get_name(), type(model.model.layers[0].mlp.act_fn).__name__)
        """, tmp_path)
    assert f"built {'LlamaForCausalLM' if arch == 'llama' else 'Qwen2ForCausalLM'} TRITON_ATTN SiluAndMul" in out, out


@pytest.mark.usefixtures("one_thread")
def test_cost_engine_on_the_cpu_test_bed(tmp_path):
    """The cost step's engine code (:func:`eval.perf.vllm_gpu_bundle.cost_engine`: the plugin engine of the tight
    pool, its three workloads) on vLLM 0.34's CPU test bed (``make check-vllm-v2``), eager on vLLM's CPU backend: the
    per-request overrides reach the plugin (nothing evicted at the budget above every length, evictions at the
    budget), the counters and latencies are filled; on a GPU the same code runs with graphs at the 7B shape."""
    pytest.importorskip("vllm", reason="needs vLLM's 0.34 CPU build (make check-vllm-v2)")
    from packaging.version import Version

    import dynts
    from dynts.vllm.compat import installed_vllm
    from eval.perf.vllm_gpu_bundle import cost_specs

    if _bundle_vllm() or Version(Version(installed_vllm()).base_version) < Version("0.34"):
        pytest.skip("runs on vLLM 0.34's CPU test bed (make check-vllm-v2)")
    from test_vllm_plugin import make_tiny_models

    model = make_tiny_models(tmp_path, ("llama",))["llama"]
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    predictor = dynts.ImportancePredictor(64).save_pretrained(tmp_path / "predictor")
    spec = cost_specs(str(model), str(predictor), requests=8, prompt=16, generate=40, budget=32, local_window=4,
                      block=32)["cost-tight-plugin"]
    spec["engine"] = {"attention_backend": None, "enforce_eager": True, "dtype": "float32", "block_size": 32}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "eval.perf.vllm_gpu_bundle", "--engine", str(tmp_path / "spec.json")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    lines = [x for x in done.stdout.splitlines() if x.startswith("COST ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1][5:])
    assert result["pool_blocks"] == spec["pool_blocks"] == 4 and result["engine"]["v2_runner"]
    nothing, dynts_run, streaming = result["workloads"]
    assert [w["label"] for w in result["workloads"]] == ["plugin@57 (nothing evicted)", "dynts@32", "streamingllm@32"]
    for w in result["workloads"]:
        assert w["tokens"] == 8 * 40 and w["tokens_per_s"] > 0 and 0 < w["itl_p50_ms"] <= w["itl_p99_ms"]
        assert w["graph_replays"] == 0  # eager on CPU
    assert nothing["evictions"] == 0 and dynts_run["evictions"] > 0 and streaming["evictions"] > 0
    # at the budget a request holds 1 block instead of 2: more of them run at once in the 3 usable blocks
    assert dynts_run["in_flight_max"] > nothing["in_flight_max"] and streaming["in_flight_max"] > nothing["in_flight_max"]
    memory = result["memory"]  # the worker's fixed slot table: a row per request and the scratch row, never reallocated
    assert memory["table_shape"][0] == spec["requests"] + 1 and memory["slot_table_reallocated"] is False
    assert memory["predictor_bytes"] > 0 and memory["table_bytes"] > 0


def test_counting_graph_replays_counts_inside_and_restores(monkeypatch):
    """What the smoke, ``vllm-check`` and the cost engines count CUDA-graph replays with."""
    import torch

    from dynts.vllm.selfcheck import counting_graph_replays

    calls = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: calls.append(self))
    with counting_graph_replays() as count:
        torch.cuda.CUDAGraph.replay("g1")
        torch.cuda.CUDAGraph.replay("g2")
    torch.cuda.CUDAGraph.replay("after")
    assert count == [2] and calls == ["g1", "g2", "after"]


def test_an_inconclusive_bfloat16_check_is_decided_by_its_float32_run():
    from eval.perf.vllm_gpu_bundle import decide

    def check(label, status):
        return {"label": label, "kind": "vllm-check", "status": status}

    runs = [{"label": "smoke", "kind": "smoke", "status": 0},
            check("check-float32-testbed-dynts", 0), check("check-float32-tiny-llama-streamingllm", 1),
            check("check-bfloat16-testbed-dynts", 4), check("check-bfloat16-tiny-llama-streamingllm", 4)]
    out = decide(runs)
    assert out["verdicts"] == {"check-float32-testbed-dynts": "exact", "check-float32-tiny-llama-streamingllm": "mismatch",
                               "check-bfloat16-testbed-dynts": "exact",
                               "check-bfloat16-tiny-llama-streamingllm": "mismatch"}
    assert runs[3]["decided_by"] == "check-float32-testbed-dynts" and runs[1]["decided_by"] == runs[1]["label"]
    assert out["inconclusive"] == ["check-bfloat16-testbed-dynts", "check-bfloat16-tiny-llama-streamingllm"]
    # without the float32 run (out of time) an inconclusive run stays inconclusive: not a pass
    alone = decide([check("check-bfloat16-testbed-dynts", 4), check("check-float32-x", None)])
    assert alone["verdicts"] == {"check-bfloat16-testbed-dynts": "inconclusive", "check-float32-x": "error"}


def test_command_without_a_bundle_or_vllm_says_how_to_build_it(tmp_path, monkeypatch):
    """The second GPU command on a machine with neither vLLM nor a carried bundle: exit 2, the JSON says why."""
    import importlib.util

    import eval.perf.vllm_gpu_bundle as bundle_module

    monkeypatch.setattr(bundle_module, "find_bundle", lambda root=ROOT: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert bundle_module.main(["--out", str(tmp_path)]) == 2
    result = json.loads((tmp_path / "vllm_gpu_bundle.json").read_text())
    assert "make vllm-gpu-bundle" in result["skipped"] and ".vllm-gpu-bundle" in result["skipped"]


def test_plan_runs_its_steps_in_the_time_plans_order(tmp_path):
    from eval.perf.vllm_gpu_bundle import bundle_steps, cost_specs, plan

    steps = plan(tmp_path, {"testbed": "testbed", "tiny-llama": "llama"}, "predictor", cost_specs("model", "predictor"))
    assert [s["label"] for s in steps] == [s.name for s in bundle_steps()][2:]  # after install and models
    assert all(s["step"].name == s["label"] and s["step"].cap_s for s in steps)
    assert "--cudagraph-mode FULL_AND_PIECEWISE" in " ".join(steps[1]["command"]) and "float32" in steps[1]["command"]


def test_a_run_skips_what_its_deadline_leaves_no_room_for(tmp_path, monkeypatch):
    """run_bundle's loop (install, models and every step faked: each returns at once): at a 95 s budget the 90 s
    steps run, the longer ones are skipped with their estimate and what was left, and without the decisive float32
    check the run is not ok."""
    import eval.perf.vllm_gpu_bundle as bundle_module

    ran = []

    def fake_step(step, env, timeout):
        ran.append((step["label"], timeout))
        status = 0
        if step["kind"] == "vllm-check":
            Path(step["command"][step["command"].index("--json") + 1]).write_text("{}")
        return {"label": step["label"], "kind": step["kind"], "status": status, "seconds": 0.0, "result": {}}

    monkeypatch.setattr(bundle_module, "PYTHON", tuple(__import__("sys").version_info[:2]))
    monkeypatch.setattr(bundle_module, "install", lambda bundle, site: {"wheels": 0, "seconds": 0.0})
    monkeypatch.setattr(bundle_module, "_models", lambda root, shape: {
        "checks": {"testbed": "testbed", "tiny-llama": "llama"}, "predictor": "p", "cost_model": "m",
        "cost_predictor": "p"})
    monkeypatch.setattr(bundle_module, "_run_step", fake_step)
    out = bundle_module.run_bundle(tmp_path, dry_run=False, budget_s=95, shape={})
    assert [label for label, _ in ran] == ["smoke", "check-float32-tiny-llama-streamingllm",
                                           "check-bfloat16-tiny-llama-streamingllm"]
    assert all(timeout <= 90 for _, timeout in ran)  # boxed at what is left less the JSON's reserve
    skipped = {s["section"]: s for s in out["skipped"]}
    assert set(skipped) == {"check-float32-testbed-dynts", "cost-ample-stock", "cost-ample-plugin", "cost-tight-stock",
                            "cost-tight-plugin", "check-bfloat16-testbed-dynts"}
    assert skipped["cost-ample-stock"]["estimate_s"] == 120 and skipped["cost-ample-stock"]["left_s"] <= 95
    assert not out["ok"] and not out["complete"]


def test_the_bundle_tools_are_never_installed_with_dynts():
    """``pip install dynts-lrm`` installs the packages pyproject.toml lists: the bundle's tools (the ``_C`` stand-in's
    generator, the FlashAttention patch, the faked device) live under scripts/, which is none of them."""
    import tomllib

    from setuptools import find_packages

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = find_packages(str(ROOT), include=tool["packages"]["find"]["include"])
    assert "dynts.vllm" in packages and not [p for p in packages if p.split(".")[0] in ("scripts", "vllm")]
    shipped = [f for files in tool.get("data-files", {}).values() for f in files]
    assert not [f for f in shipped if "vllm_gpu_bundle" in f or f.startswith("scripts")]


@needs_bundle_venv
def test_vllms_tokenizer_loads_the_testbed_on_the_images_transformers(tmp_path):
    """vLLM 0.34 pins huggingface-hub >= 2 and transformers < 5.23; the image has 1.33 and 5.17. vLLM's own tokenizer
    loading (its engine detokenizes what ``dynts vllm-check`` generates; the prompts go in as dynts' token ids) on the
    testbed's directory: dynts' vocabulary, and dynts' ids decode to the question's words (vLLM loads the word-level
    tokenizer as a Qwen2 one and joins words without spaces, as on the CPU test bed's transformers 5.22)."""
    from dynts.models import resolve_path

    out = run_faked(f"""
        import huggingface_hub, transformers
        from vllm.tokenizers.registry import get_tokenizer
        from dynts.models import load_tokenizer
        path = {str(resolve_path("testbed"))!r}
        tok, ours = get_tokenizer(path), load_tokenizer(path)
        text = "a 5 b 1 c 2 find r3"
        decoded = tok.decode(ours.encode(text), skip_special_tokens=True)
        print("tokenizer", tok.get_vocab() == ours.get_vocab(), decoded.replace(" ", "") == text.replace(" ", ""),
              transformers.__version__, huggingface_hub.__version__)
        """, tmp_path)
    assert "tokenizer True True 5.17.0 1.33.0" in out, out
