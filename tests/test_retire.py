"""Finished rows leaving a batched decode (dynts.generate(retire_finished=True), dynts/cache/retire.py): the rows
left generate bit for bit what they generate in the whole batch, for every kind of method."""

from __future__ import annotations

import pytest
import torch

import dynts
from conftest import padded_batch, tiny_model
from dynts.cache import RowRetirement

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = [5, 17, 33, 60]  # frequent enough in a random model that rows end at many different steps
MIN_ROWS = 1  # every finished row leaves (the default keeps 16)


def _pair(model, method, budget=40, options=None, predictor=None, sampling=None, rows=8, min_rows=MIN_ROWS):
    ids, mask = padded_batch([7 + (5 * r) % 11 for r in range(rows)], seed=2)
    runs = []
    for retire in (False, True):
        torch.manual_seed(3)
        runs.append(dynts.generate(
            model, input_ids=ids, attention_mask=mask, method=method, method_options=options or {}, budget=budget,
            local_window=8, predictor=predictor, max_new_tokens=80, pad_token_id=0, eos_token_id=EOS,
            retire_finished=RowRetirement(EOS, check_every=4, min_rows=min_rows) if retire else False,
            **(sampling or {"do_sample": True, "temperature": 1.0}),
        ))
    return runs


@pytest.mark.parametrize(("method", "options"), [
    ("full", {}), ("window", {}), ("streamingllm", {}), ("sepllm", {"separator_token_ids": (3, 12, 21)}),
    ("h2o", {}), ("h2o", {"per_head": True}), ("snapkv", {}), ("snapkv", {"per_head": True, "keep_question": True}),
    ("rkv", {}), ("rkv", {"per_head": True}), ("random", {}),
])
def test_rows_left_generate_what_they_generate_in_the_whole_batch(qwen2, method, options):
    whole, retired = _pair(qwen2, method, None if method == "full" else 40, options)
    assert retired.stats["retired_rows"] >= 3  # rows did leave (and the last one ran to the end)
    assert torch.equal(whole.sequences, retired.sequences)
    for key in ("lengths", "evictions", "evicted_tokens", "peak_cache_tokens", "peak_kv_bytes", "n_keep"):
        assert whole.stats[key] == retired.stats[key], key
    assert whole.stats["retired_rows"] == 0


def test_dynts_scores_of_the_rows_left_are_the_whole_batchs(qwen2):
    torch.manual_seed(1)
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size).eval()
    # forwards of 16 rows or more, as by default: their rows' hidden states are the whole batch's, bit for bit
    whole, retired = _pair(qwen2, "dynts", predictor=predictor, rows=40, min_rows=16)
    assert retired.stats["retired_rows"] >= 10 and torch.equal(whole.sequences, retired.sequences)
    # the cache holds the rows still running at the end, in batch order, with the whole batch's slots and scores
    a, b, n = whole.cache, retired.cache, whole.cache.length
    assert b.batch_rows == a.batch_rows - retired.stats["retired_rows"] and b.length == n
    rows = iter(range(a.batch_rows))
    for mine in range(b.batch_rows):
        theirs = next(r for r in rows if torch.equal(a.token_ids[r, :n], b.token_ids[mine, :n]))
        assert torch.equal(a.positions[theirs, :n], b.positions[mine, :n])
        torch.testing.assert_close(b.scores[mine, :n], a.scores[theirs, :n], rtol=0, atol=0, equal_nan=True)


def test_greedy_and_bfloat16(qwen2):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    whole, retired = _pair(model, "h2o", sampling={"do_sample": False})
    assert torch.equal(whole.sequences, retired.sequences)


def test_a_batch_of_one_and_a_compiled_decode():
    model = tiny_model("qwen2")
    ids, mask = padded_batch([6], seed=1)
    alone = dynts.generate(model, input_ids=ids, attention_mask=mask, method="window", budget=40, local_window=8,
                           max_new_tokens=10, do_sample=False, pad_token_id=0, retire_finished=True)
    assert alone.stats["retired_rows"] == 0
    with pytest.raises(ValueError, match="retire_finished"):
        dynts.generate(model, input_ids=ids, attention_mask=mask, method="window", budget=40, local_window=8, max_new_tokens=4,
                       pad_token_id=0, retire_finished=True, compile=True)


def test_a_static_cache_keeps_its_rows(qwen2):
    cache = dynts.build_cache(qwen2, dynts.make_evictor("window"), dynts.Budget(40, 4, 0.5), static=True, max_length=60)
    with pytest.raises(ValueError, match="static"):
        cache.batch_select_indices(torch.tensor([0]))


def test_bad_settings_name_themselves():
    for options, name in (({}, "EOS"), ({"check_every": 0}, "check_every"), ({"min_rows": 0}, "min_rows")):
        with pytest.raises(ValueError, match=name):
            RowRetirement([] if name == "EOS" else [2], **options)
