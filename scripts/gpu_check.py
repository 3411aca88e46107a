"""The first of a lending's two prepared GPU commands: versions, kernels, the vLLM worker hooks, exactness, decode
and serving speed at 7B shapes, one JSON. The second is the carried vLLM (``python -m eval.perf.vllm_gpu_bundle``).

A lending is 15 minutes of device time in all and one command at most 10 minutes, so the sections run most
informative first against a running deadline (``--budget-s``, default 540 s): each has an estimate
(:func:`eval.perf.gpu_plans.gpu_steps`, from the 2026-12-04 H200 run where measured), runs only when that fits in
what is left, time-boxed at what is left (at most its cap), and a section that does not fit is listed under
``skipped`` with its estimate and the seconds that were left. ``--dry-run --plan`` lists both commands and their
time plans, alone and in one lending, without a GPU. Sections, in order (each saved to ``gpu_check.json`` as it
finishes):

(1) ``versions``: python, torch, CUDA, triton, transformers, huggingface-hub, checked against the
    ranges in ``pyproject.toml`` and against ``import dynts`` (which refuses an unsupported
    transformers). A release outside the core range stops the script before any test or timing
    (exit 2; the JSON says why): timings of a cache that computes wrong tokens are worth nothing. The
    ``serve`` extra's narrower range (``import dynts.serving``) only gates the serving sections, which are then
    skipped with the reason.
(2) ``kernels``: keep-top's start-up compile (:func:`dynts.kernels.warm_up_kernels`); Triton compaction and keep-top
    vs the torch reference at the real layout, K/V ``[16, 4, 8192, 128]`` bf16 (bitwise: they only move data), with
    their times; keep-top at B = 4k / 16k / 64k (16 rows, tiled, one compiled kernel for every budget: Triton's
    compiled variants must not change across budgets, ``recompiled``).
(3) ``vllm``: the vLLM plugin's worker side at the R1-7B attention shape (28 layers, 4 KV heads, head 128, block 16,
    bf16), without vLLM's engine: the slot move of one eviction round of 32 requests at B = 4096 (``PagedKV``: one
    Triton launch for all 28 layers, compiled by its warm-up, ``warm_up_s``; the timed rounds compile nothing,
    ``recompiled``) on FLASH_ATTN's KV cache as vLLM allocates it (``LBNHC``; ``LBHNC`` beside it), exact against a
    reference gather, median of 10 (CUDA events), GB/s and its share of the 4.3 TB/s bound, its peak scratch; the
    worker hooks (``scripts/bench_vllm_hooks.py``: DynTS + a random predictor, up to 256 rows decoding one token
    each) on the stand-in V1 and V2 runners: microseconds and host syncs per plain decode step and per eviction round
    (``hooks_by_runner``), each after a small run that checks every row's stored K/V against the evictor's decisions;
    ``graph_replay``: the V2 hooks between replays of a captured CUDA graph of a stand-in forward that reads the
    runner's persistent buffers (:mod:`eval.perf.vllm_graph_check`), against the eager drive.
(4) ``logits``: a bounded cache that never evicts vs a plain forward: bf16 logits within 4 ulps of the
    largest logit (SDPA on strided views and on contiguous tensors may sum in another order: no
    bitwise demand) and, in float32, greedy tokens identical to ``model.generate``.
(5) ``tests``: ``pytest -m cuda`` (tests/test_cuda.py).
(6) ``serve_graphs``: DynTS in continuous batching with the engine's CUDA graphs on vs off (a random-init model,
    float32, a random predictor): the same tokens and kept sets at every event, graph replays counted.
(7) ``model``: a RANDOM-INIT model of DeepSeek-R1-Distill-Qwen-7B's shape in bf16 (28 layers, hidden 3584, 28 query /
    4 KV heads, head dim 128; speed does not depend on the weights), for the speed sections.
(8) ``decode``: ``scripts/bench_decode.py``'s measurement (:mod:`eval.perf.decode_bench`) at L = 8k / 16k / 32k,
    one combination at a time in :data:`eval.perf.gpu_plans.DECODE`'s order (eager batch 1 B = 4096, compiled batch
    1, then, after the serving section, eager batch 16, ...): speedup vs the full cache, t / t_full(B), peak KV and
    GPU memory. Every lane takes one untimed decode step before its timed ones; a compiled full cache is ONE static cache of capacity
    max(L) + 3N + 1 for every L (``full_capacity``), so its t_full(L) does not grow with L.
(9) ``serve``: ``scripts/bench_serve.py`` on the same model: stock continuous batching vs per-request eviction at one
    block pool (8 requests, room for 4 at full length), StreamingLLM and DynTS (a random-init predictor) when it fits.
(10) ``attention_stats``: H2O/SnapKV/R-KV statistics of one decode step (``attention_rows``, 28 query / 4 KV heads,
    4096 keys, batch 16, bf16), ``q k^T`` in bf16 vs the key cache cast to float32.

Run it there (the device tool's ``run``, ``timeout_s=600``; the image has no install of this checkout,
``PYTHONPATH=$PWD`` puts its packages on the path)::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 scripts/gpu_check.py --out $OUT --budget-s 540

A call copies the working tree and the carried paths, 64 MiB at most, and the tree is ~128 MB (reports/, the
testbed checkpoints): ``bash scripts/gpu_tree.sh stash`` before it moves out what the check does not read (it
prints what travels, ~6 MiB; the second command carries the bundle's 32 MiB besides), ``bash scripts/gpu_tree.sh
restore`` after it puts it back. docs/performance.md, "GPU checks in one lending", has both commands in one lending.

dynts supports transformers ``>=5.17,<5.26`` (``dynts/hf_compat.py``), so the image's own release
runs every section but the serving ones; those need ``dynts.serving``'s narrower range. To run them
on an older image, carry wheels of transformers and its huggingface-hub (``pip download --no-deps
--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl transformers==X
huggingface-hub==Y``, ``carry=[".whl"]``) and put them first on the path there (``pip install
--no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD``).

On CPU every section runs at tiny shapes (tests collected only), so the script is known to run
(tests/test_gpu_check.py)::

    python scripts/gpu_check.py --dry-run --out /tmp/gpu_check          # the plans, then every section, tiny
    python scripts/gpu_check.py --dry-run --plan --out /tmp/gpu_check   # the plans only
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import platform
import signal
import subprocess
import sys
import time
import tomllib
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # eval.perf.time_plan, also when run without PYTHONPATH
from eval.perf.gpu_plans import combo_name, gpu_steps, lending_plans, plan, print_plans  # noqa: E402
from eval.perf.time_plan import DEFAULT_BUDGET_S, Deadline  # noqa: E402
# dynts, eval.perf.decode_bench and bench_serve are imported only after check_versions() accepted the release

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)
MID = dict(  # the logits check: big enough for real kernels, small enough for float32
    vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
)
PACKAGES = {"torch": "torch", "transformers": "transformers", "huggingface-hub": "huggingface_hub", "triton": "triton"}


def build_model(shape: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Qwen2 of ``shape``, created directly on ``device`` in ``dtype``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(before)
    return model.eval()


@contextmanager
def time_box(seconds: float):
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (whole seconds, at least 1; ``inf``: no box)."""
    if math.isinf(seconds):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"time box of {seconds:.0f} s expired")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_tests(dry_run: bool, seconds: float) -> dict:
    """``pytest -m cuda`` in a subprocess (collection only in a dry run: there is no GPU)."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    if dry_run:
        command.append("--collect-only")
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=None if math.isinf(seconds) else seconds)
        tail, rc = (done.stdout + done.stderr)[-4000:], done.returncode
    except subprocess.TimeoutExpired as err:
        tail, rc = f"timed out after {seconds:.0f} s\n{(err.stdout or b'')[-3000:]!r}", 124
    return dict(command=" ".join(command[1:]), returncode=rc, seconds=time.perf_counter() - started, output_tail=tail)


def kv_bytes_per_token(shape: dict, dtype: torch.dtype) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * torch.finfo(dtype).bits // 8


def run_combo(model, combo: dict, args, shape: dict, dtype) -> dict:
    from eval.perf.decode_bench import DecodeSettings, bench_positions

    steps = 4 if args.dry_run else 8
    settings = DecodeSettings(budget=combo["budget"], local_window=combo["budget"] // 16, steps=steps, prompt_tokens=32,
                              full_chunk=256 if args.dry_run else 4096, compile=combo["compile"])
    label = "tiny-random" if args.dry_run else "random-R1-Distill-Qwen-7B-bf16"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = bench_positions(model, label, combo["batch"], combo.get("methods", args.methods), combo["positions"], settings)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    rows = []
    for row in run["rows"]:
        rows.append(dict(
            position=row["position"], t_full_L_ms=1e3 * row["t_full_L"], t_full_B_ms=1e3 * row["t_full_B"],
            full_capacity=row["full_capacity"],
            full_peak_kv_bytes=row["full_peak_kv_bytes"],
            methods={name: dict(t_ms=1e3 * r["t_amortised"], t_top_ms=1e3 * r["t_top"], t_event_ms=1e3 * r["t_event"],
                                speedup=r["speedup"], t_over_t_full_B=r["amortised_over_full_B"],
                                peak_kv_bytes=r["peak_kv_bytes"], kv_ratio=r["kv_ratio"])
                     for name, r in row["methods"].items()},
        ))
    return dict(**combo, n_keep=run["n_keep"], eviction_volume=run["eviction_volume"], steps=steps,
                peak_gpu_bytes=peak, rows=rows)


def print_combo(record: dict) -> None:
    tag = "compiled" if record["compile"] else "eager"
    methods = f" {', '.join(record['methods'])}" if "methods" in record else ""
    print(f"\n== {tag} batch {record['batch']} B={record['budget']}{methods} ({record['seconds']:.0f} s, peak GPU "
          f"{(record['peak_gpu_bytes'] or 0) / 2**30:.1f} GiB)")
    if record["rows"] and record["rows"][0]["full_capacity"]:
        print(f"  full: ONE static cache of capacity {record['rows'][0]['full_capacity']} for every L (t_full(L) is "
              "flat in L); full@B: a static cache of B")
    for row in record["rows"]:
        cells = "  ".join(f"{m}: {r['t_ms']:.2f} ms x{r['speedup']:.2f} t/tB {r['t_over_t_full_B']:.3f}"
                          for m, r in row["methods"].items())
        print(f"  L={row['position']:>6} full {row['t_full_L_ms']:.2f} ms, full@B {row['t_full_B_ms']:.2f} ms | {cells}")


# ---------------------------------------------------------------------------------------------- sections
def check_versions() -> dict:
    """Installed versions vs ``pyproject.toml`` and vs dynts's own import-time checks: ``refused`` lists
    every reason not to run at all (core dependencies, ``import dynts``), ``serving_refused`` every reason
    to skip the serving sections (the ``serve`` extra, ``import dynts.serving``)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = [Requirement(r) for r in project["dependencies"]]
    serve = [Requirement(r) for r in project["optional-dependencies"].get("serve", [])]
    found = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for dist in PACKAGES:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = getattr(sys.modules.get(PACKAGES[dist]) or _try_import(PACKAGES[dist]), "__version__", None)

    def outside(wanted: list) -> list[str]:
        return [f"{req.name} {found[req.name]} is outside the supported {req} (pyproject.toml)" for req in wanted
                if req.name in PACKAGES and found.get(req.name) is not None
                and not req.specifier.contains(found[req.name].split("+")[0], prereleases=True)]

    refused, serving_refused = outside(core), outside(serve)
    for module, reasons in (("dynts", refused), ("dynts.serving", serving_refused)):  # their own checks
        try:
            importlib.import_module(module)
        except ImportError as err:  # names the release and the fix
            reasons.append(f"import {module}: {err}")
    return dict(found=found, required=[str(r) for r in core + serve if r.name in PACKAGES], refused=refused,
                serving_refused=serving_refused)


