"""The eviction settings as plain data (:class:`EvictionSpec`) and their one validation."""

from __future__ import annotations

import argparse
import json

import pytest

from dynts.core import Budget, EvictionSettings, EvictionSpec, add_eviction_arguments, eviction_spec


def test_a_spec_is_frozen_hashable_and_json_round_trips():
    spec = EvictionSpec("window", 64, 8, method_options={"keep_question": True})
    assert spec == EvictionSpec("window", 64, 8, method_options=[("keep_question", True)])
    assert hash(spec) == hash(EvictionSpec("window", 64, 8, method_options={"keep_question": True}))
    with pytest.raises(AttributeError):
        spec.budget = 32
    for s in (spec, EvictionSpec("full"), EvictionSpec("window", Budget.from_paper(16, 8, 4), think_end=[5, 6]),
              EvictionSpec("fixed", 32, 0, think_end=None, method_options={"keep": [[0, 1, 2]]}),
              EvictionSpec("dynts", 64, 8, predictor="some/dir")):
        hash(s)
        assert EvictionSpec.from_dict(json.loads(json.dumps(s.as_dict()))) == s


def test_build_gives_the_settings_the_keywords_give():
    spec = EvictionSpec("window", 64, 8, retention=0.5, method_options={"keep_question": True})
    settings = spec.build()
    direct = EvictionSettings("window", 64, 8, 0.5, method_options={"keep_question": True})
    assert settings.bounds == direct.bounds and settings.evictor == direct.evictor
    assert EvictionSpec("fixed", 32, 0, method_options={"keep": [[0, 1]]}).build().evictor.keep == [[0, 1]]
    loaded = object()
    assert EvictionSpec("dynts", 64, 8, predictor="dir").build(predictor=loaded).predictor is loaded
    assert EvictionSettings.resolve(spec, {}).bounds == settings.bounds  # entry points take a spec too
    assert not EvictionSpec("full").bounded and spec.bounded
    assert spec.replace(budget=32).build().bounds.budget == 32


@pytest.mark.parametrize("fields, message", [
    (dict(method="nope", budget=64, local_window=8), "nope"),
    (dict(method="window"), "needs budget=... and local_window"),
    (dict(method="window", budget=0, local_window=8), "budget=0 must be a positive int"),
    (dict(method="window", budget=64, local_window=-1), "local_window=-1"),
    (dict(method="window", budget=64, local_window=8, retention=1.5), "retention=1.5"),
    (dict(method="dynts", budget=64, local_window=8), "needs predictor"),
    (dict(method="window", budget=64, local_window=8, method_options={"sink": 3}), "window"),
])
def test_a_bad_field_is_refused_when_the_spec_is_made(fields, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EvictionSpec(**fields)


def test_the_servers_flags_produce_a_spec():
    parser = argparse.ArgumentParser()
    add_eviction_arguments(parser)
    args = parser.parse_args(["--kv-method", "window", "--kv-budget", "64", "--kv-local-window", "8"])
    assert eviction_spec(args, think_end=None) == EvictionSpec("window", 64, 8, 0.4, think_end=None)
