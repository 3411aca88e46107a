"""KV-Rescue engine cost, before vs after: decode steps/s, fork memory and host reads per decode step.

Runs the engine itself (``dynts.rescue.engine.StepDecoder``: fork, decode, append; no PRM) for the code in
two source trees -- ``--before`` (another source tree, e.g. an export of an older commit) and this
checkout -- each in its own subprocess (``PYTHONPATH`` = that tree, this script's worker mode), on two
model pairs:

* ``testbed``: the shipped testbed LRM (DynTS base, ``checkpoints/testbed-predictor``) and helper;
* ``real``: random-init Qwen2 models of real shape -- base 7B-shaped (hidden 3584, 28/4 heads, MLP
  18944), helper 1.5B-shaped (hidden 1536, 12/2 heads, MLP 8960, tied), vocabulary 152064 -- with
  ``--layers`` decoder layers each (2 by default: CPU), a random-init importance predictor (DynTS
  base), helper context ``--context`` (4096), base budget ``--budget`` (1024: the base holds B
  entries), ``--n`` candidates per model (8) for ``--problems`` problems (8).

Each round forks ``n`` candidates per problem from both models, decodes ``--step-tokens`` tokens
each (the base candidates screened by an entropy + gzip detector that never fires, so its text path
runs), commits base candidate 0 and lets the helper absorb it (one forward). Host reads are counted
with each tree's :mod:`dynts.rescue.hostsync` inside ``decode`` only. The counter wraps torch's
tensor-to-Python entry points and touches no engine code: copy this checkout's into a tree that lacks
it (the worker refuses a tree without one)::

    git archive OLD | tar -x -C /tmp/dynts-old
    cp dynts/rescue/hostsync.py /tmp/dynts-old/dynts/rescue/   # if OLD has no counter
    python scripts/bench_rescue.py --before /tmp/dynts-old --out reports/rescue/bench-engine.json
    python scripts/bench_rescue.py --before /tmp/dynts-old --shapes testbed --repeats 3 --threads 1 \
        --out reports/rescue/bench-engine-testbed.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "base": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
    "helper": dict(hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, tie_word_embeddings=True),
}
SETUPS = {  # shape -> context, budget, local window, n, problems, prompt tokens
    "testbed": dict(context=384, budget=64, local_window=16, n=4, problems=16, prompt=24),
    "real": dict(context=4096, budget=1024, local_window=128, n=8, problems=8, prompt=64),
}


def _models(shape: str, layers: int, dtype, device):
    import torch
    import dynts

    if shape == "testbed":
        base, tok = dynts.load("testbed", device=device)
        helper, _ = dynts.load("testbed-helper", device=device)
        from dynts.predictor import load_predictor

        predictor = load_predictor("checkpoints/testbed-predictor", base)
        return base, helper, predictor, len(tok), lambda ids: tok.decode(ids, skip_special_tokens=False)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    made = []
    for i, role in enumerate(("base", "helper")):
        torch.manual_seed(i)
        config = Qwen2Config(vocab_size=152064, num_hidden_layers=layers, max_position_embeddings=32768, rope_theta=1e6,
                             attn_implementation="sdpa", **SHAPES[role])
        made.append(Qwen2ForCausalLM(config).to(dtype=dtype, device=device).eval())
    torch.manual_seed(2)
    predictor = dynts.ImportancePredictor(SHAPES["base"]["hidden_size"]).to(device=device, dtype=torch.float32).eval()
    return made[0], made[1], predictor, 152064, lambda ids: " ".join(map(str, ids))  # a decode that costs O(len)


def _kv_bytes(cache) -> int:
    """K/V bytes a fork batch holds: its own buffers, plus (shared forks) the distinct prefixes once."""
    if hasattr(cache, "shared_bytes"):
        return cache.shared_bytes() + cache.tail_bytes()
    return cache.allocated_kv_bytes


def _replica(state):
    """An independent copy of a committed state (a second problem with the same content)."""
    from dynts.rescue.engine import State
    from dynts.rescue.rows import RaggedCache

    cache = state.cache
    if hasattr(cache, "commit"):  # a shared-prefix fork: copy the prefix
        from dynts.rescue.shared import ForkCache

        prefix, length = cache.commit(state.row)
        return State(ForkCache(len(prefix.keys), [(prefix.truncated(length), length)]), 0, state.logits.clone())
    return State(RaggedCache.stack([(cache, [state.row])]), 0, state.logits.clone())


def worker(args) -> dict:
    import torch

    import dynts
    from dynts.rescue import DegenerationDetector, Sampler
    from dynts.core import EvictionSettings
    from dynts.rescue.engine import Candidate, StepDecoder
    from dynts.rescue.sampling import candidate_generator

    try:
        from dynts.rescue.hostsync import count_host_reads
    except ModuleNotFoundError:
        raise SystemExit(f"{Path(dynts.__file__).parents[1]} has no dynts/rescue/hostsync.py: copy this checkout's "
                         "into it (it counts torch's host reads, engine code untouched)") from None
    torch.set_num_threads(args.threads)
    setup = dict(SETUPS[args.shape])
    if args.shape == "real":
        setup.update(context=args.context, budget=args.budget, n=args.n, problems=args.problems)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device != "cpu" else torch.float32  # CPU bf16 matmuls crawl (no AMX)
    base, helper, predictor, vocab, decode_text = _models(args.shape, args.layers, dtype, device)
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bounds = dynts.Budget(setup["budget"], setup["local_window"], 0.4)
    base_decoder = StepDecoder(base, EvictionSettings("dynts", bounds, predictor=predictor), pad_token_id=0)
    helper_decoder = StepDecoder(helper, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(4, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt, history = rand(setup["prompt"]), rand(setup["context"] - setup["prompt"])
    start = time.perf_counter()
    b, h = base_decoder.prefill(prompt), helper_decoder.prefill(prompt)
    for i in range(0, len(history), 512):
        h = helper_decoder.append([h], [history[i : i + 512]])[0]
    base_history = history[-(setup["budget"] - setup["prompt"] - 1) :]  # the base holds B entries
    for i in range(0, len(base_history), 512):
        b = base_decoder.append([b], [base_history[i : i + 512]])[0]
    bases, helpers = [b] + [_replica(b) for _ in range(setup["problems"] - 1)], [h] + [_replica(h) for _ in range(setup["problems"] - 1)]
    prefill_s = time.perf_counter() - start

    sampler = Sampler(0.8, 20, 0.95)
    detector = DegenerationDetector(entropy_threshold=1e9, compress_threshold=1e-6, compress_window=64)
    n, steps, reads, decode_s, fork_bytes, largest = setup["n"], 0, 0, 0.0, {"base": 0, "helper": 0}, 0
    for rnd in range(args.rounds):
        chosen = None
        for policy, source in ((base_decoder, "base"), (helper_decoder, "helper")):
            states = bases if source == "base" else helpers
            cache, logits = policy.fork(states, n)
            fork_bytes[source] = max(fork_bytes[source], _kv_bytes(cache))
            candidates = [Candidate(p, source, j, candidate_generator(0, p, rnd, source, j), args.step_tokens,
                                    detector.screen() if source == "base" else None)
                          for p in range(len(states)) for j in range(n)]
            t = time.perf_counter()
            with count_host_reads() as counted:
                policy.decode(cache, logits, candidates, sampler, stop_ids=frozenset(), eos_ids=frozenset(), decode_text=decode_text)
            decode_s += time.perf_counter() - t
            steps += args.step_tokens
            reads += counted.count
            largest = max(largest, counted.largest())
            fork_bytes[source] = max(fork_bytes[source], _kv_bytes(cache))
            if source == "base":
                chosen = [candidates[p * n] for p in range(len(states))]
        bases = [c.state for c in chosen]
        helpers = helper_decoder.append(helpers, [c.tokens for c in chosen])
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "shape": args.shape, "setup": setup, "layers": args.layers if args.shape == "real" else base.config.num_hidden_layers,
        "dtype": str(dtype), "device": device, "rows_per_model": setup["n"] * setup["problems"],
        "prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps, "steps_per_s": steps / decode_s,
        "host_reads_per_step": reads / steps, "largest_host_read_elements": largest, "vocab": vocab,
        "fork_kv_mb": {k: v / 2**20 for k, v in fork_bytes.items()},
        "rss_after_load_mb": rss_loaded / 1024, "rss_peak_mb": rss_peak / 1024,
        "rss_growth_mb": (rss_peak - rss_loaded) / 1024,
    }


def _run(root: Path, shape: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_rescue.py"), "--worker", "--shape", shape, "--layers", str(args.layers),
           "--context", str(args.context), "--budget", str(args.budget), "--n", str(args.n), "--problems", str(args.problems),
           "--step-tokens", str(args.step_tokens), "--rounds", str(args.rounds), "--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{root} {shape} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, help="source tree of the code to compare against (e.g. an export of an older commit)")
    p.add_argument("--shapes", default="testbed,real")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the real-shape models")
    p.add_argument("--context", type=int, default=4096, help="real shape: the helper's committed context")
    p.add_argument("--budget", type=int, default=1024, help="real shape: the base's cache budget B")
    p.add_argument("--n", type=int, default=8, help="real shape: candidates per model per problem")
    p.add_argument("--problems", type=int, default=8, help="real shape: problems in flight")
    p.add_argument("--step-tokens", type=int, default=16, help="tokens per candidate step")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per tree, alternating before/after; steps/s is their median")
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "rescue" / "bench-engine.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--shape", default="testbed", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", ROOT)]
    results = {}
    for shape in args.shapes.split(","):
        runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
        for _ in range(args.repeats):  # alternate the trees: load from other jobs hits both alike
            for name, root in trees:
                runs[name].append(_run(root, shape, args))
        results[shape] = {}
        for name, rs in runs.items():
            speeds = sorted(r["steps_per_s"] for r in rs)
            results[shape][name] = {**rs[0], "steps_per_s": speeds[len(speeds) // 2], "steps_per_s_runs": speeds}
    rows = [("steps/s", "steps_per_s", "{:.2f}"), ("host reads / step", "host_reads_per_step", "{:.2f}"),
            ("largest host read (elements)", "largest_host_read_elements", "{:d}"),
            ("base fork K/V MB", ("fork_kv_mb", "base"), "{:.1f}"), ("helper fork K/V MB", ("fork_kv_mb", "helper"), "{:.1f}"),
            ("peak RSS growth MB", "rss_growth_mb", "{:.0f}"), ("peak RSS MB", "rss_peak_mb", "{:.0f}")]
    lines = []
    for shape, by in results.items():
        r = by["after"]
        lines += ["", f"{shape}: {r['rows_per_model']} rows per model ({r['setup']}), {r['layers']} layers, {r['dtype']} on {r['device']}",
                  "| metric | before | after | after / before |", "|---|---|---|---|"]
        for label, key, fmt in rows:
            get = (lambda d: d[key[0]][key[1]]) if isinstance(key, tuple) else (lambda d: d[key])  # noqa: E731
            a = get(r)
            bval = get(by["before"]) if "before" in by else None
            ratio = f"{a / bval:.2f}" if bval else "–"
            lines.append(f"| {label} | {fmt.format(bval) if bval is not None else '–'} | {fmt.format(a)} | {ratio} |")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results, "table": "\n".join(lines)}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
