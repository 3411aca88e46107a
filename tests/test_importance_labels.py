"""The labels beyond the answer (future, golden, counterfactual): each puts its weight where a constructed attention
pattern says it should, the chunked computation equals the full ``T x T`` one, padded batches equal rows alone, bf16."""

from __future__ import annotations

import pytest
import torch

import dynts.attention as attention
from conftest import tiny_model
from test_importance import eager_attention
from dynts.importance import (
    LABELS, CounterfactualSettings, FutureSettings, GoldenSettings, future_importance, golden_importance,
    sequence_importance, token_importance,
)
from dynts.importance.golden import event_positions

pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------- a constructed attention pattern
T, ANSWER, PROMPT = 40, 34, 4
SINK, STRONG_ONCE, ANSWER_READ, BROAD = 0, 8, 12, 5  # the sink; read hard by one far row; by the answer; by every row


def pattern() -> torch.Tensor:
    """``[T, T]`` attention: every row pays the sink 0.4 and its previous token 0.3; every thinking row pays
    ``BROAD`` 0.05; row 30 pays ``STRONG_ONCE`` 0.25; the answer rows pay ``ANSWER_READ`` 0.25; the rest spread."""
    p = torch.zeros(T, T)
    for i in range(1, T):
        p[i, SINK] = 0.4
        p[i, i - 1] += 0.3
        if PROMPT <= i < ANSWER and i - 1 != BROAD:
            p[i, BROAD] += 0.05
        if i == 30:
            p[i, STRONG_ONCE] += 0.25
        if i >= ANSWER:
            p[i, ANSWER_READ] += 0.25
        p[i, : i + 1] += (1.0 - p[i].sum()) / (i + 1)
    p[0, 0] = 1.0
    return p


@pytest.fixture
def toy(monkeypatch):
    """A tiny model whose recorded attention rows are :func:`pattern` (every layer and head); returns
    ``(model, ids)``. The rows a call computes are read from the causal mask it gets."""
    table = pattern()
    calls = []

    def rows(query, key, mask, scaling):
        b, h, q, _ = query.shape
        n = key.shape[2]
        index = mask[0, 0].sum(-1) - 1 if mask is not None else torch.arange(n - q, n)
        calls.append(q)
        return table[index][:, :n][None, None].expand(b, h, q, n).clone()

    monkeypatch.setattr(attention, "attention_rows", rows)
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(0))
    return model, ids, calls


def thinking_top(scores: torch.Tensor, k: int = 1) -> set[int]:
    return {PROMPT + int(i) for i in torch.topk(scores[0, PROMPT:ANSWER], k).indices}


def test_each_label_weights_the_token_the_pattern_says(toy):
    model, ids, _ = toy
    assert thinking_top(token_importance(model, ids, [ANSWER], label="answer").scores) == {ANSWER_READ}
    small = dict(window=2, chunk_rows=7)
    future = future_importance(model, ids, [ANSWER], settings=FutureSettings(**small)).scores
    assert thinking_top(future) == {STRONG_ONCE}  # the strongest single far read (max)
    rows = future_importance(model, ids, [ANSWER], settings=FutureSettings(**small, normalize="row")).scores
    assert thinking_top(rows) == {STRONG_ONCE}
    assert future[0, ANSWER:].eq(0).all() and future[0, SINK] == 0  # the sink and the answer are not scored
    summed = future_importance(model, ids, [ANSWER], settings=FutureSettings(**small, normalize="none", reduce="sum")).scores
    assert thinking_top(summed) == {BROAD}  # many small reads add up
    with_sink = future_importance(model, ids, [ANSWER], settings=FutureSettings(**small, normalize="none", reduce="sum", sinks=0))
    assert int(with_sink.scores[0].argmax()) == SINK and summed[0].argmax() != SINK
    golden = GoldenSettings(budget=14, local_window=2, retention=0.4, future=FutureSettings(**small))
    scores = golden_importance(model, ids, [ANSWER], [PROMPT], settings=golden).scores
    # B = 14, n_keep = 9: events at 14, 19, 24, 29 and the answer's 34. The oracle keeps what the future reads:
    # the far read at every event before row 30 reads it (at least 4 of 5), the answer's read to the end (5 of 5);
    # of the candidates at the first event (4 .. 11) the two the future reads keep their slots; the third slot
    # goes to a token no one reads, which the next event evicts
    assert abs(float(scores[0, ANSWER_READ]) - 1.0) < 2e-3 and float(scores[0, STRONG_ONCE]) > 0.8 - 1e-6
    early = scores[0, PROMPT:12]
    assert {PROMPT + int(i) for i in torch.topk(early, 2).indices} == {STRONG_ONCE, BROAD}
    assert early.sort(descending=True).values[2] < 0.51
    assert scores[0, :PROMPT].ge(1.0).all()  # the question is always kept


