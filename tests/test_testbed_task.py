"""The synthetic testbed task: generator, checker, critical positions, tokenizer, oracle evictor."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data_pipeline.testbed import task
from data_pipeline.testbed.tokenizer import build_tokenizer
from pipeline_utils import word_rows_token_info


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_generator_is_deterministic():
    assert task.make_problem(7) == task.make_problem(7)
    assert task.problem_set("test", 5) == task.problem_set("test", 5)
    assert task.make_problem(7) != task.make_problem(8)
    assert task.make_drill("x") == task.make_drill("x")


def test_train_namespace_is_reserved():
    with pytest.raises(ValueError):
        task.problem_set("train", 3)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**9), lo=st.integers(30, 400), extra=st.integers(0, 600))
def test_problem_grammar(seed, lo, extra):
    p = task.make_problem(seed, min_think=lo, max_think=lo + extra)
    w = p.tokens
    assert len(w) == len(p.roles)
    assert w[: task.QUESTION_TOKENS] == tuple(task.question_tokens(p.operands, p.asked))
    assert lo <= p.thinking_length <= lo + extra or p.thinking_length == len(p.steps) * task.STEP_TOKENS
    assert w[-4:] == (task.END_THINK, f"r{p.asked}=", str(p.answer), task.EOS)
    assert 1 <= p.asked <= len(p.steps) <= task.MAX_KEY
    # Steps appear in order r1, r2, ...; each computes its value from the question's operands.
    steps = task.parse_steps(p.text)
    assert [s[5] for s in steps] == list(range(1, len(p.steps) + 1))
    for x, xv, op, y, yv, _k, v in steps:
        assert xv == p.operands[task.VARIABLES.index(x)] and yv == p.operands[task.VARIABLES.index(y)]
        assert v == task.OPS[op](xv, yv)
    # Filler gaps stay capped at 40 words (the default) when the length allows it.
    gap = 0
    for t in task.thinking_words(p.text):
        gap = gap + 1 if t in task.FILLER else 0
        assert gap <= 40 or p.thinking_length > (len(p.steps) + 1) * 40 + len(p.steps) * task.STEP_TOKENS
    # The answer value appears once in the thinking, right after the asked key.
    (c,) = p.critical_positions
    assert w[c - 1] == f"r{p.asked}=" and w[c] == str(p.answer)
    assert task.find_critical_positions(w) == [c]
    assert p.roles[c] == task.ROLE_STEP_VALUE and p.roles[-2] == task.ROLE_ANSWER_VALUE


def test_lengths_and_early_keys():
    probs = task.problem_set("stats", 400)
    lengths = [p.thinking_length for p in probs]
    assert 150 <= min(lengths) and max(lengths) <= 900
    early = sum(p.asked <= 3 for p in probs) / len(probs)
    assert 0.75 < early < 0.95
    long = task.make_problem(1, min_think=3000, max_think=3000)
    assert long.thinking_length == 3000 and len(long.steps) == task.MAX_KEY


def test_check_answer_exact():
    p = task.make_problem(3)
    assert task.check_answer(p, p.text)
    assert task.check_answer(p.question, p.text)
    assert task.check_answer(p.prompt, p.text)
    generated = p.trace + f" </think> r{p.asked}= {p.answer}"  # continuation only, no <eos>
    assert task.check_answer(p, generated)
    wrong = (p.answer + 1) % 10
    assert not task.check_answer(p, p.trace + f" </think> r{p.asked}= {wrong} <eos>")
    other = p.asked % len(p.steps) + 1
    assert not task.check_answer(p, p.trace + f" </think> r{other}= {p.answer} <eos>") or other == p.asked
    assert not task.check_answer(p, p.trace)  # no answer
    assert not task.check_answer(p, p.trace + " </think> hmm")  # unparsable
    # The answer only needs the problem: without any thinking the reference answer counts.
    assert task.check_answer(p, f"</think> r{p.asked}= {p.answer} <eos>")
    # With only the question and no step for the asked key, nothing can be right.
    assert not task.check_answer(p.question, f"</think> r{p.asked}= {p.answer} <eos>")


def test_check_answer_uses_the_generated_step():
    """A model may choose different steps than the reference: the truth is its own step's value."""
    p = task.make_problem(11, min_think=150, max_think=200)
    ops = dict(zip(task.VARIABLES, p.operands))
    v = task.OPS["plus"](ops["a"], ops["b"])
    own = f"hmm a {ops['a']} plus b {ops['b']} gives r1= {v} ; ok"
    q = p.question.rsplit(" ", 1)[0] + " r1"
    assert task.check_answer(q, own + f" </think> r1= {v} <eos>")
    assert not task.check_answer(q, own + f" </think> r1= {(v + 1) % 10} <eos>")
    # A step with a miscopied operand: the right answer is still the true value.
    bad = f"a {(ops['a'] + 1) % 10} plus b {ops['b']} gives r1= {(v + 1) % 10} ;"
    assert not task.check_answer(q, bad + f" </think> r1= {(v + 1) % 10} <eos>")
    assert task.check_answer(q, bad + f" </think> r1= {v} <eos>")


