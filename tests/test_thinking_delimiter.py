"""The thinking delimiter: found by token sequence (a tokenizer that splits ``</think>``), across
forward boundaries, per row, and exactly as before for one-token delimiters."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

import dynts
from conftest import padded_batch
from dynts.evictors import Segment
from dynts.thinking import DelimiterMatcher, think_end_ids

pytestmark = pytest.mark.usefixtures("one_thread")

CHARS = ["<pad>", "<bos>", "<eos>", "<unk>"] + list("</thinkabcdefgjlmopqrsuvwxyz0123456789 >")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One character = one token: ``</think>`` is 8 tokens."""
    core = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(CHARS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word = one token, ``</think>`` included."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>", "</think>"] + [f"w{i}" for i in range(5, 40)]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left")


def test_think_end_ids_single_and_split():
    assert think_end_ids(word_tokenizer(), "</think>") == (4,)
    chars = char_tokenizer()
    ids = think_end_ids(chars, "</think>")
    assert len(ids) == 8 and chars.decode(list(ids)) == "</think>"
    assert think_end_ids(None, 7) == (7,) and think_end_ids(None, [5, 6]) == (5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert think_end_ids(None, None) is None  # explicitly off: no warning
    with pytest.raises(ValueError, match="think_end"):
        think_end_ids(None, [-1])


@pytest.mark.parametrize("tokenizer, think_end", [(None, "</think>"), ("word", "</nothink>"), ("word", "")])
def test_detection_off_warns(tokenizer, think_end):
    tok = word_tokenizer() if tokenizer else None
    with pytest.warns(UserWarning, match="answer detection is off"):
        assert think_end_ids(tok, think_end) is None


def test_generate_without_tokenizer_warns(qwen2):
    ids, mask = padded_batch([5])
    with pytest.warns(UserWarning, match="answer detection is off"):
        dynts.generate(qwen2, input_ids=ids, attention_mask=mask, method="full", max_new_tokens=2, pad_token_id=0)


def reference_segments(stream: list[int], valid: list[bool], delimiter: list[int]) -> list[int]:
    """Thinking until the first complete delimiter among the real tokens; the delimiter on is answer."""
    real = [i for i, v in enumerate(valid) if v]
    tokens = [stream[i] for i in real]
    m, start = len(delimiter), None
    for k in range(len(tokens) - m + 1):
        if tokens[k : k + m] == delimiter:
            start = real[k]
            break
    return [
        int(Segment.PAD) if not v else int(Segment.ANSWER if start is not None and i >= start else Segment.THINKING)
        for i, v in enumerate(valid)
    ]


def run_stream(delimiter, streams, valid, chunks, evictor="full", budget=None):
    """Feed ``streams`` ``[b, T]`` (after a 3-token prompt) to a cache in forwards of ``chunks`` tokens."""
    b = streams.shape[0]
    cache = dynts.BoundedCache(1, dynts.make_evictor(evictor), budget, think_end_token_id=delimiter)
    prompt = torch.full((b, 3), 9)
    cache.begin_forward(prompt, None, b, 3, torch.device("cpu"))
    cache.end_forward()
    t = 0
    for q in chunks:
        ids, ok = streams[:, t : t + q], valid[:, t : t + q]
        mask = torch.cat([torch.ones(b, cache.seen), ok.long()], 1)
        cache.begin_forward(ids, mask, b, ids.shape[1], torch.device("cpu"))
        cache.end_forward()
        t += q
    return cache


@settings(max_examples=60, deadline=None)
@given(
    delimiter=st.lists(st.integers(5, 7), min_size=1, max_size=4),
    data=st.data(),
)
def test_segments_match_reference_across_forwards(delimiter, data):
    """Random streams over a 3-letter alphabet (many partial and overlapping matches), 3 rows, random
    forward sizes and padding inside multi-token forwards."""
    b, length = 3, data.draw(st.integers(1, 24))
    streams = torch.tensor(data.draw(st.lists(st.lists(st.integers(5, 7), min_size=length, max_size=length), min_size=b, max_size=b)))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=b, max_size=b)))
    valid |= torch.rand(b, length) < 0.6
    chunks, left = [], length
    while left:
        chunks.append(data.draw(st.integers(1, left)))
        left -= chunks[-1]
    cache = run_stream(delimiter, streams, valid, chunks)
    got = cache.segments[:, 3 : 3 + length].tolist()
    for r in range(b):
        assert got[r] == reference_segments(streams[r].tolist(), valid[r].tolist(), delimiter)


