"""One prepared check for the GPU machine (one H200, ~8 minutes): CUDA tests, decode speed of a 7B shape, one JSON.

(a) ``pytest -m cuda`` (tests/test_cuda.py: Triton kernels vs torch on the hardware, bf16 sdpa
    exactness, compiled decode with CUDA graphs vs eager, a two-GPU split when there are two);
(b) ``scripts/bench_decode.py``'s measurement (:func:`bench_positions`: every lane advanced to each
    position, then top / event / bottom decode phases timed side by side) on a RANDOM-INIT model of
    DeepSeek-R1-Distill-Qwen-7B's shape in bf16 (28 layers, hidden 3584, 28 query / 4 KV heads, head
    dim 128, MLP 18944, vocab 152064; speed does not depend on the weights) at L = 8k / 16k / 32k,
    B = 2k / 4k, batch 1 and 16, eager and compiled (``torch.compile`` mode ``reduce-overhead``):
    speedup vs the full cache, t / t_full(B), peak KV and peak GPU memory per combination;
(c) ``gpu_check.json`` under ``--out``.

Every combination is time-boxed (SIGALRM) inside ``--budget-seconds`` (default 450 s); what did not
run (time, or memory: a combination whose full cache would not fit is skipped up front) is listed
under ``skipped`` with the reason. Combinations run in :func:`plan`'s order (most informative per second first).

The GPU image has transformers 5.17, on which 47 core tests fail; the project needs 5.24. Carry the
wheel (the image's huggingface-hub 1.33, tokenizers 0.23.2 and safetensors 0.8 satisfy 5.24's pins;
huggingface-hub 2.x would need httpx2, which the image lacks, so pin the hub to the image's 1.33).
Here, in the repo root, once::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl transformers==5.24.0 huggingface-hub==1.33.0

There (the device tool's ``run`` with ``carry=[".whl"]``, ``timeout_s=540``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \\
    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out $OUT

On CPU, tiny shapes, the same code paths (run by tests/test_gpu_check.py so it cannot rot)::

    python scripts/gpu_check.py --dry-run --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode  # noqa: E402

R1_DISTILL_7B = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=131072, rope_theta=10000.0, tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)


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
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (whole seconds, at least 1)."""

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
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        tail, rc = (done.stdout + done.stderr)[-4000:], done.returncode
    except subprocess.TimeoutExpired as err:
        tail, rc = f"timed out after {seconds:.0f} s\n{(err.stdout or b'')[-3000:]!r}", 124
    return dict(command=" ".join(command[1:]), returncode=rc, seconds=time.perf_counter() - started, output_tail=tail)


def plan(dry_run: bool) -> list[dict]:
    """The combinations in run order: the most informative per second first (batch 1 is cheap; a
    compiled combination pays ~1 min of compilation per lane for 28 layers; batch 16 at 32k pays
    ~1 min of prefill for the full cache)."""
    if dry_run:  # every code path once: eager at two batch sizes, compiled once
        positions = [256, 512]
        order = [(False, 1, 64), (False, 2, 64), (True, 1, 64)]
    else:
        positions = [8192, 16384, 32768]
        order = [(False, 1, 2048), (False, 1, 4096), (True, 1, 4096), (False, 16, 4096), (False, 16, 2048),
                 (True, 16, 4096), (True, 1, 2048), (True, 16, 2048)]
    return [dict(compile=c, batch=b, budget=budget, positions=positions) for c, b, budget in order]


def kv_bytes_per_token(shape: dict, dtype: torch.dtype) -> int:
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * torch.finfo(dtype).bits // 8