def test_rows_are_computed_in_chunks(toy):
    model, ids, calls = toy
    future_importance(model, ids, [ANSWER], settings=FutureSettings(window=2, chunk_rows=7))
    assert calls and max(calls) <= 7  # never all T rows at once


def test_golden_events_follow_the_shared_budget():
    from dynts import Budget

    cache = Budget(20, 4, 0.4)  # n_keep = 4 + floor(0.4 * 12) + 4 = 12: an event every 8 tokens once 20 are stored
    assert event_positions(cache, 4, 50) == [20, 28, 36, 44, 50]
    assert cache.events(4, 46) == 4  # the budget's own count of real events (the last one is the answer's)


# --------------------------------------------------------------------------- against the full T x T computation
def reference_future(probs: torch.Tensor, rows: torch.Tensor, settings: FutureSettings) -> torch.Tensor:
    """The future label's equation over full matrices ``probs [L, b, h, T, T]`` and counted ``rows [b, T]``."""
    length = probs.shape[-1]
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    far = (j < i - settings.window) & (j >= settings.sinks)
    reads = probs * far * rows[None, :, None, :, None]
    if settings.normalize == "row":
        reads = reads / reads.sum(-1, keepdim=True).clamp(min=1e-38)
    reduced = reads.sum(3) if settings.reduce == "sum" else reads.amax(3)
    return reduced.sum(dim=(0, 2))  # [b, T]


@pytest.mark.parametrize("normalize,reduce", [("row", "max"), ("none", "sum"), ("row", "sum"), ("none", "max")])
def test_future_chunked_equals_the_full_matrices(normalize, reduce):
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(3))
    start = 80
    settings = FutureSettings(window=8, sinks=1, normalize=normalize, reduce=reduce, chunk_rows=5)
    got = future_importance(model, ids, [start], settings=settings).scores
    rows = (torch.arange(96) < start).float()[None]
    expected = reference_future(eager_attention(model, ids), rows, settings)
    expected[:, start:] = 0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    whole = future_importance(model, ids, [start], settings=FutureSettings(**{**settings.__dict__, "chunk_rows": 4096}))
    torch.testing.assert_close(got, whole.scores, atol=1e-6, rtol=1e-6)


def reference_golden(model, ids, start: int, prompt: int, settings: GoldenSettings) -> torch.Tensor:
    """Golden eviction replayed naively over the full matrices: at each event the future is recomputed from
    the rows after it."""
    probs = eager_attention(model, ids)
    length = ids.shape[1]
    cache = settings.cache(prompt, start)
    events = event_positions(cache, prompt, start)
    keep = cache.n_keep(prompt) - prompt - settings.local_window
    first_rows = (torch.arange(length) >= events[0]).float()[None]
    first = reference_future(probs, first_rows, settings.future)[0]
    cached, faced, kept = set(), torch.zeros(length), torch.zeros(length)
    previous = prompt
    for position in events:
        cached |= set(range(previous, position))
        previous = position
        candidates = sorted(j for j in cached if j < position - settings.local_window)
        future = reference_future(probs, (torch.arange(length) >= position).float()[None], settings.future)[0]
        order = sorted(candidates, key=lambda j: -float(future[j]))
        for j in candidates:
            faced[j] += 1
        for j in order[:keep]:
            kept[j] += 1
        cached -= set(order[keep:])
    scores = kept / faced.clamp(min=1) + 1e-3 * first / first.max()
    scores[:prompt] = 1 + 1e-3 * first[:prompt] / first.max()
    scores[start:] = 0
    return scores


