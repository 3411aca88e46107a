"""dynts vs kvpress's DecodingPress: tokens/s and peak KV on the same model, prompt and budget.

kvpress 0.5.5 pins ``transformers<5.3`` (its hooks read ``cache_position``), so it runs in its own
venv (``~/.cache/dynts/kvpress-venv``: ``torch==2.13.0`` first, so pip takes the CPU build on disk,
then ``kvpress==0.5.5 transformers==5.2.0``), built on the first run. This script then runs itself
inside that venv as a worker (``--worker``: no ``dynts`` import there) and the dynts side here, and
prints both side by side.

Matched settings: kvpress ``DecodingPress(StreamingLLMPress(n_sink=4), compression_interval=K,
target_size=n_keep)`` compresses every ``K`` decode steps down to ``n_keep`` entries, the same
sawtooth between ``n_keep`` and ``B`` as dynts' ``streamingllm`` (4 sinks + most recent) with budget
``B`` (``K = B - n_keep``). Also timed: plain ``transformers`` full cache in both venvs, dynts ``full``
and dynts ``dynts`` (an untrained predictor: speed does not depend on its weights). Greedy decoding,
EOS suppressed (``min_new_tokens``) so every run decodes the same number of tokens.

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_kvpress.py     # ~5 min + venv build (~2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("DYNTS_KVPRESS_VENV", Path.home() / ".cache" / "dynts" / "kvpress-venv"))
PINS = (["torch==2.13.0"], ["kvpress==0.5.5", "transformers==5.2.0"])
PROMPT = (
    "Solve step by step and think carefully before answering. A train leaves the station at 9:00 and travels at "
    "60 km/h; a second train leaves the same station at 10:00 at 90 km/h on the same track. When and where does "
    "the second train catch up with the first one?"
)


# ------------------------------------------------------------------------------------------ shared
def timed_generate(model, ids, new_tokens: int, cache=None, cache_kw: str = "past_key_values",
                   **kwargs) -> tuple[float, object]:
    """``model.generate`` timed; ``cache`` goes under ``cache_kw`` (dynts side: ``dynts.hf_compat.cache_keyword``;
    the kvpress worker's transformers 5.2 takes ``past_key_values``, and dynts is not importable there)."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0, **({cache_kw: cache} if cache is not None else {}), **kwargs,
        )
        return time.perf_counter() - start, out


def track_steps(model, cache) -> tuple[list[int], list[float], object]:
    """A forward hook recording the physical KV length of layer 0 and the time after every forward."""
    lengths: list[int] = []
    stamps: list[float] = []

    def hook(module, args, output):
        stamps.append(time.perf_counter())
        layer = cache.layers[0]
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            lengths.append(int(layer.keys.shape[-2]))

    return lengths, stamps, model.register_forward_hook(hook)


