"""vLLM 0.34 on the lent GPU from the carry bundle (``make vllm-gpu-bundle``): the second of a lending's two prepared
commands (the first is ``scripts/gpu_check.py``; the GPU image has no vLLM; docs/vllm.md, "vLLM on the lent GPU")::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 -m eval.perf.vllm_gpu_bundle --out $OUT --budget-s 540

The bundle is vLLM 0.34.0 as pure Python (no compiled kernels: a generated stand-in for ``vllm._C_stable_libtorch``)
and the dependencies the image lacks, as CPython 3.12 wheels. What it runs: the V2 model runner with ``torch.compile``
and CUDA graphs, the TRITON_ATTN backend, vLLM's native (PyTorch) custom ops, dense unquantized models on one GPU.
What it cannot run is refused (:data:`REFUSED`, :func:`refusal`), never faked. Where no bundle is carried but vLLM's
CUDA wheel is installed, the command runs :mod:`.vllm_v2_check` (FLASH_ATTN, FA2 and FA3) instead.

Steps, in :func:`bundle_steps`'s order (most informative first), each in its own process (vLLM keeps process-wide
state), against a running deadline of ``--budget-s`` (default 540 s): a step runs when its estimate fits in what is
left, time-boxed at what is left (at most its cap); a step that does not fit is listed under ``skipped`` with its
estimate and the seconds that were left:

- ``install``: ``pip install --no-index --no-deps --target`` a temporary folder (the image's platform tags), plus a
  ``vllm.general_plugins`` entry-point record for this checkout (the image has no install of dynts: vLLM finds the
  plugin through it, dynts itself through ``PYTHONPATH``); then the models.
- ``smoke``: stock vLLM, FULL_AND_PIECEWISE graphs, tokens against transformers
  (``scripts/vllm_gpu_bundle/smoke.py``). Where its engine does not run, nothing else is tried.
- ``check-float32-testbed-dynts``: ``dynts vllm-check`` in float32 (the decisive dtype) on the testbed LRM with its
  DynTS predictor; ``--attention-backend TRITON_ATTN --cudagraph-mode FULL_AND_PIECEWISE``, vLLM's other defaults
  (async scheduling).
- ``cost-ample-stock`` / ``cost-ample-plugin``: the plugin's cost on a dummy-weight (``load_format="dummy"``) model of
  R1-Distill-Qwen-7B's shape at vLLM's defaults (V2 runner, async scheduling, FULL_AND_PIECEWISE graphs; TRITON_ATTN
  named) with vLLM's own pool sizing: stock vLLM in one engine; in another, the plugin with nothing evicted (a budget
  above every length), DynTS with a random predictor and StreamingLLM at one budget. Per workload: generated
  tokens/s, requests in flight, preemptions, inter-token latency p50/p99, CUDA-graph replays, evictions
  (:func:`cost_engine`).
- then, as time allows: the float32 check of a tiny random Llama with R1-Distill-7B's attention head under
  StreamingLLM, the cost at a tight pool (``num_gpu_blocks_override``), both checks in bfloat16.

Inconclusive is not a pass: a ``vllm-check`` passes only when exact (exit 0); a bfloat16 run that is inconclusive (exit
4: vLLM without eviction already differs from transformers) is decided by the float32 run of the same model
(``decided_by``), as :mod:`.vllm_v2_check` decides its own, and listed under ``inconclusive``. ``ok``: the smoke and
the decisive float32 check ran, every check that ran is exact and every other step that ran finished; ``complete``:
nothing was skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from .time_plan import DEFAULT_BUDGET_S, Deadline, Step
from .vllm_v2_check import VERDICTS, tiny_r1_model

__all__ = ["BUILD", "BUNDLE", "REFUSED", "bundle_steps", "cost_engine", "cost_specs", "count_preemptions", "decide",
           "find_bundle", "install", "plan", "refusal", "run_bundle"]

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".vllm-gpu-bundle"
BUILD = "make vllm-gpu-bundle"
PYTHON = (3, 12)  # the bundle's compiled dependencies are CPython 3.12 wheels: the GPU image's Python
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for p in ("manylinux_2_35_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
                          "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)]]
BACKEND, GRAPHS = "TRITON_ATTN", "FULL_AND_PIECEWISE"
VLLM_TRANSFORMERS = ">=5.16.1,<5.23"  # vLLM 0.34's own pin (the image has 5.17)

# What the bundle cannot run (no compiled kernels in it): claims that stay with a GPU install of vLLM's CUDA wheel.
REFUSED = {
    "FLASH_ATTN (FA2, FA3)": "no FlashAttention binaries in the bundle (vllm_flash_attn's _vllm_fa2_C / _vllm_fa3_C); "
                             "its patched vllm_flash_attn raises at the first call; vLLM picks FLASH_ATTN on an H200 "
                             "when no backend is named, so every run here names TRITON_ATTN",
    "fp8 and quantized models": "their GEMMs, scaled casts and KV-cache quantization are compiled ops "
                                "(_C: cutlass, machete, scaled_fp8_quant, ...); the stand-in raises when one is called",
    "MoE models": "the fused-MoE path calls compiled ops (_moe_C: moe_align_block_size, topk_softmax, ...)",
    "tensor parallelism > 1": "vLLM's custom all-reduce is compiled (_C_custom_ar), and one GPU is lent",
}


def refusal(*, attention_backend: str | None = BACKEND, quantization: str | None = None, kv_cache_dtype: str = "auto",
            moe: bool = False, tensor_parallel_size: int = 1) -> str | None:
    """Why the bundle cannot run an engine with these settings (``None``: it can)."""
    reasons = []
    if attention_backend != BACKEND:
        reasons.append(f"attention backend {attention_backend or 'vLLM’s choice (FLASH_ATTN)'}: "
                       + REFUSED["FLASH_ATTN (FA2, FA3)"])
    if quantization or kv_cache_dtype != "auto":
        reasons.append(f"quantization {quantization or kv_cache_dtype}: " + REFUSED["fp8 and quantized models"])
    if moe:
        reasons.append("a mixture-of-experts model: " + REFUSED["MoE models"])
    if tensor_parallel_size > 1:
        reasons.append(f"tensor_parallel_size={tensor_parallel_size}: " + REFUSED["tensor parallelism > 1"])
    return "; ".join(reasons) or None


def find_bundle(root: Path = ROOT) -> Path | None:
    """The carried bundle under the checkout's root (``None`` when absent or incomplete)."""
    bundle = root / BUNDLE.name
    return bundle if (bundle / "bundle.json").is_file() and any((bundle / "wheels").glob("vllm-*.whl")) else None


