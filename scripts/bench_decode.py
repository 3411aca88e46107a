"""Decode cost with a bounded cache vs the full cache: per-token latency by position, peak KV, FLOPs.

For every model and batch size, all lanes (the full cache and each eviction method) advance together
through the positions (default 1k / 4k / 8k / 16k tokens seen). A lane reaches position ``L`` by a
chunked prefill THROUGH its own cache (chunks of at most the eviction volume ``K``, so a bounded cache
evicts exactly as in decoding and never holds more than ``B``); the chunk schedule is planned so that
a bounded cache holds ``B - N`` entries at ``L - N``. Then every lane decodes, round-robin so that
machine noise hits all lanes alike:

* ``top``: N steps at the top of the sawtooth (cache length B-N+1 .. B);
* ``event``: 1 step that fires the eviction event (selection + compaction, all layers);
* ``bottom``: N steps after it (length n_keep+2 .. n_keep+N+1).

A fresh full cache filled to ``B - N`` (``full@B``) decodes N steps alongside the ``top`` phase at every
position: ``t_full(B)``, the bound (a bounded step can at best cost what a full step at length B costs).

Reported per position: ``t_full(L)``; per method ``top`` / ``bottom`` / ``event`` medians and the
amortised per-token time ``t(L) = (top + bottom) / 2 + (event - bottom) / K`` (step time is linear
in cache length over a sawtooth cycle); the speedup ``t_full(L) / t(L)``; the distance from the bound
``t_top(L) / t_full(B)`` (same cache length: everything above 1 is our overhead) and
``t(L) / t_full(B)``; DynTS vs window; peak KV bytes and their ratio to full; FLOPs/token from
:mod:`dynts.cost`. A continuous decode of the small model traces the sawtooth of the paper's Fig. 5.
Writes ``bench_decode.json`` and ``decode_latency.png`` under ``--out``.

``--stats-before-after``: the per-step cost of the attention statistics (H2O, SnapKV, R-KV) over the
window method, with ``q k^T`` in the model's dtype (shipped) and with the query and the whole key
cache cast to float32 first (the former code), alternating ``--ab-rounds`` times; pair it with
``--dtype bfloat16`` (in float32 the two are the same computation).

``--compile``: every lane uses a static-layout cache (fixed buffers: ``B`` slots for a method, for the
full cache ``max(positions) + 3N`` slots, for ``full@B`` ``B`` slots, like transformers' StaticCache)
and decode steps run through :func:`dynts.compiled.compiled_decode`; ``t_full(B)`` is then the
compiled static full cache at length ``B``. Compilation (one graph per lane) happens in an untimed
warm-up step before the timed phases.

    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py            # ~10 min on 2 cores
    .venv/bin/python scripts/bench_decode.py --quick                               # tiny model, ~1 min
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py --models small --compile
    flock /tmp/dynts-cpu.lock .venv/bin/python scripts/bench_decode.py --quick --dtype bfloat16 --stats-before-after
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dynts  # noqa: E402
import dynts.attention  # noqa: E402
from dynts.compiled import compiled_decode  # noqa: E402
from dynts.cost import ModelShape, decode_flops, predictor_flops, selection_flops  # noqa: E402
from dynts.hf_compat import cache_keyword  # noqa: E402
from dynts.kernels import backend_for  # noqa: E402
from dynts.models import checkpoints_dir  # noqa: E402
from decode_report import plot, print_run, print_stats_before_after, write_json  # noqa: E402


# ---------------------------------------------------------------------------------------------- models
def small_model() -> tuple[torch.nn.Module, str]:
    """The testbed LRM if it has been trained, else a random Qwen2 of the testbed's shape."""
    if (checkpoints_dir() / "testbed-lrm" / "config.json").is_file():
        model, _ = dynts.load("testbed")
        return model, "testbed-lrm"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval(), "random-qwen2-0.8M"


