"""The decode harness (eval/perf/decode_bench.py): every lane, eager too, takes one untimed single-token step right
before its timed phases (on a GPU the first step of a new cache shape pays one-time costs), and the record says how
big the full cache is (a compiled full cache is one static cache of the largest L, for every L)."""

from __future__ import annotations

import pytest

import dynts
from conftest import tiny_model
from eval.perf.decode_bench import DecodeSettings, Driver, bench_positions, make_lane

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eager_lanes_take_the_warm_up_step_before_their_timed_steps(monkeypatch):
    model = tiny_model("qwen2")
    advanced: dict[str, list[list[int]]] = {}
    advance = Driver.advance

    def recording(self, lane, chunks):
        advanced.setdefault(lane.name, []).append(list(chunks))
        advance(self, lane, chunks)

    monkeypatch.setattr(Driver, "advance", recording)
    settings = DecodeSettings(budget=48, local_window=8, steps=3, prompt_tokens=16, full_chunk=64)
    run = bench_positions(model, "tiny", 1, ["window"], [100, 160], settings)
    assert set(advanced) == {"full", "window", "full@B"}
    for name, calls in advanced.items():
        assert all(chunks[-1] == 1 for chunks in calls), (name, calls)  # the last untimed token: one decode step
    for row in run["rows"]:
        assert row["full_capacity"] is None  # eager: a dynamic full cache of length L
        assert len(run["traces"]["window"][str(row["position"])]["top"]) == settings.steps


def test_a_static_full_lane_says_its_capacity():
    model = tiny_model("qwen2")
    static = make_lane(model, "full", None, 1, max_length=300)
    dynamic = make_lane(model, "window", dynts.Budget(48, 8, 0.4), 1)
    assert static.capacity == 300 and dynamic.capacity is None