def _try_import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _cuda_ms(fn, repeat: int, device: torch.device) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def kernel_check(device: torch.device, dry_run: bool) -> dict:
    """compact_ / keep_top_indices (Triton on CUDA) vs the torch reference at ``[b, h, n, d]``; keep-top's start-up
    compile (:func:`dynts.kernels.warm_up_kernels`), then keep-top at budgets up to 64k (:func:`keep_top_by_budget`)."""
    from dynts.kernels import backend_for, compact_, compact_torch_, keep_top_indices, keep_top_torch, warm_up_kernels

    warm = warm_up_kernels(device=device)  # first: its seconds are the compile's
    b, h, n, d = (2, 2, 64, 16) if dry_run else (16, 4, 8192, 128)
    dtype = torch.float32 if dry_run else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    k = n // 2 + n // 7
    priority = torch.randperm(b * n, generator=g).float().view(b, n).to(device)  # distinct: no ties
    valid = (torch.rand(b, n, generator=g) > 0.05).to(device)
    kept = keep_top_indices(priority, valid, k)
    select_equal = torch.equal(kept.cpu(), keep_top_torch(priority.cpu(), valid.cpu(), k))
    buffers = [torch.randn(b, h, n, d, generator=g).to(device, dtype) for _ in range(4)]  # K and V of 2 layers
    expected = [t.clone() for t in buffers]
    compact_torch_(expected, kept, n)
    compact_(buffers, kept, n)
    compact_equal = all(torch.equal(a[:, :, :k], e[:, :, :k]) for a, e in zip(buffers, expected))
    # per-head selection: each layer's KV head its own kept set [b, L, h, k]
    per_head = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(b * 2 * h)]).view(b, 2, h, k)
    per_head, owners = per_head.to(device), [0, 0, 1, 1]
    heads = [t.clone() for t in expected]
    heads_expected = [t.clone() for t in expected]
    compact_torch_(heads_expected, per_head, n, owners)
    compact_(heads, per_head, n, owners)
    per_head_equal = all(torch.equal(a[:, :, :k], e[:, :, :k]) for a, e in zip(heads, heads_expected))
    scratch = [t.clone() for t in buffers]
    times = dict(compact_ms=_cuda_ms(lambda: compact_(scratch, kept, n), 5, device),
                 compact_torch_ms=_cuda_ms(lambda: compact_torch_(scratch, kept, n), 5, device),
                 compact_per_head_ms=_cuda_ms(lambda: compact_(scratch, per_head, n, owners), 5, device),
                 compact_per_head_torch_ms=_cuda_ms(lambda: compact_torch_(scratch, per_head, n, owners), 5, device),
                 select_ms=_cuda_ms(lambda: keep_top_indices(priority, valid, k), 5, device),
                 select_torch_ms=_cuda_ms(lambda: keep_top_torch(priority, valid, k), 5, device))
    by_budget = keep_top_by_budget(device, dry_run, warm["backend"] == "triton")
    return dict(layout=[b, h, n, d], dtype=str(dtype), n_keep=k, backend=backend_for(buffers[0]),
                select_equal=select_equal, compact_equal=compact_equal, per_head_equal=per_head_equal,
                warm_up=warm, keep_top_by_budget=by_budget,
                ok=select_equal and compact_equal and per_head_equal and by_budget["ok"], **times)