def _entry_point(site: Path) -> Path:
    """A ``dynts-lrm`` distribution record holding only the plugin's entry point, so vLLM's plugin loader calls
    ``dynts.vllm:register`` for the checkout on ``PYTHONPATH`` (the same entry point as pyproject.toml's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    group = project["entry-points"]["vllm.general_plugins"]
    record = site / f"dynts_lrm-{project['version']}.dist-info"
    record.mkdir(parents=True, exist_ok=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: dynts-lrm\nVersion: {project['version']}\n")
    (record / "entry_points.txt").write_text("[vllm.general_plugins]\n"
                                             + "".join(f"{name} = {target}\n" for name, target in group.items()))
    return record


def install(bundle: Path, site: Path) -> dict[str, Any]:
    """Install the bundle's wheels into ``site`` (``--target``; nothing else on the machine changes) and the
    plugin's entry-point record; returns what was installed and how long it took."""
    wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--disable-pip-version-check", "--target", str(site), *PLATFORM, *wheels],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"installing the bundle failed:\n{done.stderr[-2000:]}")
    record = _entry_point(site)
    meta = json.loads((bundle / "bundle.json").read_text())
    return {"bundle": meta, "wheels": len(wheels), "site": str(site), "entry_point": record.name,
            "shim": (site / "vllm" / "_C_stable_libtorch.py").is_file(), "seconds": time.perf_counter() - t0}