def run_combo(model, combo: dict, args, shape: dict, dtype) -> dict:
    steps = 4 if args.dry_run else 8
    argv = ["--models", "x", "--budget", str(combo["budget"]), "--local-window", str(combo["budget"] // 16),
            "--steps", str(steps), "--prompt-tokens", "32", "--full-chunk", str(256 if args.dry_run else 4096)]
    bench_args = bench_decode.parse_args(argv + (["--compile"] if combo["compile"] else []))
    label = "tiny-random" if args.dry_run else "random-R1-Distill-Qwen-7B-bf16"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = bench_decode.bench_positions(model, label, combo["batch"], args.methods, combo["positions"], bench_args)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    rows = []
    for row in run["rows"]:
        rows.append(dict(
            position=row["position"], t_full_L_ms=1e3 * row["t_full_L"], t_full_B_ms=1e3 * row["t_full_B"],
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
    print(f"\n== {tag} batch {record['batch']} B={record['budget']} ({record['seconds']:.0f} s, peak GPU "
          f"{(record['peak_gpu_bytes'] or 0) / 2**30:.1f} GiB)")
    for row in record["rows"]:
        cells = "  ".join(f"{m}: {r['t_ms']:.2f} ms x{r['speedup']:.2f} t/tB {r['t_over_t_full_B']:.3f}"
                          for m, r in row["methods"].items())
        print(f"  L={row['position']:>6} full {row['t_full_L_ms']:.2f} ms, full@B {row['t_full_B_ms']:.2f} ms | {cells}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, tests collected only")
    parser.add_argument("--budget-seconds", type=float, default=None, help="whole run (default 450; dry run 240)")
    parser.add_argument("--methods", nargs="+", default=["window", "dynts"])
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args(argv)
    budget = args.budget_seconds or (240.0 if args.dry_run else 450.0)
    started = time.perf_counter()
    left = lambda: budget - (time.perf_counter() - started)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on CPU")
    device, dtype, shape = ("cpu", torch.float32, TINY) if args.dry_run else ("cuda", torch.bfloat16, R1_DISTILL_7B)
    if args.dry_run:
        torch.set_num_threads(1)
    import transformers

    result = dict(
        machine=dict(platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
                     transformers=transformers.__version__, cuda=torch.version.cuda,
                     gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]),
        dry_run=args.dry_run, shape=shape, dtype=str(dtype), methods=args.methods, budget_seconds=budget,
        tests=None, bench=[], skipped=[],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "gpu_check.json"

    def save() -> None:
        result["seconds"] = time.perf_counter() - started
        out_file.write_text(json.dumps(result, indent=1))

    if not args.skip_tests:
        result["tests"] = run_tests(args.dry_run, min(150.0, 0.3 * budget))
        print(f"tests: rc={result['tests']['returncode']} ({result['tests']['seconds']:.0f} s)\n"
              f"{result['tests']['output_tail'][-1500:]}", flush=True)
        save()
    model = build_model(shape, device, dtype)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    per_token = kv_bytes_per_token(shape, dtype)
    for combo in plan(args.dry_run):
        name = f"{'compiled' if combo['compile'] else 'eager'} batch {combo['batch']} B={combo['budget']}"
        full_kv = combo["batch"] * (max(combo["positions"]) + 64) * per_token
        if free is not None and full_kv > 0.8 * free:
            result["skipped"].append(dict(**combo, reason=f"full cache {full_kv / 2**30:.1f} GiB > 80% of free memory"))
            continue
        if left() < 20:
            result["skipped"].append(dict(**combo, reason="out of time"))
            continue
        box = left() - 10
        print(f"{name}: up to {box:.0f} s", flush=True)
        t0 = time.perf_counter()
        try:
            with time_box(box):
                record = run_combo(model, combo, args, shape, dtype)
        except TimeoutError as err:
            result["skipped"].append(dict(**combo, reason=str(err)))
            print(f"  {err}", flush=True)
        except torch.cuda.OutOfMemoryError as err:
            result["skipped"].append(dict(**combo, reason=f"out of memory: {str(err)[:200]}"))
        else:
            record["seconds"] = time.perf_counter() - t0
            result["bench"].append(record)
            print_combo(record)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()
    save()
    print(f"\nwrote {out_file} ({result['seconds']:.0f} s; {len(result['bench'])} combinations run, "
          f"{len(result['skipped'])} skipped)")
    return 0 if result["tests"] is None or result["tests"]["returncode"] in (0, 5) else 1


if __name__ == "__main__":
    raise SystemExit(main())