def keep_top_by_budget(device: torch.device, dry_run: bool, triton: bool) -> dict:
    """Keep-top (tiled: one compiled kernel for every budget) at the budgets of long reasoning, 16 rows of
    ``B + B / 8`` slots each (an event), vs the torch reference: equal, milliseconds of both, and Triton's compiled
    variants before and after (``recompiled`` must stay false after the warm-up)."""
    from dynts.kernels import compiled_variants, keep_top_indices, keep_top_torch

    before = compiled_variants() if triton else None
    g = torch.Generator(device="cpu").manual_seed(1)
    rows, budgets = (2, [16, 64, 256]) if dry_run else (16, [4096, 16384, 65536])
    out: dict = {"rows": rows, "budgets": {}}
    for budget in budgets:
        n = budget + budget // 8
        priority = torch.randn(rows, n, generator=g).to(device)
        valid = (torch.rand(rows, n, generator=g) > 0.05).to(device)
        equal = torch.equal(keep_top_indices(priority, valid, budget).cpu(), keep_top_torch(priority, valid, budget).cpu())
        out["budgets"][budget] = dict(slots=n, equal=equal,
                                      ms=_cuda_ms(lambda: keep_top_indices(priority, valid, budget), 5, device),
                                      torch_ms=_cuda_ms(lambda: keep_top_torch(priority, valid, budget), 5, device))
    out["variants_before"], out["variants_after"] = before, compiled_variants() if triton else None
    out["recompiled"] = before != out["variants_after"]
    out["ok"] = all(r["equal"] for r in out["budgets"].values()) and not out["recompiled"]
    return out