def child_env(site: Path, cache: Path) -> dict[str, str]:
    """The environment of every step's process: the bundle first on ``PYTHONPATH``, then this checkout, then the
    caller's entries except any that holds a transformers outside vLLM's pin (a run that carries transformers 5.24 for
    the serving sections: vLLM then imports the image's release); one compile cache shared by every step."""
    from packaging.specifiers import SpecifierSet

    keep = []
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        found = sorted(Path(entry).glob("transformers-*.dist-info")) if Path(entry).is_dir() else []
        version = found[-1].name[len("transformers-"):-len(".dist-info")] if found else None
        if version is None or version in SpecifierSet(VLLM_TRANSFORMERS):
            keep.append(entry)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), *keep]), PYTHONUNBUFFERED="1",
               VLLM_CACHE_ROOT=str(cache), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    return env


# ------------------------------------------------------------------------------------------------------ the plan
GUESS = "never run on a GPU: a guess"


def bundle_steps() -> list[Step]:
    """The plan's steps in run order with their estimates (no step has run on a GPU yet: each estimate is a guess
    from vLLM's start-up -- import, profiling, ``torch.compile``, graph capture -- plus the step's own work) and time
    boxes. Most informative first: the smoke (does the carried vLLM run at all), the decisive float32 check of the
    plugin, then the cost at vLLM's defaults (stock vs the plugin), then what repeats these on other models, pools
    and dtypes."""
    return [
        Step("install", 25, f"pip install of 28 wheels into a folder; {GUESS}", cap_s=120),
        Step("models", 10, "the testbed and a tiny Llama saved, a 7B config and a random predictor: seconds on CPU"),
        Step("smoke", 90, f"a tiny Llama, compile + FULL_AND_PIECEWISE capture, and transformers; {GUESS}", cap_s=180),
        Step("check-float32-testbed-dynts", 100, f"the testbed reference in transformers, one engine; {GUESS}",
             cap_s=150),
        Step("cost-ample-stock", 120, f"a dummy 7B: compile, capture, 32 x 384 tokens; {GUESS}", cap_s=200),
        Step("cost-ample-plugin", 140, f"as stock, three workloads; {GUESS}", cap_s=220),
        Step("check-float32-tiny-llama-streamingllm", 90, f"a tiny Llama, one engine; {GUESS}", cap_s=150),
        Step("cost-tight-stock", 120, "as cost-ample-stock", cap_s=200),
        Step("cost-tight-plugin", 140, "as cost-ample-plugin", cap_s=220),
        Step("check-bfloat16-testbed-dynts", 100, "as its float32 run", cap_s=150),
        Step("check-bfloat16-tiny-llama-streamingllm", 90, "as its float32 run", cap_s=150),
    ]


def _check(label: str, model: str, dtype: str, extra: list[str], root: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "dynts.cli", "vllm-check", model, "--dtype", dtype, "--attention-backend", BACKEND,
               "--cudagraph-mode", GRAPHS, "--gpu-memory-utilization", "0.3", "--json", str(root / f"{label}.json"),
               *extra]
    return {"label": label, "kind": "vllm-check", "command": command}


