"""Decode cost of a bounded cache vs the full cache: per-token latency by position, peak KV, FLOPs.

:func:`bench_positions` advances every lane (the full cache and each eviction method) together
through the positions. A lane reaches position ``L`` by a chunked prefill THROUGH its own cache
(chunks of at most the eviction volume ``K``, so a bounded cache evicts exactly as in decoding and
never holds more than ``B``); the chunk schedule (:func:`plan_chunks`) is planned so that a bounded
cache holds ``B - N`` entries at ``L - N``. Then every lane decodes, round-robin so that machine
noise hits all lanes alike:

* ``top``: N steps at the top of the sawtooth (cache length B-N+1 .. B);
* ``event``: 1 step that fires the eviction event (selection + compaction, all layers);
* ``bottom``: N steps after it (length n_keep+2 .. n_keep+N+1).

A fresh full cache filled to ``B - N`` (``full@B``) decodes N steps alongside the ``top`` phase at every
position: ``t_full(B)``, the bound (a bounded step can at best cost what a full step at length B costs).

Reported per position (:func:`summarize`): ``t_full(L)``; per method ``top`` / ``bottom`` / ``event``
medians and the amortised per-token time ``t(L) = (top + bottom) / 2 + (event - bottom) / K`` (step
time is linear in cache length over a sawtooth cycle); the speedup ``t_full(L) / t(L)``; the distance
from the bound ``t_top(L) / t_full(B)`` (same cache length: everything above 1 is our overhead) and
``t(L) / t_full(B)``; DynTS vs window; peak KV bytes and their ratio to full; FLOPs/token from
:mod:`dynts.cost`. :func:`sawtooth` times every step of one continuous decode (the paper's Fig. 5).

Every lane takes one untimed single-token step right before its timed phases at each position (on a GPU
the first step of a new cache shape pays one-time costs: an eager lane's first timing read 102-105 ms
against 39-41 ms steady on an H200).

With ``compile`` every lane uses a static-layout cache (fixed buffers: ``B`` slots for a method, for
the full cache ONE buffer of ``max(positions) + 3N + 1`` slots for every position, for ``full@B`` ``B``
slots, like transformers' StaticCache) and decode steps run through
:func:`dynts.compiled.compiled_decode`; compilation (one graph per lane) happens in that untimed step.
A static cache attends over its whole capacity, so a compiled ``t_full(L)`` is the cost at
``max(positions)`` for every ``L`` (each row's ``full_capacity`` says so; ``None``: a dynamic cache of
length ``L``).

Used by ``scripts/bench_decode.py`` (CPU, shipped models) and ``scripts/gpu_check.py`` (7B shapes on a
GPU); :mod:`.decode_report` prints, plots and saves the records.
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

import dynts
from dynts.compiled import compiled_decode
from dynts.cost import ModelShape, decode_flops, predictor_flops, selection_flops
from dynts.cli_options import parse_options
from dynts.hf_compat import cache_keyword


@dataclass(frozen=True)
class DecodeSettings:
    """What one measurement holds fixed: the budget ``B``, ``W_l`` and retention; ``M`` prompt tokens;
    ``N`` timed steps per phase; the full cache's prefill chunk; the per-phase statistic of step times
    (``"median"`` or ``"min"``, which resists a shared machine's noise); the seed of the random ids;
    static caches and compiled decode steps."""

    budget: int = 1024
    local_window: int = 128
    retention: float = 0.4
    prompt_tokens: int = 32
    steps: int = 12
    full_chunk: int = 512
    stat: str = "median"
    seed: int = 0
    compile: bool = False


# ---------------------------------------------------------------------------------------------- lanes
@dataclass
class Lane:
    """One cache driven through the model: the full cache, a method, or the full@B reference."""

    name: str
    cache: dynts.BoundedCache
    predictor: dynts.ImportancePredictor | None
    batch: int = 1
    capacity: int | None = None  # a static cache's slots (None: dynamic, sized by what it holds)
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


def plan_chunks(seen: int, length: int, target_seen: int, target_length: int, bounds: dynts.Budget,
                n_keep: int) -> list[int]:
    """Chunk sizes (each <= K = B - n_keep) taking a bounded cache from ``(seen, length)`` to
    ``(target_seen, target_length)``, with the cache's event rule (:meth:`dynts.Budget.due`: a chunk of
    ``q`` evicts to ``n_keep`` first when it would overflow ``B``)."""
    budget = bounds.budget
    volume = budget - n_keep
    distance = target_seen - seen
    if distance < 0:
        raise ValueError(f"cannot go back from {seen} to {target_seen} tokens")

    def feed(chunks: list[int]) -> int:
        current = length
        for q in chunks:
            if bounds.due(current, q, n_keep):
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
    """A lane of method ``name`` with its options (e.g. ``h2o:per_head=true``, ``rkv:mix_lambda=0.07``); ``max_length``
    (a static full cache's capacity) turns on the static layout."""
    method, _, rest = ("full" if name.startswith("full") else name).partition(":")
    options = {**method_options(method, model.config.get_text_config().vocab_size),
               **parse_options(rest.split(",") if rest else [], flag=f"lane {name!r}:")}
    evictor = dynts.make_evictor(method, **options)
    static = {} if max_length is None else {"static": True, "max_length": max_length}
    cache = dynts.build_cache(model, evictor, budget, **static)
    predictor = None
    if "scores" in cache.requires:
        torch.manual_seed(0)  # speed does not depend on the weights: an untrained predictor scores the same way
        predictor = dynts.ImportancePredictor(model.config.get_text_config().hidden_size).to(next(model.parameters()).device).eval()
    return Lane(name, cache, predictor, batch, capacity=max_length)


def bench_positions(model, model_name: str, batch: int, methods: list[str], positions: list[int],
                    settings: DecodeSettings) -> dict:
    """Time every lane at every position (see the module docstring); returns the JSON record."""
    config = model.config.get_text_config()
    driver = Driver(model, config.vocab_size, seed=settings.seed, compile=settings.compile)
    bounds = dynts.Budget(settings.budget, settings.local_window, settings.retention)
    m, n = settings.prompt_tokens, settings.steps
    full_length = max(positions) + 3 * n + 1 if settings.compile else None  # static full cache capacity
    bound_length = settings.budget if settings.compile else None
    n_keep, volume = bounds.n_keep(m), bounds.eviction_volume(m)
    if n >= volume:
        raise ValueError(f"steps ({n}) must be below the eviction volume K={volume}")
    prompt = driver.random_ids(batch, m)
    lanes = [make_lane(model, "full", None, batch, full_length)]
    lanes += [make_lane(model, name, bounds, batch, bound_length) for name in methods]
    for lane in lanes:
        driver.forward(lane, prompt)
    started = time.perf_counter()
    warm = 1  # the last untimed token is a single-token forward: a new shape's one-time costs, a compiled lane's graph
    for position in positions:
        for lane in lanes:  # reach L - N untimed
            cache = lane.cache
            if lane.bounded:
                chunks = plan_chunks(cache.seen, cache.length, position - n - warm, settings.budget - n - warm,
                                     bounds, n_keep)
            else:
                chunks = full_chunks(position - n - warm - cache.seen, settings.full_chunk)
            driver.advance(lane, chunks + [1] * warm)
            if lane.bounded and (cache.seen, cache.length) != (position - n, settings.budget - n):
                raise AssertionError(f"{lane.name}: at {cache.seen} tokens with {cache.length} cached, planned otherwise")
        reference = make_lane(model, "full@B", None, batch, bound_length)  # the bound, timed alongside
        driver.forward(reference, prompt)
        driver.advance(reference, full_chunks(settings.budget - n - m - warm, settings.full_chunk) + [1] * warm)
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
    return summarize(model, model_name, batch, lanes, positions, bounds, settings)


def summarize(model, model_name, batch, lanes, positions, bounds, settings: DecodeSettings) -> dict:
    m = settings.prompt_tokens
    n_keep, volume = bounds.n_keep(m), bounds.eviction_volume(m)
    shape = ModelShape.from_config(model.config.get_text_config().to_dict(), name=model_name,
                                   bytes_per_element=next(model.parameters()).element_size())
    med = min if settings.stat == "min" else statistics.median
    rows = []
    for position in positions:
        full = next(lane for lane in lanes if not lane.bounded)
        ft = full.times[position]
        t_full_l = med(ft["top"] + ft["event"] + ft["bottom"])
        t_full_b = med(ft["full@B"])
        row = dict(position=position, t_full_L=t_full_l, t_full_B=t_full_b, full_capacity=full.capacity,
                   full_peak_kv_bytes=full.peak_kv_bytes[position],
                   full_flops=decode_flops(shape, position) * batch, methods={})
        for lane in lanes:
            if not lane.bounded:
                continue
            t = lane.times[position]
            top, bottom, event = med(t["top"]), med(t["bottom"]), t["event"][0]
            amortised = (top + bottom) / 2 + max(event - bottom, 0.0) / volume
            flops = decode_flops(shape, (settings.budget + n_keep) / 2) + selection_flops(settings.budget) / volume
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
    return dict(model=model_name, batch=batch, budget=settings.budget, local_window=settings.local_window,
                retention=settings.retention, prompt_tokens=m, n_keep=n_keep, eviction_volume=volume,
                steps=settings.steps, kv_bytes_per_token=shape.kv_bytes_per_token * batch, rows=rows, traces=traces)


# ---------------------------------------------------------------------------------------------- sawtooth
@torch.no_grad()
def sawtooth(model, model_name: str, methods: list[str], length: int, settings: DecodeSettings) -> dict:
    """Every decode step timed from the prompt to ``length`` tokens (the paper's Fig. 5 shape)."""
    config = model.config.get_text_config()
    bounds = dynts.Budget(settings.budget, settings.local_window, settings.retention)
    driver = Driver(model, config.vocab_size, seed=settings.seed)
    prompt = driver.random_ids(1, settings.prompt_tokens)
    lanes = [make_lane(model, "full", None, 1)] + [make_lane(model, name, bounds, 1) for name in methods]
    for lane in lanes:
        driver.forward(lane, prompt)
    for _ in range(length - settings.prompt_tokens):
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