def attention_stats_check(device: torch.device, dry_run: bool) -> dict:
    """One layer's decode-step statistics, ``q k^T`` in bf16 (shipped) vs float32-cast keys."""
    from dynts.attention import attention_rows

    b, hq, hk, n, d = (2, 4, 2, 64, 16) if dry_run else (16, 28, 4, 4096, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(b, hq, 1, d, generator=g).to(device, torch.bfloat16)
    key = torch.randn(b, hk, n, d, generator=g).to(device, torch.bfloat16)
    shipped = _cuda_ms(lambda: attention_rows(query, key, None, d**-0.5), 20, device)
    fp32 = _cuda_ms(lambda: attention_rows(query.float(), key.float(), None, d**-0.5), 20, device)
    diff = (attention_rows(query, key, None, d**-0.5) - attention_rows(query.float(), key.float(), None, d**-0.5)).abs()
    return dict(query=[b, hq, 1, d], key=[b, hk, n, d], bf16_ms=shipped, fp32_keys_ms=fp32, ratio=shipped / fp32,
                per_step_28_layers_ms=dict(bf16=28 * shipped, fp32_keys=28 * fp32), max_prob_diff=float(diff.max()))


def _cached_decode(model, ids: torch.Tensor, steps: int):
    """Greedy tokens and per-step logits ``[b, steps, V]`` through a bounded cache that never evicts."""
    import dynts
    from dynts.hf_compat import cache_keyword

    budget = ids.shape[1] + steps + 8
    cache = dynts.build_cache(model, dynts.make_evictor("window"), dynts.Budget(budget, 4, 0.5))
    cache_kw = cache_keyword(model)
    logits, token = [], ids
    with torch.no_grad(), dynts.attach(model, cache):
        for _ in range(steps):
            out = model(input_ids=token, **{cache_kw: cache})
            logits.append(out.logits[:, -1].float())
            token = out.logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, token], 1)
    return ids, torch.stack(logits, 1)


def logits_check(device: torch.device, dry_run: bool) -> dict:
    """bf16: cached-decode logits vs one plain forward over the same tokens, within 4 ulps of the
    largest logit; float32: ``dynts.generate`` (no eviction) token-identical to ``model.generate``."""
    import dynts

    shape, b, m, steps = (TINY, 2, 16, 8) if dry_run else (MID, 4, 96, 64)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(3, shape["vocab_size"], (b, m), generator=g).to(device)
    model = build_model(shape, str(device), torch.bfloat16)
    seq, cached = _cached_decode(model, ids, steps)
    with torch.no_grad():
        plain = model(input_ids=seq[:, :-1]).logits[:, m - 1 :].float()
    scale = float(plain.abs().max())
    ulps = float((cached - plain).abs().max()) / (torch.finfo(torch.bfloat16).eps * scale)
    model = build_model(shape, str(device), torch.float32)
    with torch.no_grad():
        reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                   do_sample=False, pad_token_id=0, eos_token_id=None)[:, m:]
    ours = dynts.generate(model, input_ids=ids, method="window", budget=m + steps + 8, local_window=4,
                          max_new_tokens=steps, do_sample=False, pad_token_id=0, eos_token_id=None, think_end=None)
    identical = torch.equal(ours.sequences, reference)
    del model
    return dict(shape=shape, batch=b, prompt=m, steps=steps, bf16_max_err_ulps_of_max_logit=ulps, bf16_tolerance_ulps=4,
                fp32_tokens_identical=identical, ok=ulps <= 4 and identical)