def plan(root: Path, models: dict[str, str], predictor: str, cost: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps' commands in :func:`bundle_steps`'s order, each with its estimate and time box. ``models``:
    ``testbed`` and ``tiny-llama`` paths; ``cost``: :func:`cost_specs`'s engines."""
    smoke = {"label": "smoke", "kind": "smoke",
             "command": [sys.executable, str(ROOT / "scripts" / "vllm_gpu_bundle" / "smoke.py"),
                         "--json", str(root / "smoke.json")]}
    testbed = ["--predictor", predictor]
    steps = {s["label"]: s for s in [
        smoke,
        _check("check-float32-testbed-dynts", models["testbed"], "float32", testbed, root),
        _check("check-float32-tiny-llama-streamingllm", models["tiny-llama"], "float32", [], root),
        _check("check-bfloat16-testbed-dynts", models["testbed"], "bfloat16", testbed, root),
        _check("check-bfloat16-tiny-llama-streamingllm", models["tiny-llama"], "bfloat16", [], root)]}
    for name, spec in cost.items():
        path = root / f"{name}.spec.json"
        path.write_text(json.dumps(spec))
        steps[name] = {"label": name, "kind": "cost",
                       "command": [sys.executable, "-m", "eval.perf.vllm_gpu_bundle", "--engine", str(path)]}
    return [{**steps[step.name], "step": step} for step in bundle_steps() if step.name in steps]


def cost_specs(model: str, predictor: str, *, requests: int = 32, prompt: int = 128, generate: int = 384,
               budget: int = 256, local_window: int = 32, block: int = 16) -> dict[str, dict[str, Any]]:
    """The cost engines: stock and plugin at an ample pool (vLLM's own sizing) and at a tight one (room for a
    quarter of the requests at full length, for twice as many at ``budget``)."""
    tight = requests // 4 * -(-(prompt + generate) // block)
    above = prompt + generate + 1
    base = {"model": model, "requests": requests, "prompt": prompt, "generate": generate}
    plugin = {"method": "dynts", "budget": budget, "local_window": local_window, "predictor": predictor,
              "think_end": None, "max_budget": above}  # the first workload's requests ask for a budget above every length
    workloads = [{"label": f"plugin@{above} (nothing evicted)",
                  "extra_args": {"dynts": {"method": "streamingllm", "budget": above}}},
                 {"label": f"dynts@{budget}", "extra_args": None},
                 {"label": f"streamingllm@{budget}", "extra_args": {"dynts": {"method": "streamingllm"}}}]
    specs = {}
    for pool, blocks in (("ample", None), ("tight", tight)):
        specs[f"cost-{pool}-stock"] = {**base, "pool_blocks": blocks, "dynts": None,
                                       "workloads": [{"label": "stock", "extra_args": None}]}
        specs[f"cost-{pool}-plugin"] = {**base, "pool_blocks": blocks, "dynts": plugin, "workloads": workloads}
    return specs


def _models(root: Path, shape: dict[str, Any]) -> dict[str, Any]:
    """What the steps run: the testbed LRM and its predictor; a tiny random Llama with R1-Distill-7B's attention head
    (:func:`.vllm_v2_check.tiny_r1_model`); the dummy-weight model of ``shape`` (its config and the testbed tokenizer,
    which the plugin's worker loads; no weights: ``load_format="dummy"``) and a random predictor of its width."""
    import torch
    from transformers import Qwen2Config

    import dynts
    from dynts.models import checkpoints_dir, load_tokenizer

    big = root / "dummy-r1-distill-qwen-7b"
    config = Qwen2Config(**shape)  # the engines name their dtype
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(big)
    load_tokenizer("testbed").save_pretrained(big)
    torch.manual_seed(0)
    return {"checks": {"testbed": "testbed", "tiny-llama": str(tiny_r1_model(root))},
            "predictor": str(checkpoints_dir() / "testbed-predictor"), "cost_model": str(big),
            "cost_predictor": str(dynts.ImportancePredictor(shape["hidden_size"]).save_pretrained(root / "predictor"))}


def decide(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each ``vllm-check`` run's verdict (``VERDICTS`` of its exit status), the bfloat16 run that is inconclusive
    decided by the float32 run of the same model (``decided_by``; ``inconclusive`` when that did not run); sets
    ``verdict`` and ``decided_by`` on the runs, returns ``verdicts`` and the ``inconclusive`` labels."""
    checks = {r["label"]: r for r in runs if r["kind"] == "vllm-check" and "status" in r}
    for label, run in checks.items():
        own = VERDICTS.get(run["status"], "error")
        decisive = checks.get(label.replace("bfloat16", "float32")) if own == "inconclusive" else run
        run["decided_by"] = decisive["label"] if decisive else None
        run["verdict"] = VERDICTS.get(decisive["status"], "error") if decisive else "inconclusive"
    return {"verdicts": {label: run["verdict"] for label, run in checks.items()},
            "inconclusive": [label for label, run in checks.items() if run["status"] == 4]}


def _run_step(step: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(step["command"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
        status, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        status = None
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or "") \
            + f"\ntimed out after {timeout:.0f} s"
    row: dict[str, Any] = {"label": step["label"], "kind": step["kind"], "status": status,
                           "seconds": round(time.perf_counter() - t0, 1)}
    if step["kind"] == "cost":
        lines = [x for x in out.splitlines() if x.startswith("COST ")]
        row["result"] = json.loads(lines[-1][5:]) if lines and status == 0 else None
    else:
        path = Path(step["command"][step["command"].index("--json") + 1])
        result = json.loads(path.read_text()) if path.exists() else {}
        row["result"] = result
        if step["kind"] == "vllm-check":
            row["engine"] = result.get("engine")
    if status != 0 or row.get("result") is None:
        row["output_tail"] = (out[-2500:] + "\n--- stderr ---\n" + err[-3500:]).strip()
    return row


def run_bundle(bundle: Path, dry_run: bool, budget_s: float, shape: dict[str, Any]) -> dict[str, Any]:
    """Install the bundle, make the models and run :func:`plan` against a running deadline of ``budget_s`` seconds: a
    step runs when its estimate fits in what is left (time-boxed at what is left, at most its cap), else it is listed
    under ``skipped`` with both numbers. A dry run lists the commands only (on CPU no engine runs). ``shape``: the
    cost model's Qwen2 configuration (R1-Distill-Qwen-7B's)."""
    deadline = Deadline(budget_s)
    steps_by_name = {step.name: step for step in bundle_steps()}
    root = Path(tempfile.mkdtemp(prefix="vllm-gpu-bundle-"))
    out: dict[str, Any] = {"bundle": str(bundle), "budget_s": budget_s, "refused": REFUSED, "runs": [],
                           "skipped": deadline.skipped}
    if not dry_run and sys.version_info[:2] != PYTHON:
        out.update(ok=False, error=f"the bundle holds CPython {PYTHON[0]}.{PYTHON[1]} wheels, this is Python "
                                   f"{sys.version.split()[0]}: rebuild it for this Python (scripts/vllm_gpu_bundle)")
        return out
    out["install"] = install(bundle, root / "site")
    made = _models(root, shape)
    steps = plan(root, made["checks"], made["predictor"], cost_specs(made["cost_model"], made["cost_predictor"]))
    env = child_env(root / "site", root / "vllm-cache")
    print(f"vllm_v2 (bundle): installed {out['install']['wheels']} wheels in {out['install']['seconds']:.0f} s; "
          f"{len(steps)} steps, {deadline.left():.0f} s left", flush=True)
    for step in steps:
        if dry_run:
            out["runs"].append({"label": step["label"], "kind": step["kind"], "command": step["command"],
                                "estimate_s": step["step"].estimate_s})
            continue
        smoke = out["runs"][0] if out["runs"] else None
        if smoke is not None and smoke["label"] == "smoke" and smoke["status"] not in (0, 4):
            deadline.skipped.append({"section": step["label"], "reason": "the smoke's engine did not run: see its output"})
            continue
        if not deadline.admits(steps_by_name[step["label"]]):
            print(f"vllm_v2 {step['label']}: skipped ({deadline.skipped[-1]['reason']})", flush=True)
            continue
        row = _run_step(step, env, deadline.box(step["step"]))
        out["runs"].append(row)
        said = VERDICTS.get(row["status"], "error") if row["kind"] == "vllm-check" else ""
        print(f"vllm_v2 {row['label']}: status {row['status']} {said} ({row['seconds']} s) "
              f"{json.dumps(row.get('engine') or '')[:300]}", flush=True)
    out.update(decide(out["runs"]))
    ran = {r["label"]: r for r in out["runs"] if "status" in r}
    decisive = ("smoke", "check-float32-testbed-dynts")  # the run says nothing without these
    out["complete"] = not out["skipped"]
    out["ok"] = dry_run or (all(label in ran for label in decisive)
                            and all(v == "exact" for v in out["verdicts"].values())
                            and all(r["status"] in (0, 4) for r in ran.values() if r["kind"] != "vllm-check"))
    out["seconds"] = time.perf_counter() - deadline.started
    shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------------- one cost engine
def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def count_preemptions(scheduler: Any) -> list[int]:
    """Count the calls of an in-process scheduler's ``_preempt_request`` from now on (a one-element list)."""
    count = [0]
    original = scheduler._preempt_request

    def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(request, *args, **kwargs)

    scheduler._preempt_request = counted
    return count


def cost_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (stock, or the plugin) over ``spec["workloads"]`` in turn, each ``requests`` random prompts of
    ``prompt`` tokens generating ``generate`` (greedy, ``ignore_eos``), after an untimed warm-up. In this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler's counters are readable)."""
    from dynts.vllm.selfcheck import counting_graph_replays

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with counting_graph_replays() as replays:  # every workload reads its difference
        return _cost_engine(spec, replays)


def _cost_engine(spec: dict[str, Any], replays: list[int]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams

    from dynts.vllm.metrics import request_stats
    from dynts.vllm.selfcheck import engine_info

    kwargs: dict[str, Any] = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                                  attention_backend=BACKEND, max_model_len=spec["prompt"] + spec["generate"] + 16,
                                  max_num_seqs=spec["requests"], seed=0)
    if torch.cuda.is_available():  # vLLM's default 0.9 of the GPU where that much is free (the check holds a model)
        free, total = torch.cuda.mem_get_info()
        kwargs["gpu_memory_utilization"] = min(0.9, round(free / total - 0.03, 2))
    if spec["pool_blocks"]:
        kwargs["num_gpu_blocks_override"] = spec["pool_blocks"]
    if spec["dynts"]:
        kwargs["additional_config"] = {"dynts": spec["dynts"]}
    kwargs.update(spec.get("engine") or {})  # overrides (the CPU test: vLLM's CPU backend, eager, float32)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = count_preemptions(scheduler)
    pool = scheduler.kv_cache_manager.block_pool
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(0)

    def workload(n: int, generate: int, extra_args: Any) -> dict[str, Any]:
        params = SamplingParams(temperature=0, max_tokens=generate, ignore_eos=True, extra_args=extra_args,
                                detokenize=False)
        for i in range(n):  # random ids (no think_end is set: no id ends a phase)
            engine.add_request(f"{time.perf_counter_ns()}-{i}",
                               {"prompt_token_ids": torch.randint(4, vocab, (spec["prompt"],), generator=g).tolist()},
                               params)
        seen: dict[str, tuple[int, float]] = {}
        itl: list[float] = []
        flight, blocks, tokens, evictions = [], [], 0, 0
        r0, p0, start = replays[0], preemptions[0], time.perf_counter()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for o in outputs:
                count = len(o.outputs[0].token_ids)
                before, at = seen.get(o.request_id, (0, start))
                if count > before:
                    if before:  # after the first token: the gaps between tokens, a multi-token arrival split evenly
                        itl.extend([(now - at) / (count - before)] * (count - before))
                    seen[o.request_id] = (count, now)
                if o.finished:
                    tokens += count
                    evictions += sum(s["evictions"] for s in request_stats(o.kv_transfer_params) or ())
            flight.append(len(scheduler.running))
            blocks.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "steps": len(flight),
                "in_flight_mean": sum(flight) / len(flight), "in_flight_max": max(flight),
                "preemptions": preemptions[0] - p0, "peak_blocks": max(blocks), "evictions": evictions,
                "itl_p50_ms": 1e3 * (_percentile(itl, 0.5) or 0), "itl_p99_ms": 1e3 * (_percentile(itl, 0.99) or 0),
                "graph_replays": replays[0] - r0, "graph_replays_per_step": (replays[0] - r0) / len(flight)}

    # untimed warm-up at full length: Triton's first launches at each shape
    workload(2, spec["generate"], spec["workloads"][0]["extra_args"])
    table = hooks_memory(llm)
    runs = []
    for w in spec["workloads"]:
        runs.append({"label": w["label"], **workload(spec["requests"], spec["generate"], w["extra_args"])})
    memory = hooks_memory(llm)
    if "table_pointers" in table:
        memory["slot_table_reallocated"] = memory.pop("table_pointers") != table["table_pointers"]
    return {"engine": engine_info(llm), "init_s": init_s, "gpu_memory_utilization": kwargs.get("gpu_memory_utilization"),
            "pool_blocks": pool.num_gpu_blocks, "pool_override": spec["pool_blocks"], "requests": spec["requests"],
            "prompt": spec["prompt"], "generate": spec["generate"], "dynts": spec["dynts"], "workloads": runs,
            "memory": memory}


