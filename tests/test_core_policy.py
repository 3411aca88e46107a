"""The paged engines' scheduler-side rules (dynts.core.policy): events, the may-evict rule, admission, bounds."""

from __future__ import annotations

import pytest

from dynts.core import EvictionPolicy, EvictionSettings


def window(budget: int = 64, local: int = 16) -> EvictionSettings:
    return EvictionSettings("window", budget, local)


def events_until(policy: EvictionPolicy, rid: str, entry, prompt: int, new: int) -> int:
    """Decode ``new`` tokens one at a time through the policy's event rule; the number of events."""
    for generated in range(new):  # before the forward that writes token ``generated``: it stores prompt + generated
        stored = prompt + generated - entry.shift
        policy.event(rid, entry, stored)
        assert prompt + generated - entry.shift + 1 <= entry.settings.bounds.budget  # the new token fits B
    return entry.evictions


@pytest.mark.parametrize("prompt,new", [(8, 40), (8, 56), (8, 57), (20, 44), (20, 45), (8, 300), (30, 1)])
def test_may_evict_is_exactly_whether_the_event_rule_ever_fires(prompt, new):
    settings = window()
    policy = EvictionPolicy(16)
    entry = policy.open("r", settings, prompt, new)
    assert entry.may_evict == settings.may_evict(prompt, new) == (settings.bounds.events(prompt, new) > 0)
    assert entry.may_evict == (prompt + new > 64)
    # the skip is safe: an entry marked may_evict=True runs the same events it would without the flag
    probe = policy.open("probe", settings, prompt, None)
    assert probe.may_evict
    assert events_until(policy, "r", entry, prompt, new) == events_until(policy, "probe", probe, prompt, new)
    assert entry.evictions == settings.bounds.events(prompt, new)


def test_the_full_cache_never_evicts_and_no_length_limit_may():
    assert not EvictionSettings("full").may_evict(10, None)
    assert window().may_evict(10, None)
    policy = EvictionPolicy(16)
    entry = policy.open("f", EvictionSettings("full"), 10, 1000)
    assert not entry.may_evict and policy.event("f", entry, 5000) is None


def test_events_free_the_tail_and_count():
    policy = EvictionPolicy(16)
    entry = policy.open("r", window(), 8, 200)
    assert policy.event("r", entry, 63) is None  # the 64th slot still fits
    event = policy.event("r", entry, 64)
    assert event is not None and event.stored == 64 and event.n_keep == entry.n_keep
    assert event.keep_blocks == -(-entry.n_keep // 16)
    assert entry.shift == 64 - entry.n_keep and entry.evictions == 1


def test_admission_fifo_by_reservation():
    policy = EvictionPolicy(16)
    a = policy.open("a", window(), 8, 200)  # reserves ceil(64 / 16) = 4 blocks
    assert a.reserved_blocks == 4
    claimed = policy.claimed([(a, 1)])  # holds 1: may claim 3 more
    assert claimed == 3
    assert policy.admit([4, 4, None], free=11, claimed=claimed) == 3
    assert policy.admit([4, 4, None], free=10, claimed=claimed) == 1
    assert policy.admit([4, None, 4], free=7, claimed=claimed) == 2
    assert policy.admit([None], free=2, claimed=claimed) == 0


def test_trace_and_state_are_bounded():
    policy = EvictionPolicy(16, trace_rounds=8)
    for i in range(100):
        policy.open(str(i), window(), 8, 10)
        policy.after_round(i, (i, 1))
        assert policy.finish(str(i))["evictions"] == 0
    assert len(policy.block_trace) == 8 and not policy.requests and policy.peak_blocks_in_use == 99
