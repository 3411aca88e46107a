"""Peak memory of every eviction method against a plain forward and the window method.

Model: a random-init Qwen2 with R1-Distill-Qwen-7B's attention shape (hidden 3584, 28 query heads,
4 KV heads, head dim 128) but ``--layers`` layers, a small MLP and vocabulary (the statistics cost
per layer is what is measured; weights are a constant). For every budget ``B`` each method runs one
job through :func:`dynts.attach`: a prefill of ``M = min(--prompt, B // 2)`` tokens, one multi-token
forward of ``B - M`` tokens (the cache then holds ``B``: the largest attention rows and, for R-KV,
the largest ``[B, B]`` similarity a run ever meets), then ``--steps`` decode steps, the first of
which fires an eviction event (selection over ``B`` slots + compaction). ``plain`` is the same token
sequence through the model with transformers' own ``DynamicCache`` (no dynts).

Peak = the largest memory held during the job above what was held just before it (model and inputs):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching
  allocator's own count of live tensor bytes);
* CPU: each job runs in its own subprocess with glibc's ``MALLOC_MMAP_THRESHOLD_=131072``, so every
  tensor larger than 128 KiB is its own mmap and returns to the OS when freed; the peak resident set
  (``VmHWM`` of ``/proc/self/status``) is reset by writing ``5`` to ``/proc/self/clear_refs`` just
  before the job (proc(5)), and ``VmHWM - VmRSS(before)`` is reported.

Prints a table (GiB, and the ratio to the window method's peak at the same ``B``) and writes
``bench_memory.json`` under ``--out``.

``--serving``: instead, the scratch of ONE eviction round of ``dynts.serving`` (transformers'
continuous batching) at the R1-Distill-Qwen-7B attention shape (28 layers, 4 KV heads, head dim 128,
bf16): ``--requests`` (32) requests that all reach ``B = 4096`` stored slots together (question 256,
``W_l = 512``, retention 0.4: ``n_keep = 2099``; DynTS with random scores, so kept slots are scattered;
pages of 256 allocated request by request in turn, so block tables interleave). The pool is a real
``PagedAttentionCache`` (no model) of random bf16 K/V, about 7 GiB. Two paths, each in its own process,
same seed:

* ``before``: the reference (:func:`evict_all_rows`), all rows at once: one
  ``index_select`` of every kept row of every layer, K and V, and request at once (identity moves
  included), then one ``index_copy_``;
* ``after``: the real ``EvictingBatchProcessor._evict_due`` (``SlotTracker.evict``,
  ``copy_plan``: only rows whose source differs from their destination, ``_gather_rows``: 4096 rows of
  every layer at a time, tail blocks back to the pool).

Peak = measured as above (CPU: ``VmHWM`` with every tensor over 128 KiB its own mmap; the pool pages
are resident before the round and are overwritten in place, so the rise is the round's temporaries:
gathered rows, index tensors, the evictor's inputs); ``gathered_bytes`` is the size of the largest
gathered-rows temporary alone, for comparison. A blake2b digest of every request's kept K/V after the
round must be equal for both paths. Scratch grows linearly with layers (both paths) and with requests
(``before``; ``after`` is capped by the chunk), so ``--serving-layers`` can shrink the run on a small
machine.

    .venv/bin/python scripts/bench_memory.py --lock /tmp/dynts-cpu.lock --threads 2   # CPU: ~25 min on 2 cores
    .venv/bin/python scripts/bench_memory.py --serving --threads 2   # ~11 GiB RAM at the peak
    .venv/bin/python scripts/bench_memory.py --quick [--serving]   # tiny shapes, seconds (CI smoke)
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

METHODS = ("window", "streamingllm", "sepllm", "h2o", "snapkv", "rkv", "dynts", "full")
SHAPE_7B = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, head_dim=128)
GIB = 2**30
# no tokenizer here: SepLLM's separators are a few fixed ids (~1 in 200 random tokens is one)
OPTIONS = {"sepllm": {"separator_token_ids": [3, 5, 7, 11, 13]}}


def build_model(args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(SHAPE_7B) if not args.quick else dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    config = Qwen2Config(
        **shape, num_hidden_layers=args.layers, intermediate_size=args.mlp, vocab_size=args.vocab,
        max_position_embeddings=max(args.budgets) + 64, attn_implementation="sdpa", tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).eval()


def _status(field: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in {path}")


def _meminfo(field: str) -> int:
    return _status(field, "/proc/meminfo")


class PeakMeter:
    """Peak bytes held above the level at ``start()`` (CUDA allocator or the process's resident set)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.base = _status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status("VmHWM") - self.base


def run_job(args, method: str, budget: int) -> dict:
    """One job in this process; returns its peak and what ran."""
    import dynts

    device = torch.device(args.device)
    model = build_model(args)
    prompt = min(args.prompt, budget // 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, budget + args.steps), generator=g).to(device)
    first, second = ids[:, :prompt], ids[:, prompt:budget]
    mask = torch.ones(args.batch, budget + args.steps, dtype=torch.long, device=device)
    meter = PeakMeter(device)
    cache = None
    with torch.no_grad():
        if method == "plain":
            meter.start()
            out = model(input_ids=first, attention_mask=mask[:, :prompt], use_cache=True)
            past = out.past_key_values
            out = model(input_ids=second, attention_mask=mask[:, :budget], past_key_values=past, use_cache=True)
            for step in range(args.steps):
                token = ids[:, budget + step : budget + step + 1]
                out = model(input_ids=token, attention_mask=mask[:, : budget + step + 1], past_key_values=past, use_cache=True)
        else:
            evictor = dynts.make_evictor(method, **OPTIONS.get(method, {}))
            bounds = dynts.Budget(budget, args.local_window, 0.4) if method != "full" else None
            cache = dynts.build_cache(model, evictor, bounds)
            predictor = dynts.ImportancePredictor(model.config.hidden_size).to(device) if method == "dynts" else None
            with dynts.attach(model, cache, predictor):
                meter.start()
                out = model(input_ids=first, attention_mask=mask[:, :prompt], cache=cache)
                out = model(input_ids=second, attention_mask=mask[:, :budget], cache=cache)
                for step in range(args.steps):
                    token = ids[:, budget + step : budget + step + 1]
                    out = model(input_ids=token, attention_mask=mask[:, : budget + step + 1], cache=cache)
        del out
        peak = meter.peak()
    return {
        "method": method, "budget": budget, "prompt": prompt, "batch": args.batch, "peak_bytes": peak,
        "evictions": cache.stats.evictions if cache is not None else 0,
    }


def _job_in_subprocess(args, job: list[str]) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [sys.executable, __file__, *job, *args.forward]
    if args.lock:  # one job at a time on a shared machine: hold the lock per job, not for the whole grid
        cmd = ["flock", args.lock, *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"job {' '.join(job)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- serving eviction scratch
SERVING_7B = dict(layers=28, kv_heads=4, head_dim=128)
SERVING_QUICK = dict(layers=2, kv_heads=2, head_dim=16)


def serving_sizes(args) -> dict:
    """The serving round's shape: R1-7B attention (or tiny with ``--quick``) and the request mix."""
    shape = dict(SERVING_QUICK if args.quick else SERVING_7B)
    if args.serving_layers:
        shape["layers"] = args.serving_layers
    if args.quick:
        return dict(shape, requests=4, budget=64, question=8, local_window=8, page=16)
    return dict(shape, requests=args.requests, budget=4096, question=256, local_window=512, page=256)


def serving_processor(sizes: dict, device: torch.device):
    """The real :class:`~dynts.serving.processor.EvictingBatchProcessor` eviction state on a real paged cache.

    A transformers ``PagedAttentionCache`` of the given attention shape (no model: the pool is what
    matters) filled with random bf16 K/V; ``requests`` decoding requests of ``budget`` stored slots each,
    their blocks allocated one page per request in turn (as requests that decode together grow), so block
    tables interleave; the processor's :class:`~dynts.core.SlotTracker` holds every slot's metadata and
    random DynTS scores. Only the engine's scheduler is replaced, by the requests it would hold."""
    from transformers import ContinuousBatchingConfig, Qwen2Config
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper
    from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

    import dynts
    from dynts.core import EvictionPolicy, EvictionSettings, Forward, SlotTracker
    from dynts.serving.processor import EvictingBatchProcessor

    r, budget, page = sizes["requests"], sizes["budget"], sizes["page"]
    heads = sizes["kv_heads"]
    config = Qwen2Config(hidden_size=heads * sizes["head_dim"], num_attention_heads=heads, num_key_value_heads=heads,
                         head_dim=sizes["head_dim"], num_hidden_layers=sizes["layers"], vocab_size=1024)
    cb = ContinuousBatchingConfig(num_blocks=r * budget // page, page_size=page, max_batch_tokens=page,
                                  allow_block_sharing=False, max_memory_percent=0.95)
    cache = PagedAttentionCache(config, cb, device, DistributedHelper(None, None), dtype=torch.bfloat16)
    allocator = cache.cache_allocators["full_attention"]
    torch.manual_seed(0)
    cache.cache_tensor.view(torch.bfloat16).normal_()  # every layer's K and V rows (the views overlap: fill once)
    settings = EvictionSettings("dynts", budget, sizes["local_window"], predictor=dynts.ImportancePredictor(64))
    processor = object.__new__(EvictingBatchProcessor)
    processor.settings, processor.cache, processor.allocator, processor.page = settings, cache, allocator, page
    processor.tracker = SlotTracker(settings, device, think_end=None)
    processor.policy = EvictionPolicy(page)
    processor._flat, processor._layer_offsets = processor._flat_view()
    g = torch.Generator().manual_seed(1)
    states = {}
    for i in range(r):
        prompt = torch.randint(3, 1024, (sizes["question"],), generator=g).tolist()
        states[f"r{i}"] = RequestState(request_id=f"r{i}", initial_tokens=prompt, max_new_tokens=8 * budget)
    for step in range(budget // page):
        for state in states.values():
            state.position_offset = step * page
            if not cache.can_store_request_tokens(state, page):
                raise RuntimeError("the pool is too small for the requests")
    forwards = []
    for state in states.values():
        state.status = RequestStatus.DECODING
        state.position_offset = budget
        processor.policy.open(state.request_id, processor.settings, sizes["question"], None)
        entry = processor.tracker.open(state.request_id, sizes["question"])
        tokens = state.initial_tokens + torch.randint(3, 1024, (budget - sizes["question"],), generator=g).tolist()
        forwards.append(Forward(entry, 0, 0, tokens))
    processor.tracker.record(forwards)
    rows = torch.tensor([f.entry.row for f in forwards])
    processor.tracker.table.scores[rows, :budget] = torch.randn(r, budget, generator=g).to(device)
    processor.scheduler = SimpleNamespace(active_requests=states)
    return processor


def evict_all_rows(processor) -> int:
    """The reference: the eviction round with all rows at once -- one ``index_select`` /
    ``index_copy_`` of every kept row of every layer, K and V, and every evicting request at once,
    identity moves included (the same tracker, evictor and block bookkeeping as the real round).
    Returns the rows gathered per layer."""
    due = [(s, processor.policy.get(rid)) for rid, s in processor.scheduler.active_requests.items()
           if processor.policy.get(rid).due(s.position_offset)]
    rows = {id(processor.slots[s.request_id]): (s, entry) for s, entry in due}
    src, dst = [], []
    for group in processor.tracker.evict([(processor.slots[s.request_id], s.position_offset, entry.n_keep)
                                          for s, entry in due]):
        members = [rows[id(e)][0] for e in group.entries]
        physical = torch.tensor([processor.allocator.get_read_indices(s.request_id, 0, group.stored) for s in members],
                                dtype=torch.long, device=processor._flat.device)
        src.append(physical.gather(1, group.kept.to(physical.device)).flatten())
        dst.append(physical[:, : group.n_keep].flatten())
        for state, entry in (rows[id(e)] for e in group.entries):
            entry.evicted(group.stored)
            entry.freed_blocks += processor._pop_tail_blocks(state.request_id, processor.policy.blocks(group.n_keep))
            state.position_offset = group.n_keep
    src_all, dst_all = torch.cat(src), torch.cat(dst)
    offsets = processor._layer_offsets.unsqueeze(1)
    flat = processor._flat
    gathered = flat.index_select(0, (src_all.unsqueeze(0) + offsets).flatten())
    flat.index_copy_(0, (dst_all.unsqueeze(0) + offsets).flatten(), gathered)
    return int(src_all.numel())


def kept_digest(processor) -> str:
    """blake2b of every request's kept K/V rows (slots ``0 .. n_keep - 1``) in every layer, after the round."""
    h = hashlib.blake2b(digest_size=16)
    for rid, state in sorted(processor.scheduler.active_requests.items()):
        kept = processor.allocator.get_read_indices(rid, 0, state.position_offset)
        rows = torch.tensor(kept, device=processor._flat.device)
        for offset in processor._layer_offsets.tolist():
            h.update(processor._flat.index_select(0, rows + offset).cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def run_serving_job(args, path: str) -> dict:
    """One eviction round (``before``: :func:`evict_all_rows`; ``after``: the processor's ``_evict_due``)."""
    from dynts.core import copy_plan

    device = torch.device(args.device)
    sizes = serving_sizes(args)
    processor = serving_processor(sizes, device)
    moved = []
    if path == "after":  # count the rows the real round moves (copy_plan is called inside _evict_due)
        import dynts.serving.processor as module

        def counting(kept, physical):
            out = copy_plan(kept, physical)
            moved.append(int(out[0].numel()))
            return out

        module.copy_plan = counting
    meter = PeakMeter(device)
    with torch.no_grad():
        meter.start()
        t0 = time.perf_counter()
        gathered = evict_all_rows(processor) if path == "before" else processor._evict_due()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        peak = meter.peak()
    entries = list(processor.policy.requests.values())
    n_keep = entries[0].n_keep
    rows = gathered if path == "before" else sum(moved)
    per_row = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * 2  # K and V of every layer, bf16
    real_chunk = inspect.signature(processor._gather_rows).parameters["chunk"].default
    chunk = rows if path == "before" else min(rows, real_chunk)
    return {
        "path": path, **sizes, "n_keep": n_keep, "rows": rows, "chunk_rows": chunk, "peak_bytes": peak,
        "gathered_bytes": chunk * per_row, "seconds": seconds, "pool_bytes": processor.cache.cache_tensor.numel(),
        "evictions": sum(e.evictions for e in entries), "digest": kept_digest(processor),
    }


def serving_main(args) -> int:
    """Both paths, each in its own process (CPU), side by side; JSON under ``--out``."""
    sizes = serving_sizes(args)
    if not args.device.startswith("cuda"):
        per_slot = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * 2
        need = sizes["requests"] * sizes["budget"] * per_slot * 1.6 + 2 * GIB  # pool + the reference gather (~0.5 of it)
        free = _meminfo("MemAvailable")
        if need > free:
            raise SystemExit(f"needs ~{need / GIB:.1f} GiB, {free / GIB:.1f} GiB available: lower --requests or "
                             "--serving-layers (scratch scales linearly with both)")
    rows = []
    for path in ("before", "after"):
        if args.device.startswith("cuda"):
            row = run_serving_job(args, path)
            torch.cuda.empty_cache()
        else:
            row = _job_in_subprocess(args, ["--serving-job", path])
        rows.append(row)
        print(f"{path:>6}: peak {row['peak_bytes'] / GIB:.3f} GiB above the pool ({row['pool_bytes'] / GIB:.2f} GiB); "
              f"{row['rows']} rows x {2 * row['layers']} layer K/V, {row['seconds']:.2f} s", flush=True)
    before, after = rows
    same = before["digest"] == after["digest"]
    print(f"\nOne eviction round: {sizes['requests']} requests, B = {sizes['budget']} -> n_keep = {before['n_keep']}, "
          f"{sizes['layers']} layers x {sizes['kv_heads']} KV heads x {sizes['head_dim']}, bf16 on {args.device}")
    print(f"{'path':<8}{'rows moved':>12}{'rows per copy':>15}{'gathered GiB':>14}{'peak GiB':>10}")
    for r in rows:
        print(f"{r['path']:<8}{r['rows']:>12}{r['chunk_rows']:>15}{r['gathered_bytes'] / GIB:>14.3f}"
              f"{r['peak_bytes'] / GIB:>10.3f}")
    print(f"peak before / after: {before['peak_bytes'] / max(after['peak_bytes'], 1):.1f}x; kept K/V identical: {same}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving_eviction.json").write_text(json.dumps({
        "settings": {k: v for k, v in vars(args).items() if k not in ("forward", "job", "serving_job")},
        "torch": torch.__version__, "machine": platform.machine(), "rows": rows, "identical": same,
        "ratio": before["peak_bytes"] / max(after["peak_bytes"], 1),
    }, indent=2))
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt length M (capped at B // 2)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--mlp", type=int, default=1024, help="MLP width (small: weights are not measured)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--local-window", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="decode steps after the cache is full (>= 1: one event)")
    parser.add_argument("--methods", nargs="+", default=["plain", *METHODS])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--out", default="reports/bench_memory")
    parser.add_argument("--lock", default=None, help="CPU: run each job under `flock LOCK` (shared machines)")
    parser.add_argument("--serving", action="store_true",
                        help="instead: peak scratch of one serving eviction round, all-rows gather vs dynts.serving")
    parser.add_argument("--requests", type=int, default=32, help="--serving: requests evicting together")
    parser.add_argument("--serving-layers", type=int, default=None, help="--serving: layers (default 28, R1-7B)")
    parser.add_argument("--job", nargs=2, metavar=("METHOD", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--serving-job", choices=("before", "after"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    for flag, values in (("--job", 2), ("--serving-job", 1)):
        if flag in raw:
            i = raw.index(flag)
            raw = raw[:i] + raw[i + 1 + values :]
    args.forward = raw
    if args.quick:  # tiny defaults for every size not given on the command line
        for name, value in (("budgets", [64, 128]), ("prompt", 64), ("batch", 2), ("local_window", 8)):
            if f"--{name.replace('_', '-')}" not in raw:
                setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.job:
        print(json.dumps(run_job(args, args.job[0], int(args.job[1]))))
        return 0
    if args.serving_job:
        print(json.dumps(run_serving_job(args, args.serving_job)))
        return 0
    if args.serving:
        return serving_main(args)
    rows = []
    for budget in args.budgets:
        for method in args.methods:
            if args.device.startswith("cuda"):
                row = run_job(args, method, budget)
            else:
                row = _job_in_subprocess(args, ["--job", method, str(budget)])
            rows.append(row)
            print(f"B={budget:>6} {method:>13}: {row['peak_bytes'] / GIB:7.3f} GiB  (events {row['evictions']})", flush=True)
    print(f"\nPeak memory above model + inputs, GiB (ratio to window). batch {args.batch}, prompt min({args.prompt}, B/2), "
          f"{args.layers} layer(s) of 28/4 heads x 128, {args.dtype} on {args.device}")
    header = "method".ljust(14) + "".join(f"B={b}".rjust(20) for b in args.budgets)
    print(header)
    peak = {(r["method"], r["budget"]): r["peak_bytes"] for r in rows}
    for method in args.methods:
        cells = []
        for b in args.budgets:
            window = peak.get(("window", b))
            ratio = f" ({peak[(method, b)] / window:.2f}x)" if window else ""
            cells.append(f"{peak[(method, b)] / GIB:.3f}{ratio}".rjust(20))
        print(method.ljust(14) + "".join(cells))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("forward", "job")}
    (out / "bench_memory.json").write_text(json.dumps({
        "settings": settings, "torch": torch.__version__, "machine": platform.machine(), "rows": rows,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