def serve_check(model, dry_run: bool, seconds: float = math.inf) -> dict:
    """``scripts/bench_serve.py``: stock continuous batching vs eviction at one block pool: StreamingLLM, then DynTS
    (a random-init predictor: speed does not depend on its weights) when its run (estimated at 1.3x StreamingLLM's)
    fits in what is left of ``seconds`` (else listed under ``skipped``)."""
    import bench_serve

    import dynts
    from dynts.serving import EvictionSettings

    started = time.perf_counter()
    cfg = (dict(requests=4, prompt=8, generate=24, page=8, full_requests=1, max_batch_tokens=64, budget=16, window=4)
           if dry_run else
           dict(requests=8, prompt=32, generate=256, page=32, full_requests=4, max_batch_tokens=1024, budget=128, window=16))
    args = SimpleNamespace(generate=cfg["generate"], page=cfg["page"], max_batch_tokens=cfg["max_batch_tokens"])
    config = model.config.get_text_config()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (cfg["prompt"],), generator=g).tolist()
               for _ in range(cfg["requests"])]
    num_blocks = cfg["full_requests"] * math.ceil((cfg["prompt"] + cfg["generate"]) / cfg["page"])
    torch.manual_seed(0)
    predictor = dynts.ImportancePredictor(config.hidden_size).to(next(model.parameters()).device)  # float32
    attn = model.config._attn_implementation
    skipped = []
    try:
        bounded = dict(budget=cfg["budget"], local_window=cfg["window"], think_end=None)
        runs = [bench_serve.run(model, prompts, EvictionSettings("full", think_end=None), args, num_blocks),
                bench_serve.run(model, prompts, EvictionSettings("streamingllm", **bounded), args, num_blocks)]
        if time.perf_counter() - started + 1.3 * runs[1]["seconds"] < seconds - 5:
            dynts_settings = EvictionSettings("dynts", predictor=predictor, **bounded)
            runs.append(bench_serve.run(model, prompts, dynts_settings, args, num_blocks))
        else:
            skipped.append(f"dynts@{cfg['budget']}: out of time")
    finally:
        model.set_attn_implementation(attn)  # continuous batching switches the model to paged attention
    for r in runs:
        r.pop("trace")
    return dict(**cfg, pool_blocks=num_blocks, runs=runs, skipped=skipped,
                tokens_per_s_ratio=runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
                in_flight_mean_ratio=runs[1]["in_flight_mean"] / runs[0]["in_flight_mean"],
                tokens_per_s_ratio_by_method={r["name"]: r["tokens_per_s"] / runs[0]["tokens_per_s"] for r in runs[1:]})


def serve_graphs_check(device: torch.device, dry_run: bool) -> dict:
    """DynTS in continuous batching, the engine's CUDA graphs on vs off: tokens and kept sets must agree
    (the captured forward only fills the hidden-state buffer; the predictor runs after each replay)."""
    from transformers import ContinuousBatchingConfig

    import dynts

    shape, requests, prompt, new, budget, window, page = ((TINY, 4, 8, 24, 16, 4, 8) if dry_run
                                                          else (MID, 16, 64, 192, 128, 16, 32))
    model = build_model(shape, str(device), torch.float32)
    torch.manual_seed(1)
    predictor = dynts.ImportancePredictor(shape["hidden_size"]).to(device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, shape["vocab_size"], (prompt,), generator=g).tolist() for _ in range(requests)]
    evictor_cls, graph_cls = type(dynts.make_evictor("dynts")), torch.cuda.CUDAGraph
    select, replay = evictor_cls.__call__, graph_cls.replay
    runs, kept, replays = {}, [], [0]

    def recording(self, info):
        out = select(self, info)
        kept.append(out.cpu())
        return out

    def counting(self, *args, **kwargs):
        replays[0] += 1
        return replay(self, *args, **kwargs)

    attn = model.config._attn_implementation
    evictor_cls.__call__, graph_cls.replay = recording, counting
    try:
        for graphs in (False, True):
            kept.clear()
            replays[0] = 0
            cb = ContinuousBatchingConfig(num_blocks=requests * math.ceil(budget / page) + 4, page_size=page,
                                          max_batch_tokens=requests * 8, use_cuda_graph=graphs)
            t0 = time.perf_counter()
            results = dynts.generate_batch(model, None, prompts, method="dynts", budget=budget, local_window=window,
                                           predictor=predictor, max_new_tokens=new, do_sample=False, eos_token_id=None,
                                           think_end=None, continuous_batching_config=cb)
            runs[graphs] = dict(seconds=time.perf_counter() - t0, tokens=[r.sequence for r in results],
                                kept=list(kept), replays=replays[0])
    finally:
        evictor_cls.__call__, graph_cls.replay = select, replay
        model.set_attn_implementation(attn)  # continuous batching switches the model to paged attention
    off, on = runs[False], runs[True]
    tokens_same = off["tokens"] == on["tokens"]
    kept_same = len(off["kept"]) == len(on["kept"]) and all(torch.equal(a, b) for a, b in zip(off["kept"], on["kept"]))
    ok = tokens_same and kept_same and len(on["kept"]) > 0 and (dry_run or on["replays"] > 0)
    return dict(shape=shape, requests=requests, prompt=prompt, new_tokens=new, budget=budget, events=len(on["kept"]),
                tokens_identical=tokens_same, kept_identical=kept_same, graph_replays=on["replays"],
                seconds_graphs_off=off["seconds"], seconds_graphs_on=on["seconds"], ok=ok)