def hooks_memory(llm: Any) -> dict[str, Any]:
    """What the plugin's worker holds (an in-process worker): whether its state was made in vLLM's profiling run, the
    slot table's shape, bytes and column addresses, the predictor's bytes; and the device's peak allocated memory
    against what vLLM was allowed (``gpu_memory_utilization`` of the device)."""
    import torch

    from dynts.vllm.selfcheck import model_runner

    runner = model_runner(llm)
    out: dict[str, Any] = {}
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        utilization = llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
        out.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30, allowed_gib=utilization * total / 2**30)
    hooks = getattr(runner, "_dynts", None)
    if hooks is None:
        return out
    table = hooks.tracker.table
    state = getattr(runner, "_dynts_state", None)
    predictor = hooks.predictor
    out.update(from_profile=state is not None and state.table is table, table_shape=[table.rows, table.width],
               table_bytes=sum(c.numel() * c.element_size() for _, c in table.columns()),
               predictor_bytes=0 if predictor is None else sum(p.numel() * p.element_size() for p in predictor.parameters()),
               table_pointers=[c.data_ptr() for _, c in table.columns()])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=Path, help="run one cost engine from this spec (a step of the plan)")
    parser.add_argument("--out", type=Path, help="write vllm_gpu_bundle.json here (the whole plan)")
    parser.add_argument("--budget-s", "--seconds", dest="budget_s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"the running deadline (default {DEFAULT_BUDGET_S:.0f}; one device call runs at most 600)")
    parser.add_argument("--dry-run", action="store_true", help="install and list the commands only (CPU)")
    args = parser.parse_args(argv)
    if args.engine:
        print("COST " + json.dumps(cost_engine(json.loads(args.engine.read_text()))), flush=True)
        return 0
    if args.out is None:
        parser.error("--out or --engine")
    if not 0 < args.budget_s <= 600:
        parser.error(f"--budget-s {args.budget_s:g} must be in (0, 600]: one device call runs at most 600 s")
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = find_bundle()
    if bundle is not None:
        from .random_models import R1_DISTILL_7B

        result = run_bundle(bundle, args.dry_run, args.budget_s, R1_DISTILL_7B)
    elif importlib.util.find_spec("vllm") is not None:  # vLLM's CUDA wheel installed beside the checkout
        from .vllm_v2_check import vllm_v2_check

        result = vllm_v2_check(args.dry_run)
    else:
        result = {"ok": False, "skipped": f"no vLLM here and no bundle carried: build it with `{BUILD}` and carry "
                                          f"{BUNDLE.name} (docs/vllm.md, 'vLLM on the lent GPU')"}
        print(f"vllm_gpu_bundle: {result['skipped']}", file=sys.stderr)
    (args.out / "vllm_gpu_bundle.json").write_text(json.dumps(result, indent=1, default=str))
    return 0 if result.get("ok") else 1 if bundle is not None or "runs" in result else 2


if __name__ == "__main__":
    sys.exit(main())