def test_one_token_delimiter_is_unchanged():
    """The single-id path labels exactly as the former ``input_ids == id`` cumulative rule."""
    g = torch.Generator().manual_seed(0)
    streams = torch.randint(5, 12, (4, 30), generator=g)
    cache = run_stream(7, streams, torch.ones_like(streams, dtype=torch.bool), [1] * 10 + [5, 3, 7, 1, 4])
    closes = (streams == 7).long().cumsum(1) > 0
    expected = torch.where(closes, int(Segment.ANSWER), int(Segment.THINKING))
    assert torch.equal(cache.segments[:, 3:33], expected)
    assert cache.in_answer.tolist() == closes[:, -1].tolist()


def test_split_delimiter_survives_eviction_between_its_tokens():
    """Decode one token per forward under a window evictor whose events fire inside the delimiter."""
    delimiter = [5, 6, 7]
    stream = torch.tensor([[8, 9, 8, 9, 8, 9, 8, 5, 6, 7, 9, 8, 9, 8]])
    cache = run_stream(delimiter, stream, torch.ones_like(stream, dtype=torch.bool), [1] * 14, "window",
                       dynts.Budget(9, 3, 0.5))
    assert cache.stats.evictions >= 2
    kept = cache.positions[0, : cache.length].tolist()
    segments = cache.segments[0, : cache.length].tolist()
    start = 3 + 7  # absolute position of the delimiter's first token
    for p, s in zip(kept, segments):
        if p >= 3:
            assert s == (Segment.ANSWER if p >= start else Segment.THINKING), (p, s)


class ForceText(LogitsProcessor):
    """Force ``ids`` at generated steps ``at, at + 1, ...``."""

    def __init__(self, prompt_length: int, at: int, ids: list[int]):
        self.prompt_length, self.at, self.ids = prompt_length, at, ids

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length - self.at
        if 0 <= step < len(self.ids):
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.ids[step]] = 0.0
        return scores


def test_generate_detects_a_split_delimiter_end_to_end():
    from conftest import tiny_model

    tok = char_tokenizer()
    model = tiny_model("llama")
    delimiter = list(think_end_ids(tok, "</think>"))
    ids, mask = padded_batch([6, 4], vocab=len(CHARS), seed=3)
    ids = ids.clamp(max=len(CHARS) - 1)
    force = ForceText(ids.shape[1], 5, delimiter)
    result = dynts.generate(
        model, tok, input_ids=ids, attention_mask=mask, method="window", budget=24, local_window=10,
        max_new_tokens=30, think_end="</think>", logits_processor=LogitsProcessorList([force]),
        pad_token_id=0, eos_token_id=None,
    )
    cache = result.cache
    assert result.stats["evictions"] >= 1 and bool(cache.in_answer.all())
    for row in range(2):
        n = cache.length
        positions, segments = cache.positions[row, :n], cache.segments[row, :n]
        generated = positions >= ids.shape[1]
        answer = positions >= ids.shape[1] + 5
        assert torch.equal(segments[generated & answer], torch.full_like(segments[generated & answer], int(Segment.ANSWER)))
        assert bool((segments[generated & ~answer] == Segment.THINKING).all())


def test_matcher_rejects_empty():
    with pytest.raises(ValueError, match="delimiter"):
        DelimiterMatcher([])


@settings(max_examples=60, deadline=None)
@given(
    delimiter=st.lists(st.integers(5, 7), min_size=1, max_size=4),
    stream=st.lists(st.integers(4, 8), min_size=1, max_size=30),
)
def test_host_step_follows_scan(delimiter, stream):
    """``step`` (one request's host state, used by serving) closes on the same tokens and keeps the same
    state as ``scan`` over the stream."""
    matcher = DelimiterMatcher(delimiter)
    ids = torch.tensor([stream])
    closes, final = matcher.scan(torch.zeros(1, dtype=torch.long), ids, torch.ones_like(ids, dtype=torch.bool))
    state, host = 0, []
    for tok in stream:
        done, state = matcher.step(state, tok)
        host.append(done)
    assert host == closes[0].tolist() and state == int(final[0])