@pytest.mark.parametrize("reduce", ["max", "sum"])
def test_golden_chunked_equals_a_naive_replay(reduce):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 120), generator=torch.Generator().manual_seed(4))
    settings = GoldenSettings(budget=40, local_window=6, future=FutureSettings(window=4, reduce=reduce, chunk_rows=9))
    got = golden_importance(model, ids, [100], [10], settings=settings).scores[0]
    torch.testing.assert_close(got, reference_golden(model, ids, 100, 10, settings), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- batches, dtypes, the counterfactual
@pytest.mark.parametrize("label", LABELS)
def test_left_padded_batch_equals_one_by_one(label):
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (60, 90, 75)]
    starts, prompts = [50, 80, 66], [6, 8, 7]
    settings = {"future": {"window": 4, "chunk_rows": 16}, "golden": {"budget": 30, "local_window": 4},
                "counterfactual": {"window": 4, "copies": 16}}.get(label)
    batched = sequence_importance(model, seqs, starts, label=label, prompt_lengths=prompts, settings=settings,
                                  max_batch_tokens=10_000, return_hidden_states=True)
    for seq, start, prompt, got in zip(seqs, starts, prompts, batched):
        alone = token_importance(model, torch.tensor([seq]), [start], label=label, prompt_length=[prompt],
                                 settings=settings, return_hidden_states=True)
        assert got.scores.shape == (len(seq),) and got.scores.dtype == torch.float32
        assert got.scores[start:].eq(0).all() and got.scores[:start].gt(0).any()
        torch.testing.assert_close(got.scores, alone.scores[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.hidden_states, alone.hidden_states[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("label", LABELS)
def test_bfloat16_models_give_float32_scores_like_float32(label):
    ids = torch.randint(3, 128, (2, 48), generator=torch.Generator().manual_seed(6))
    settings = {"future": {"window": 4}, "golden": {"budget": 24, "local_window": 4},
                "counterfactual": {"window": 4}}.get(label)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model("qwen2", dtype=dtype)
        out[dtype] = token_importance(model, ids, [40, 40], label=label, prompt_length=[4, 4], settings=settings,
                                      return_hidden_states=True)
    low = out[torch.bfloat16]
    assert low.scores.shape == (2, 48) and low.scores.dtype == torch.float32 and low.scores.isfinite().all()
    assert low.hidden_states.dtype == torch.bfloat16 and low.hidden_states.shape[:2] == (2, 48)
    if label != "counterfactual":  # loss differences of a random model are bf16 noise; attention is not
        top = torch.topk(out[torch.float32].scores[:, 4:40], 3).indices
        assert (low.scores[:, 4:40].gather(1, top) > 0).all()
        assert torch.corrcoef(torch.stack([low.scores[:, 4:40].flatten(), out[torch.float32].scores[:, 4:40].flatten()]))[0, 1] > 0.9


def test_counterfactual_copies_do_not_change_it():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 50), generator=torch.Generator().manual_seed(7))
    one = token_importance(model, ids, [44], label="counterfactual", settings={"window": 3, "copies": 1}).scores
    many = token_importance(model, ids, [44], label="counterfactual", settings={"window": 3, "copies": 13}).scores
    torch.testing.assert_close(one, many, atol=1e-5, rtol=1e-4)
    assert one[0, 44:].eq(0).all() and one.ge(0).all()


def test_counterfactual_finds_the_value_the_copy_lrm_copies():
    """The shipped copy LRM answers by copying one value token hundreds of tokens back: evicting it (and
    nothing else) wrecks the answer."""
    import dynts
    from data_pipeline.testbed import task

    model, tokenizer = dynts.load("testbed", dtype="float32", device="cpu")
    problem = task.problem_set("dev", 1, max_think=200)[0]
    ids = tokenizer(problem.text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    start = task.words(problem.text).index(task.END_THINK)
    scores = token_importance(model, ids, [start], label="counterfactual", prompt_length=[task.QUESTION_TOKENS]).scores[0]
    assert int(scores.argmax()) == problem.critical_positions[0]


def test_bad_settings_and_inputs_raise_clear_errors():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 16))
    with pytest.raises(ValueError, match="label="):
        token_importance(model, ids, [10], label="attention")
    with pytest.raises(ValueError, match="prompt_length"):
        token_importance(model, ids, [10], label="golden")
    with pytest.raises(ValueError, match="normalize="):
        FutureSettings(normalize="head")
    with pytest.raises(ValueError, match="reduce="):
        FutureSettings(reduce="mean")
    with pytest.raises(ValueError, match="budget_fraction="):
        GoldenSettings(budget_fraction=0.0)
    with pytest.raises(ValueError, match="copies="):
        CounterfactualSettings(copies=0)
    with pytest.raises(ValueError, match="takes no settings"):
        token_importance(model, ids, [10], label="answer", settings={"window": 3})
    with pytest.raises(ValueError, match="prompt_length"):
        golden_importance(model, ids, [10], [12])