def run_record(seconds: float, new: int, batch: int, lengths: list[int], stamps: list[float], per_token: int) -> dict:
    """tokens/s over the whole generate call, and from the median decode step (robust to a busy machine)."""
    steps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))  # skip the prefill forward
    median = steps[len(steps) // 2]
    return dict(seconds=seconds, new_tokens=new, tokens_per_second=new * batch / seconds,
                median_step_ms=1e3 * median, median_tokens_per_second=batch / median,
                peak_cache_tokens=max(lengths), peak_kv_bytes=max(lengths) * per_token)


def kv_bytes_per_token(model, batch: int) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element * batch


# ------------------------------------------------------------------------------------------ worker (kvpress venv)
def worker(args) -> dict:
    import torch
    import transformers
    from kvpress import DecodingPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpress

    torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    ids = torch.tensor(spec["ids"])
    per_token = kv_bytes_per_token(model, ids.shape[0])
    results = {"versions": {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
                            "transformers": transformers.__version__, "torch": torch.__version__}}
    runs = [("hf-full (transformers %s)" % transformers.__version__, None)]
    press = DecodingPress(base_press=StreamingLLMPress(n_sink=4), compression_interval=spec["volume"],
                          target_size=spec["n_keep"], hidden_states_buffer_size=0)
    runs.append(("kvpress DecodingPress(StreamingLLM)", press))
    timed_generate(model, ids, 4)  # warm-up
    for name, p in runs:
        cache = DynamicCache(config=model.config)
        lengths, stamps, handle = track_steps(model, cache)
        try:
            if p is None:
                seconds, out = timed_generate(model, ids, spec["new_tokens"], cache, cache_keyword(model))
            else:
                with p(model):
                    seconds, out = timed_generate(model, ids, spec["new_tokens"], cache, cache_keyword(model))
        finally:
            handle.remove()
        new = out.shape[1] - ids.shape[1]
        results[name] = run_record(seconds, new, ids.shape[0], lengths, stamps, per_token)
    return results


# ------------------------------------------------------------------------------------------ driver (dynts venv)
def ensure_venv(path: Path) -> Path:
    """Build the kvpress venv once (atomically: built aside, then renamed); returns its python."""
    python = path / "bin" / "python"
    if (path / ".dynts-ready").is_file():
        return python
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
    commands = [[sys.executable, "-m", "venv", str(tmp)]]
    commands += [[str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *pins] for pins in PINS]
    for command in commands:
        print("$", " ".join(command), flush=True)
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(
                f"building the kvpress venv failed at `{' '.join(command)}` (exit {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            )
    freeze = subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    (tmp / ".dynts-ready").write_text(freeze.stdout)
    tmp.rename(path)
    return python


def dynts_side(model, ids, spec: dict, args) -> dict:
    import torch
    import transformers
    from transformers import DynamicCache

    import dynts
    from dynts.hf_compat import cache_keyword

    per_token = kv_bytes_per_token(model, ids.shape[0])
    results = {}
    cache = DynamicCache(config=model.config)
    lengths, stamps, handle = track_steps(model, cache)
    try:
        seconds, out = timed_generate(model, ids, spec["new_tokens"], cache, cache_keyword(model))
    finally:
        handle.remove()
    new = out.shape[1] - ids.shape[1]
    results[f"hf-full (transformers {transformers.__version__})"] = run_record(
        seconds, new, ids.shape[0], lengths, stamps, per_token)
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    for method in ("full", "streamingllm", "dynts"):
        stamps: list[float] = []
        handle = model.register_forward_hook(lambda module, a, o: stamps.append(time.perf_counter()))
        try:
            result = dynts.generate(
                model, input_ids=ids, method=method, budget=args.budget, local_window=args.local_window,
                retention=args.retention, predictor=predictor, max_new_tokens=spec["new_tokens"],
                min_new_tokens=spec["new_tokens"], pad_token_id=0, think_end=None, do_sample=False,
            )
        finally:
            handle.remove()
        s = result.stats
        record = run_record(s["seconds"], s["new_tokens"] // ids.shape[0], ids.shape[0], [s["peak_cache_tokens"]],
                            stamps, per_token)
        record.update(peak_kv_bytes=s["peak_kv_bytes"], evictions=s["evictions"])
        results[f"dynts {method}"] = record
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2-135m", help="a dynts model name or HF directory")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--local-window", type=int, default=32)
    parser.add_argument("--retention", type=float, default=0.4)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_kvpress.json")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    import torch

    import dynts
    from dynts.models import resolve_path

    torch.set_num_threads(args.threads)
    python = ensure_venv(VENV)
    model, tokenizer = dynts.load(args.model)
    model_dir = str(resolve_path(args.model))
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"].repeat(args.batch, 1)
    bounds = dynts.Budget(args.budget, args.local_window, args.retention)
    spec = dict(model=model_dir, ids=ids.tolist(), new_tokens=args.new_tokens,
                n_keep=bounds.n_keep(ids.shape[1]), volume=bounds.eviction_volume(ids.shape[1]))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    print(f"prompt {ids.shape[1]} tokens x batch {args.batch}, {args.new_tokens} new tokens, B={args.budget} "
          f"(n_keep={spec['n_keep']}, K={spec['volume']}); kvpress worker in {VENV}", flush=True)
    proc = subprocess.run([str(python), __file__, "--worker", "--spec", f.name, "--threads", str(args.threads)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    os.unlink(f.name)
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"the kvpress worker failed (exit {proc.returncode})")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = dynts_side(model, ids, spec, args)
    versions = theirs.pop("versions")
    rows = {**theirs, **ours}
    full = ours["dynts full"]
    print(f"\nkvpress venv: {versions}; dynts venv: torch {torch.__version__}")
    print(f"{'run':<40} {'tokens/s':>8} {'vs full':>7} {'median step ms':>14} {'tok/s@median':>12} {'vs full':>7} "
          f"{'peak KV tok':>11} {'peak KV MiB':>11} {'KV ratio':>8}")
    for name, r in rows.items():
        print(f"{name:<40} {r['tokens_per_second']:>8.2f} {r['tokens_per_second'] / full['tokens_per_second']:>7.3f} "
              f"{r['median_step_ms']:>14.1f} {r['median_tokens_per_second']:>12.2f} "
              f"{r['median_tokens_per_second'] / full['median_tokens_per_second']:>7.3f} "
              f"{r['peak_cache_tokens']:>11} {r['peak_kv_bytes'] / 2**20:>11.2f} {r['peak_kv_bytes'] / full['peak_kv_bytes']:>8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(spec={k: v for k, v in spec.items() if k != "ids"}, prompt_tokens=ids.shape[1],
                                        batch=args.batch, versions=versions, runs=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