STATS_METHODS = ("h2o", "snapkv", "rkv")  # the methods whose statistics come from dynts.attention.attention_rows
SHIPPED_ATTENTION_ROWS = dynts.attention.attention_rows


def fp32_attention_rows(query, key, attention_mask, scaling):
    """The former statistics: query and the whole key cache cast to float32 before ``q k^T``."""
    return SHIPPED_ATTENTION_ROWS(query.float(), key.float(), attention_mask, scaling)


def stats_before_after(model, label: str, args) -> dict:
    """``t_top`` of window and the statistics methods with float32-cast keys (before) and model-dtype
    ``q k^T`` (after), best of ``args.ab_rounds`` alternating runs; overhead = method - window."""
    methods = ["window", *STATS_METHODS]
    best: dict = {}
    for _ in range(args.ab_rounds):
        for variant, rows_fn in (("before", fp32_attention_rows), ("after", SHIPPED_ATTENTION_ROWS)):
            dynts.attention.attention_rows = rows_fn
            try:
                run = bench_positions(model, f"{label} [{variant}]", 1, methods, args.positions, args)
            finally:
                dynts.attention.attention_rows = SHIPPED_ATTENTION_ROWS
            for row in run["rows"]:
                for name, r in row["methods"].items():
                    key = (row["position"], name, variant)
                    best[key] = min(best.get(key, float("inf")), r["t_top"])
    table = []
    for position in args.positions:
        for name in STATS_METHODS:
            before = best[(position, name, "before")] - best[(position, "window", "before")]
            after = best[(position, name, "after")] - best[(position, "window", "after")]
            table.append(dict(position=position, method=name, t_top_before=best[(position, name, "before")],
                              t_top_after=best[(position, name, "after")], overhead_before=before, overhead_after=after))
    print_stats_before_after(f"{label} {args.dtype}, B={args.budget}, best of {args.ab_rounds}", table)
    return dict(model=label, dtype=args.dtype, budget=args.budget, rounds=args.ab_rounds, rows=table)


def load_model(name: str) -> tuple[torch.nn.Module, str]:
    if name == "small":
        return small_model()
    model, _ = dynts.load(name)
    return model, name


# ---------------------------------------------------------------------------------------------- lanes
@dataclass
class Lane:
    """One cache driven through the model: the full cache, a method, or the full@B reference."""

    name: str
    cache: dynts.BoundedCache
    predictor: dynts.ImportancePredictor | None
    batch: int = 1
    token: torch.Tensor | None = None  # last predicted token [b, 1]
    times: dict = field(default_factory=dict)  # position -> {"top": [...], "event": [...], "bottom": [...]}
    lengths: dict = field(default_factory=dict)  # position -> {"top": [...], ...} cache length after each step
    peak_kv_bytes: dict = field(default_factory=dict)  # position -> peak live KV bytes so far

    @property
    def bounded(self) -> bool:
        return self.cache.bounded