def test_parsers():
    assert task.parse_answer("x y </think> r3= 7 <eos>") == (3, 7)
    assert task.parse_answer("</think> r3=") is None
    assert task.parse_answer("</think> r3 7") is None
    assert task.parse_answer("no end") is None
    assert task.parse_question("a 1 b 2 c 3 d 4 e 5 find r9") == ((1, 2, 3, 4, 5), 9)
    assert task.parse_question("<bos> a 1 b 2 c 3 d 4 e 5 find r9 <think>") == ((1, 2, 3, 4, 5), 9)
    assert task.parse_question("a 1 b 2") is None


def test_critical_positions_in_generated_tokens():
    p = task.make_problem(5)
    w = list(p.tokens[: task.QUESTION_TOKENS]) + ["hmm"] + list(p.tokens[task.QUESTION_TOKENS :])
    assert task.find_critical_positions(w) == [p.critical_positions[0] + 1]
    assert task.find_critical_positions(w, asked=p.asked) == [p.critical_positions[0] + 1]
    # Keys after </think> (the answer) do not count; unfinished traces still work.
    assert task.find_critical_positions(w[: p.critical_positions[0] + 1]) == []
    assert task.find_critical_positions(w[: p.critical_positions[0] + 2]) == [p.critical_positions[0] + 1]


def test_tokenizer_round_trip(tok):
    assert len(tok) == len(task.VOCAB) < 100
    for seed in range(5):
        p = task.make_problem(seed)
        ids = tok(p.text)["input_ids"]
        assert ids == [task.VOCAB.index(t) for t in p.tokens]
        assert tok.decode(ids) == p.text
    assert tok.pad_token == "<pad>" and tok.eos_token == "<eos>" and tok.bos_token == "<bos>"
    assert tok.padding_side == "left"
    text = tok.decode(tok(task.make_problem(0).text)["input_ids"], skip_special_tokens=True)
    assert "<bos>" not in text and "<think>" in text and "</think>" in text and ";" in text


def test_chat_template(tok):
    p = task.make_problem(2)
    chat = [{"role": "user", "content": p.question}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == p.prompt
    ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == [task.VOCAB.index(t) for t in p.tokens[: task.QUESTION_TOKENS]]
    full = chat + [{"role": "assistant", "content": p.text.split(" <think> ", 1)[1].removesuffix(" <eos>")}]
    assert tok.apply_chat_template(full, tokenize=False) == p.text


def test_tokenizer_save_load(tmp_path, tok):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    p = task.make_problem(4)
    assert again(p.text)["input_ids"] == tok(p.text)["input_ids"]
    assert again.padding_side == "left" and again.chat_template == tok.chat_template


def test_oracle_keeps_question_critical_and_recent():
    from data_pipeline.testbed.oracle import OracleEvictor
    from dynts.evictors import EVICTORS, make_evictor

    assert EVICTORS["testbed-oracle"] is OracleEvictor
    probs = [task.make_problem(s, min_think=200, max_think=200) for s in (1, 2)]
    rows = [list(p.tokens[: p.tokens.index(task.END_THINK)]) for p in probs]
    rows[1] = rows[1][:-5]  # ragged batch: row 1 is left-padded
    info = word_rows_token_info(rows, n_keep=40)
    kept = make_evictor("testbed-oracle")(info)
    assert kept.shape == (2, 40)
    n = info.shape[1]
    for b, (p, r) in enumerate(zip(probs, rows)):
        off = n - len(r)
        k = set(kept[b].tolist())
        assert set(range(off, off + task.QUESTION_TOKENS)) <= k  # question
        c = p.critical_positions[0]
        assert {off + c - 1, off + c} <= k  # asked key and its value
        recent = 40 - task.QUESTION_TOKENS - 2
        assert set(range(n - recent, n)) <= k
    # The asked key can also be given per row.
    keys = [task.VOCAB.index(f"r{p.asked}=") for p in probs]
    assert torch.equal(make_evictor("testbed-oracle", key_ids=keys)(info), kept)
    with pytest.raises(ValueError):
        make_evictor("testbed-oracle", key_ids=[0])


def test_drill_shape():
    w, roles = task.make_drill(random.Random(0).random())
    assert w[-4] == task.END_THINK and roles[-2] == task.ROLE_ANSWER_VALUE
    key = w[-3]
    assert w[w.index(key, task.QUESTION_TOKENS) + 1] == w[-2]


def test_drill_operand_recalls():
    """``operand_share`` writes recalls as chain operands ``rK v`` that copy the value written after
    ``rK=``; at 0 the drill is the one it always was."""
    assert task.make_drill("d", operand_share=0.0) == task.make_drill("d")
    found = 0
    for seed in range(20):
        w, roles = task.make_drill(f"d{seed}", operand_share=1.0)
        for i, t in enumerate(w):
            if i >= task.QUESTION_TOKENS and t in task.QUERY_KEYS:  # a chain operand: its value is the one written after rK=
                assert roles[i + 1] == task.ROLE_OPERAND
                assert w[i + 1] == w[w.index(f"{t}=") + 1]
                found += 1
        assert f"{w[-3]}" in w[: -3]  # the answer still reads a written key
    assert found > 20
    with pytest.raises(ValueError, match="operand_share"):
        task.make_drill("d", operand_share=1.5)