def decode_combo(model, combo: dict, args, shape: dict, dtype, result: dict, box: float) -> None:
    """One bench_decode combination inside ``box`` seconds: appended to ``result["bench"]``, or to
    ``result["skipped"]`` with why (no room in memory, its time box, out of memory)."""
    name = combo_name(combo)
    record = {k: v for k, v in combo.items() if k not in ("estimate_s", "basis")}
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    full_kv = combo["batch"] * (max(combo["positions"]) + 64) * kv_bytes_per_token(shape, dtype)
    if free is not None and full_kv > 0.8 * free:
        result["skipped"].append(dict(section=name, **record, reason=f"full cache {full_kv / 2**30:.1f} GiB > 80% of free memory"))
        return
    print(f"{name}: up to {box:.0f} s", flush=True)
    t0 = time.perf_counter()
    try:
        with time_box(box):
            out = run_combo(model, combo, args, shape, dtype)
    except TimeoutError as err:
        result["skipped"].append(dict(section=name, **record, reason=str(err)))
        print(f"  {err}", flush=True)
    except torch.cuda.OutOfMemoryError as err:
        result["skipped"].append(dict(section=name, **record, reason=f"out of memory: {str(err)[:200]}"))
    else:
        out["seconds"] = time.perf_counter() - t0
        result["bench"].append(out)
        print_combo(out)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _timed_ms(fn, repeat: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeat`` calls of ``fn()`` after one warm-up call: CUDA events on CUDA,
    ``perf_counter`` around a synchronize elsewhere."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def hooks_check(device: torch.device, dry_run: bool, runner: str) -> dict:
    """The worker hooks on the stand-in ``runner`` (``"v1"``: ``WorkerHooks``, ``"v2"``: ``RunnerV2Hooks``;
    :mod:`eval.perf.vllm_hooks_bench`): a checked run at a tiny shape, then microseconds (host until the hooks
    return, done until the device finished) and host syncs per plain decode step and per eviction round of 256
    rows at the R1-7B shape (fewer where their bf16 K/V would pass 60 % of free memory)."""
    from eval.perf.vllm_hooks_bench import SHAPES, HooksBenchSettings, run_hooks_bench

    check = run_hooks_bench(HooksBenchSettings(rows=4, shape="tiny", dtype="float32" if dry_run else "bfloat16",
                                               device=str(device), runner=runner, reps=1, plain_steps=3, verify=True,
                                               count_syncs=False))
    if dry_run:
        settings = HooksBenchSettings(rows=4, shape="tiny", dtype="float32", device="cpu", runner=runner, reps=2,
                                      plain_steps=3)
    else:
        shape, rows = SHAPES["r1-7b"], 256
        per_row = math.ceil(shape["budget"] / shape["block"]) * shape["block"] * 2 * shape["kv_heads"] * shape["head"]
        free = torch.cuda.mem_get_info()[0]
        while rows > 16 and rows * per_row * shape["layers"] * 2 > 0.6 * free:  # bf16 K/V of every row
            rows //= 2
        settings = HooksBenchSettings(rows=rows, shape="r1-7b", dtype="bfloat16", device=str(device), runner=runner,
                                      reps=5, plain_steps=8, max_seconds=30)
    bench = run_hooks_bench(settings)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(verified=check["verified"], rows=bench["rows"], hooks=bench["hooks"],
                us_per_plain_step=bench["plain"]["step"]["done_us"], us_per_event_round=bench["event"]["step"]["done_us"],
                host_us_per_plain_step=bench["plain"]["step"]["host_us"],
                host_us_per_event_round=bench["event"]["step"]["host_us"],
                syncs_per_plain_step=bench["syncs_per_plain_step"], syncs_per_event_round=bench["syncs_per_event_round"],
                bench={k: v for k, v in bench.items() if k != "settings"})


def graph_replay_check(device: torch.device, dry_run: bool) -> dict:
    """The V2 hooks between CUDA graph replays (:mod:`eval.perf.vllm_graph_check`): a stand-in forward reading the
    runner's persistent buffers, captured once, replayed across plain steps and eviction rounds of 16 rows; every
    row's stored K/V and attention output against the eager drive and a per-row reference. On CPU: eager only."""
    from eval.perf.vllm_graph_check import GraphCheckSettings, run_graph_check

    if dry_run or device.type != "cuda":
        return run_graph_check(GraphCheckSettings(rows=4, shape="tiny", dtype="float32", device="cpu", cycles=2,
                                                  plain_steps=3))
    return run_graph_check(GraphCheckSettings(rows=16, shape="small", dtype="bfloat16", device=str(device), cycles=2,
                                              plain_steps=4))


def vllm_check(device: torch.device, dry_run: bool) -> dict:
    """The plugin's worker side without vLLM's engine: (a) the slot move of one eviction round (``requests``
    evicting from ``B`` to ``n_keep``; :class:`dynts.kernels.PagedKV`, one Triton launch for every layer on CUDA)
    on the KV cache as vLLM allocates it (one allocation, FLASH_ATTN's logical ``[blocks, kv_heads, block_size,
    2 * head]`` views in its default physical layout ``LBNHC``), exact against a reference gather, warmed median of
    ``repeats``, its GB/s against the H200's 4.3 TB/s (``copy_of_bound``), and the same on the contiguous ``LBHNC``
    views for comparison; (b) the worker hooks per plain decode step and per eviction round on the
    stand-in V1 and V2 runners (:func:`hooks_check`), with their host syncs, each after a small run that checks
    every row's stored K/V against the evictor's decisions; (c) the V2 hooks between CUDA graph replays
    (:func:`graph_replay_check`)."""
    import importlib.util

    from dynts.core import copy_plan
    from dynts.kernels import compiled_variants
    from dynts.kernels.paged import PagedKV
    from dynts.vllm.layouts import geometry_for
    from eval.perf.vllm_hooks_bench import vllm_kv_caches

    layers, heads, head, block = (2, 2, 16, 16) if dry_run else (28, 4, 128, 16)
    requests, budget, n_keep = (4, 64, 40) if dry_run else (32, 4096, 2662)
    dtype = torch.float32 if dry_run else torch.bfloat16
    repeats = 3 if dry_run else 10
    per_request = budget // block
    num_blocks = requests * per_request + 1
    g = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(requests * per_request, generator=g) + 1  # scattered blocks, block 0 unused
    blocks = order.view(requests, per_request).to(device)
    slot = torch.arange(budget)
    physical = torch.stack([order[r * per_request:(r + 1) * per_request][slot // block] * block + slot % block
                            for r in range(requests)]).to(device)
    q = min(200, n_keep // 2)  # the question: kept where it is
    kept = torch.stack([torch.cat([torch.arange(q), torch.sort(torch.randperm(budget - q, generator=g)[: n_keep - q] + q).values])
                        for _ in range(requests)]).to(device)
    src, dst = copy_plan(kept, physical)  # the reference plan (host reads are fine here: not timed)
    moved = int(src.numel())
    bytes_moved = 2 * moved * layers * 2 * heads * head * torch.finfo(dtype).bits // 8  # read + write, K and V
    out: dict = {"layout": "LBNHC", "layers": layers, "requests": requests, "budget": budget, "n_keep": n_keep,
                 "moved_slots": moved, "bytes_moved": bytes_moved, "repeats": repeats, "copy_ms_by_layout": {},
                 "bound_tb_per_s": 4.3}
    ok = True
    for layout in ("LBNHC", "LBHNC"):  # vLLM's default for FLASH_ATTN first; LBHNC: the contiguous logical view
        caches = vllm_kv_caches(layers, num_blocks, heads, block, 2 * head, dtype, device, layout)
        for kv in caches:
            kv.normal_()
        flat = caches[0].transpose(1, 2).reshape(-1, heads, 2 * head).clone()
        flat[dst] = flat[src].clone()
        expected = flat.reshape(num_blocks, block, heads, 2 * head).transpose(1, 2)
        paged = PagedKV(caches, block, geometry_for("FLASH_ATTN", None, caches[0]))
        t0 = time.perf_counter()
        warmed = paged.warm_up()  # the start-up compile (vLLM's worker runs it at initialize_kv_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        warm_up_s = time.perf_counter() - t0
        variants = compiled_variants() if paged.triton else None

        def round_copy() -> None:  # the whole round: every request, every layer, K and V (one launch with Triton)
            paged.move_(kept, blocks)

        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        round_copy()  # the checked round (a move is not idempotent: check before the timed repeats)
        exact = torch.equal(caches[0], expected)
        times = _timed_ms(round_copy, repeats, device)
        ok = ok and exact
        median = sorted(times)[len(times) // 2]
        recompiled = paged.triton and compiled_variants() != variants  # the round after the warm-up compiled
        ok = ok and not recompiled
        out["copy_ms_by_layout"][layout] = {"median_ms": median, "ms": times, "exact": exact,
                                            "gb_per_s": bytes_moved / median / 1e6, "strides": list(caches[0].stride()),
                                            "backend": "triton" if paged.triton else "torch", "aligned": paged.aligned,
                                            "warm_up_s": warm_up_s if warmed else None, "recompiled": recompiled}
        if layout == "LBNHC":
            out["peak_scratch_bytes"] = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
            out["kv_cache_bytes"] = sum(c.numel() * c.element_size() for c in caches)
        del caches, flat, expected, paged
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["copy_ms"] = out["copy_ms_by_layout"]["LBNHC"]["median_ms"]
    out["copy_of_bound"] = out["copy_ms_by_layout"]["LBNHC"]["gb_per_s"] / (1000 * out["bound_tb_per_s"])
    # the hooks, V1 and V2 runners: a small checked run each (every row's stored K/V against the evictor's
    # decisions), the timing at the R1-7B shape, then the V2 hooks between CUDA graph replays
    out["hooks_by_runner"] = {}
    for runner in ("v1", "v2"):
        record = hooks_check(device, dry_run, runner)
        ok = ok and record["verified"]["event_rounds"] >= 2
        out["hooks_by_runner"][runner] = record
    v1 = out["hooks_by_runner"]["v1"]  # the flat fields of earlier runs: V1
    out["hooks"], out["hooks_verified"] = v1["bench"], v1["verified"]
    for field in ("us_per_plain_step", "us_per_event_round", "syncs_per_plain_step", "syncs_per_event_round"):
        out[f"hooks_{field}"] = v1[field]
    out["graph_replay"] = graph_replay_check(device, dry_run)
    ok = ok and out["graph_replay"]["ok"]
    out["ok"] = ok
    out["engine"] = importlib.util.find_spec("vllm") is not None
    return out


def run_section(result: dict, name: str, fn, seconds: float, save) -> dict | None:
    """Run one section inside a time box; record its output, or its error, under ``result[name]``."""
    t0 = time.perf_counter()
    try:
        with time_box(seconds):
            out = fn()
    except Exception as err:  # noqa: BLE001 - one section's failure must not lose the others' numbers
        out = dict(ok=False, error=f"{type(err).__name__}: {str(err)[:500]}", traceback=traceback.format_exc()[-2000:])
    out["seconds"] = time.perf_counter() - t0
    result[name] = out
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'traceback'}, default=str)[:1500]}", flush=True)
    save()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: list both commands' time plans, then run every section at tiny shapes (no time boxes)")
    parser.add_argument("--plan", action="store_true", help="with --dry-run: list the time plans only")
    parser.add_argument("--budget-s", "--budget-seconds", dest="budget_s", type=float, default=None,
                        help=f"the running deadline of this command (default {DEFAULT_BUDGET_S:.0f}; one call may run "
                             "600; a dry run has none unless given)")
    parser.add_argument("--methods", nargs="+", default=["window", "dynts"])
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    timed = args.budget_s is not None or not args.dry_run  # a dry run checks code paths, not time
    args.budget_s = args.budget_s or DEFAULT_BUDGET_S
    if not 0 < args.budget_s <= 600:
        parser.error(f"--budget-s {args.budget_s:g} must be in (0, 600]: one device call runs at most 600 s")
    plans = lending_plans(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "gpu_check.json"
    steps = {step.name: step for step in gpu_steps()}
    deadline = Deadline(args.budget_s if timed else math.inf)
    result = dict(dry_run=args.dry_run, budget_s=args.budget_s if timed else None,
                  plan=plans["alone"]["gpu_check"], versions=None, kernels=None, vllm=None, logits=None, tests=None,
                  serve_graphs=None, model=None, serve=None, attention_stats=None, bench=[], skipped=deadline.skipped)
    if args.dry_run:
        result["plans"] = plans
        print_plans(plans)

    def save() -> None:
        result["seconds"] = time.perf_counter() - deadline.started
        out_file.write_text(json.dumps(result, indent=1, default=str))

    if args.dry_run and args.plan:
        save()
        return 0 if all(p["planned_s"] <= DEFAULT_BUDGET_S for p in plans["alone"].values()) else 1
    result["versions"] = check_versions()
    save()
    if result["versions"]["refused"]:
        print("refusing to run:\n  " + "\n  ".join(result["versions"]["refused"]), file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    from eval.perf.random_models import R1_DISTILL_7B  # (after the version check, like every dynts import)

    dtype, shape = (torch.float32, TINY) if args.dry_run else (torch.bfloat16, R1_DISTILL_7B)
    if args.dry_run:
        torch.set_num_threads(1)
    result.update(gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], shape=shape,
                  dtype=str(dtype), methods=args.methods)
    combos = {combo_name(c): c for c in plan(args.dry_run)}
    held = {"model": None}
    serving_refused = result["versions"]["serving_refused"]

    def build() -> dict:
        held["model"] = build_model(shape, str(device), dtype)
        return {"shape": shape, "dtype": str(dtype)}

    def tests() -> dict:
        return run_tests(args.dry_run, deadline.box(steps["tests"]))

    sections = {"kernels": lambda: kernel_check(device, args.dry_run), "vllm": lambda: vllm_check(device, args.dry_run),
                "logits": lambda: logits_check(device, args.dry_run), "tests": tests,
                "serve_graphs": lambda: serve_graphs_check(device, args.dry_run), "model": build,
                "serve": lambda: serve_check(held["model"], args.dry_run, deadline.box(steps["serve"])),
                "attention_stats": lambda: attention_stats_check(device, args.dry_run)}
    order = [step.name for step in gpu_steps()[1:]]  # setup has run
    if args.dry_run:  # the tiny decode combinations, after the model
        order = [n for n in order if n not in combos and not n.startswith("decode ")]
        order[order.index("model") + 1:order.index("model") + 1] = list(combos)
    for name in order:
        step = steps.get(name)
        if name in ("serve", "serve_graphs") and serving_refused:
            result[name] = dict(skipped=serving_refused)
            print(f"{name} skipped:\n  " + "\n  ".join(serving_refused), flush=True)
            continue
        if name in combos or name == "serve":
            if held["model"] is None:
                deadline.skipped.append({"section": name, "reason": "no model: its section was skipped or failed"})
                continue
        if step is not None and not deadline.admits(step):
            print(f"{name}: skipped ({deadline.skipped[-1]['reason']})", flush=True)
            continue
        if name in combos:
            decode_combo(held["model"], combos[name], args, shape, dtype, result,
                         deadline.box(step) if step else math.inf)
            save()
        elif name == "tests":
            if not args.skip_tests:
                result["tests"] = tests()
                print(f"tests: rc={result['tests']['returncode']} ({result['tests']['seconds']:.0f} s)\n"
                      f"{result['tests']['output_tail'][-1500:]}", flush=True)
                save()
        else:
            run_section(result, name, sections[name], deadline.box(step) if step else math.inf, save)
    save()
    budget = f"of a {args.budget_s:.0f} s budget" if timed else "(no deadline: a dry run)"
    print(f"\nwrote {out_file} ({result['seconds']:.0f} s {budget}; {len(result['bench'])} decode "
          f"combinations run; skipped: {', '.join(s['section'] for s in result['skipped']) or 'nothing'})")
    checks = [result[k] and result[k].get("ok", "error" not in result[k])
              for k in ("kernels", "logits", "serve", "serve_graphs", "vllm") if result[k] is not None]
    tests_ok = result["tests"] is None or result["tests"]["returncode"] in (0, 5)
    return 0 if all(checks) and tests_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