class Driver:
    """Runs forwards of one model for several lanes, each through ``dynts.attach`` of its own cache."""

    def __init__(self, model: torch.nn.Module, vocab: int, seed: int = 0, compile: bool = False):
        self.model = model
        self.compile = compile
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)
        self.cache_kw = cache_keyword(model)
        self.device = next(model.parameters()).device

    def random_ids(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (batch, length), generator=self.generator).to(self.device)

    @torch.no_grad()
    def forward(self, lane: Lane, ids: torch.Tensor) -> float:
        """One forward of ``ids`` [b, q] through ``lane``; returns seconds (the forward and the argmax)."""
        with dynts.attach(self.model, lane.cache, lane.predictor), ExitStack() as stack:
            if self.compile:
                stack.enter_context(compiled_decode(self.model))
            sync(self.device)
            start = time.perf_counter()
            out = self.model(input_ids=ids, logits_to_keep=1, use_cache=True, **{self.cache_kw: lane.cache})
            lane.token = out.logits[:, -1:].argmax(-1)
            sync(self.device)
            return time.perf_counter() - start

    def step(self, lane: Lane, position: int, phase: str) -> None:
        seconds = self.forward(lane, lane.token)
        lane.times.setdefault(position, {}).setdefault(phase, []).append(seconds)
        lane.lengths.setdefault(position, {}).setdefault(phase, []).append(lane.cache.length)

    def advance(self, lane: Lane, chunks: list[int]) -> None:
        for size in chunks:
            self.forward(lane, self.random_ids(lane.batch, size))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_chunks(seen: int, length: int, target_seen: int, target_length: int, budget: int, n_keep: int) -> list[int]:
    """Chunk sizes (each <= K = budget - n_keep) taking a bounded cache from ``(seen, length)`` to
    ``(target_seen, target_length)``, with the cache's rule: a chunk of ``q`` evicts to ``n_keep``
    first when ``length + q > budget`` and ``length > n_keep``."""
    volume = budget - n_keep
    distance = target_seen - seen
    if distance < 0:
        raise ValueError(f"cannot go back from {seen} to {target_seen} tokens")

    def feed(chunks: list[int]) -> int:
        current = length
        for q in chunks:
            if current + q > budget and current > n_keep:
                current = n_keep
            current += q
            if current > budget:
                raise AssertionError("a planned chunk overflows the budget")
        return current

    if length + distance == target_length <= budget:  # no eviction on the way
        chunks = [volume] * (distance // volume) + ([distance % volume] if distance % volume else [])
    else:
        final = target_length - n_keep  # the last chunk follows an eviction
        if not 1 <= final <= min(volume, distance):
            raise ValueError(
                f"cannot land on {target_length} cached entries at {target_seen} tokens (n_keep={n_keep}, K={volume}); "
                "use positions <= budget or >= budget + K"
            )
        before = distance - final
        odd = before % volume or (volume if before else 0)
        chunks = ([odd] if odd else []) + [volume] * ((before - odd) // volume) + [final]
    if feed(chunks) != target_length:
        raise ValueError(
            f"no chunk plan lands on {target_length} entries at {target_seen} tokens from ({seen}, {length}); "
            "choose positions further apart"
        )
    return chunks


def full_chunks(distance: int, chunk: int) -> list[int]:
    return [chunk] * (distance // chunk) + ([distance % chunk] if distance % chunk else [])


# ---------------------------------------------------------------------------------------------- one run
def method_options(name: str, vocab: int) -> dict:
    """Settings a method needs beyond the defaults (prompts are random ids, so SepLLM gets 1 id in 16)."""
    return {"separator_token_ids": tuple(range(3, vocab, 16))} if name == "sepllm" else {}


def make_lane(model, name: str, budget: dynts.Budget | None, batch: int, max_length: int | None = None) -> Lane:
    """A lane; ``max_length`` (a static full cache's capacity) turns on the static layout."""
    method = "full" if name.startswith("full") else name
    evictor = dynts.make_evictor(method, **method_options(method, model.config.get_text_config().vocab_size))
    static = {} if max_length is None else {"static": True, "max_length": max_length}
    cache = dynts.build_cache(model, evictor, budget, **static)
    predictor = None
    if "scores" in cache.requires:
        torch.manual_seed(0)  # speed does not depend on the weights: an untrained predictor scores the same way
        predictor = dynts.ImportancePredictor(model.config.get_text_config().hidden_size).to(next(model.parameters()).device).eval()
    return Lane(name, cache, predictor, batch)


def bench_positions(model, model_name: str, batch: int, methods: list[str], positions: list[int], args) -> dict:
    """Time every lane at every position (see the module docstring); returns the JSON record."""
    config = model.config.get_text_config()
    driver = Driver(model, config.vocab_size, seed=args.seed, compile=args.compile)
    bounds = dynts.Budget(args.budget, args.local_window, args.retention)
    m, n = args.prompt_tokens, args.steps
    full_length = max(positions) + 3 * n + 1 if args.compile else None  # static full cache capacity
    bound_length = args.budget if args.compile else None
    n_keep, volume = bounds.n_keep(m), bounds.eviction_volume(m)
    if n >= volume:
        raise ValueError(f"--steps {n} must be below the eviction volume K={volume}")
    prompt = driver.random_ids(batch, m)
    lanes = [make_lane(model, "full", None, batch, full_length)]
    lanes += [make_lane(model, name, bounds, batch, bound_length) for name in methods]
    for lane in lanes:
        driver.forward(lane, prompt)
    started = time.perf_counter()
    warm = 1 if args.compile else 0  # the last untimed token is a single-token forward: compiles the lane's graph
    for position in positions:
        for lane in lanes:  # reach L - N untimed
            cache = lane.cache
            if lane.bounded:
                chunks = plan_chunks(cache.seen, cache.length, position - n - warm, args.budget - n - warm,
                                     args.budget, n_keep)
            else:
                chunks = full_chunks(position - n - warm - cache.seen, args.full_chunk)
            driver.advance(lane, chunks + [1] * warm)
            if lane.bounded and (cache.seen, cache.length) != (position - n, args.budget - n):
                raise AssertionError(f"{lane.name}: at {cache.seen} tokens with {cache.length} cached, planned otherwise")
        reference = make_lane(model, "full@B", None, batch, bound_length)  # the bound, timed alongside
        driver.forward(reference, prompt)
        driver.advance(reference, full_chunks(args.budget - n - m - warm, args.full_chunk) + [1] * warm)
        for phase, count, members in (
            ("top", n, lanes + [reference]),
            ("event", 1, lanes),
            ("bottom", n, lanes),
        ):
            for _ in range(count):
                for lane in members:
                    driver.step(lane, position, phase)
        reference.cache = None
        lanes[0].times[position]["full@B"] = reference.times[position]["top"]  # lanes[0] is the full cache
        for lane in lanes:
            lane.peak_kv_bytes[position] = lane.cache.stats.peak_kv_bytes
        print(f"  [{model_name} b={batch}] position {position} done ({time.perf_counter() - started:.0f} s)", flush=True)
    return summarize(model, model_name, batch, lanes, positions, bounds, args)


def summarize(model, model_name, batch, lanes, positions, bounds, args) -> dict:
    m = args.prompt_tokens
    n_keep, volume = bounds.n_keep(m), bounds.eviction_volume(m)
    shape = ModelShape.from_config(model.config.get_text_config().to_dict(), name=model_name,
                                   bytes_per_element=next(model.parameters()).element_size())
    med = min if args.stat == "min" else statistics.median
    rows = []
    for position in positions:
        full = next(lane for lane in lanes if not lane.bounded)
        ft = full.times[position]
        t_full_l = med(ft["top"] + ft["event"] + ft["bottom"])
        t_full_b = med(ft["full@B"])
        row = dict(position=position, t_full_L=t_full_l, t_full_B=t_full_b,
                   full_peak_kv_bytes=full.peak_kv_bytes[position],
                   full_flops=decode_flops(shape, position) * batch, methods={})
        for lane in lanes:
            if not lane.bounded:
                continue
            t = lane.times[position]
            top, bottom, event = med(t["top"]), med(t["bottom"]), t["event"][0]
            amortised = (top + bottom) / 2 + max(event - bottom, 0.0) / volume
            flops = decode_flops(shape, (args.budget + n_keep) / 2) + selection_flops(args.budget) / volume
            if lane.predictor is not None:
                flops += predictor_flops(shape.hidden_size)
            row["methods"][lane.name] = dict(
                t_top=top, t_bottom=bottom, t_event=event, t_amortised=amortised,
                speedup=t_full_l / amortised,
                top_over_full_B=top / t_full_b,
                amortised_over_full_B=amortised / t_full_b,
                event_extra=event - bottom,
                peak_kv_bytes=lane.peak_kv_bytes[position],
                kv_ratio=lane.peak_kv_bytes[position] / full.peak_kv_bytes[position],
                lengths=lane.lengths[position],
                flops=flops * batch,
            )
        if "dynts" in row["methods"] and "window" in row["methods"]:
            d, w = row["methods"]["dynts"], row["methods"]["window"]
            row["dynts_vs_window"] = dict(top=d["t_top"] / w["t_top"], amortised=d["t_amortised"] / w["t_amortised"],
                                          event_extra_ms=1e3 * (d["event_extra"] - w["event_extra"]))
        rows.append(row)
    traces = {lane.name: {str(p): lane.times[p] for p in positions} for lane in lanes}
    return dict(model=model_name, batch=batch, budget=args.budget, local_window=args.local_window,
                retention=args.retention, prompt_tokens=m, n_keep=n_keep, eviction_volume=volume,
                steps=args.steps, kv_bytes_per_token=shape.kv_bytes_per_token * batch, rows=rows, traces=traces)


# ---------------------------------------------------------------------------------------------- sawtooth
@torch.no_grad()
def sawtooth(model, model_name: str, methods: list[str], length: int, args) -> dict:
    """Every decode step timed from the prompt to ``length`` tokens (the paper's Fig. 5 shape)."""
    config = model.config.get_text_config()
    bounds = dynts.Budget(args.budget, args.local_window, args.retention)
    driver = Driver(model, config.vocab_size, seed=args.seed)
    prompt = driver.random_ids(1, args.prompt_tokens)
    lanes = [make_lane(model, "full", None, 1)] + [make_lane(model, name, bounds, 1) for name in methods]
    for lane in lanes:
        driver.forward(lane, prompt)
    for _ in range(length - args.prompt_tokens):
        for lane in lanes:
            driver.step(lane, 0, "trace")
    return {lane.name: dict(seconds=lane.times[0]["trace"], lengths=lane.lengths[0]["trace"],
                            events=lane.cache.stats.event_steps) for lane in lanes}


def default_methods() -> list[str]:
    """Every registered decode-time method (``fixed`` needs a position set; it is an oracle tool)."""
    names = []
    for name in dynts.available_methods():
        if name == "full":
            continue
        try:
            dynts.make_evictor(name, **method_options(name, 1000))
        except ValueError:
            continue
        names.append(name)
    return names


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model only, B=128, positions 128/512/1024")
    parser.add_argument("--models", nargs="+", default=None, help="smollm2-135m, small (testbed or random Qwen2), a dir")
    parser.add_argument("--methods", nargs="+", default=None, help="small model (default: every registered method)")
    parser.add_argument("--large-methods", nargs="+", default=["window", "streamingllm", "dynts"],
                        help="other models at batch 1 (each lane costs ~1 min of prefill per 16k tokens on SmolLM2)")
    parser.add_argument("--batch8-methods", nargs="+", default=["window", "dynts"], help="other models at batch 8")
    parser.add_argument("--positions", type=int, nargs="+", default=None, help="batch 1 (default 1024 4096 8192 16384)")
    parser.add_argument("--batch8-positions", type=int, nargs="+", default=None, help="batch 8 on SmolLM2 (default 2048)")
    parser.add_argument("--budget", type=int, default=None, help="B (default 1024; quick 128)")
    parser.add_argument("--local-window", type=int, default=None, help="W_l (default 128; quick 16)")
    parser.add_argument("--retention", type=float, default=0.4)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="M, the question window")
    parser.add_argument("--steps", type=int, default=None, help="N timed steps per phase (default 12; quick 6)")
    parser.add_argument("--full-chunk", type=int, default=512, help="prefill chunk of the full cache")
    parser.add_argument("--sawtooth-length", type=int, default=None, help="continuous trace length (small model)")
    parser.add_argument("--stat", choices=("median", "min"), default="median",
                        help="per-phase statistic of step times (min resists a shared machine's noise)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], choices=[1, 8],
                        help="batch sizes to run (batch 8 uses the --batch8-* settings on large models)")
    parser.add_argument("--compile", action="store_true",
                        help="static-layout caches and torch.compile'd decode steps (see the module docstring)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype")
    parser.add_argument("--stats-before-after", action="store_true",
                        help="only the attention-statistics cost, float32-cast keys vs model-dtype q k^T (docstring)")
    parser.add_argument("--ab-rounds", type=int, default=2, help="alternating rounds of --stats-before-after")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_decode")
    args = parser.parse_args(argv)
    q = args.quick
    args.models = args.models or (["small"] if q else ["smollm2-135m", "small"])
    args.positions = args.positions or ([128, 512, 1024] if q else [1024, 4096, 8192, 16384])
    args.batch8_positions = args.batch8_positions or ([128, 512] if q else [2048])
    args.budget = args.budget or (128 if q else 1024)
    args.local_window = args.local_window if args.local_window is not None else (16 if q else 128)
    args.steps = args.steps or (6 if q else 12)
    args.sawtooth_length = args.sawtooth_length if args.sawtooth_length is not None else (600 if q else 2600)
    if q:
        args.full_chunk = min(args.full_chunk, 128)
    return args


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def main(argv=None) -> int:
    if argv is None and any(k not in os.environ for k in MALLOC_ENV):
        # glibc reads these at start-up: without them CPU decode churns pages (FACTS: batch-8 70 -> 26 ms/step)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**MALLOC_ENV, **os.environ})
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = args.methods or default_methods()
    results = dict(
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        machine=dict(platform=platform.platform(), threads=torch.get_num_threads(), torch=torch.__version__,
                     kernels=backend_for(torch.zeros(1)),
                     malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_")),
        runs=[],
    )
    started = time.perf_counter()
    for name in args.models:
        model, label = load_model(name)
        model = model.to(getattr(torch, args.dtype))
        if args.stats_before_after:
            results["stats_before_after"] = stats_before_after(model, label, args)
            write_json(results, args.out / "bench_decode.json")
            continue
        small = name == "small"
        for batch in args.batches:
            batch_methods = methods if small else (args.large_methods if batch == 1 else args.batch8_methods)
            positions = args.positions if batch == 1 or small else args.batch8_positions
            print(f"{label}: batch {batch}, methods {batch_methods}, positions {positions}", flush=True)
            run = bench_positions(model, label, batch, batch_methods, positions, args)
            print_run(run)
            results["runs"].append(run)
            write_json(results, args.out / "bench_decode.json")
        if small and args.sawtooth_length:
            trace_methods = [m for m in ("window", "dynts") if m in methods]
            print(f"{label}: sawtooth trace to {args.sawtooth_length} tokens ({['full'] + trace_methods})", flush=True)
            lanes = sawtooth(model, label, trace_methods, args.sawtooth_length, args)
            results["sawtooth"] = dict(model=label, prompt_tokens=args.prompt_tokens, lanes=lanes)
            for lane, trace in lanes.items():
                s = trace["seconds"]
                print(f"  {lane:<8} first 100 steps {1e3 * statistics.median(s[:100]):.2f} ms, last 100 "
                      f"{1e3 * statistics.median(s[-100:]):.2f} ms, events at {trace['events'][:6]}")
        del model
    results["seconds"] = time.perf_counter() - started
    write_json(results, args.out / "bench_decode.json")
    if args.stats_before_after:
        return 0
    plot(results, args.out / "decode_latency.png")
    print(f"\nwrote {args.out / 'bench_decode.json'} and {args.out / 'decode_latency.png'} "
          f"({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
