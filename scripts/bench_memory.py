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

    .venv/bin/python scripts/bench_memory.py --lock /tmp/dynts-cpu.lock --threads 2   # CPU: ~25 min on 2 cores
    .venv/bin/python scripts/bench_memory.py --quick      # tiny shapes, seconds (CI smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


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


def _job_in_subprocess(args, method: str, budget: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    cmd = [sys.executable, __file__, "--job", method, str(budget), *args.forward]
    if args.lock:  # one job at a time on a shared machine: hold the lock per job, not for the whole grid
        cmd = ["flock", args.lock, *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"job {method} B={budget} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    parser.add_argument("--job", nargs=2, metavar=("METHOD", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    raw = list(sys.argv[1:] if argv is None else argv)
    if "--job" in raw:
        i = raw.index("--job")
        raw = raw[:i] + raw[i + 3 :]
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
    rows = []
    for budget in args.budgets:
        for method in args.methods:
            row = run_job(args, method, budget) if args.device.startswith("cuda") else _job_in_subprocess(args, method, budget)
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
