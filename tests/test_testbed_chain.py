"""The chain family of the testbed task (thinking reads thinking): generator, parsing, grading,
critical positions, namespaces, the oracle, training rows; and the copy family left unchanged."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from data_pipeline.testbed import task
from pipeline_utils import word_rows_token_info

# sha256 over (name, operands, asked, steps, tokens, roles, critical_positions) of the problems below,
# computed before the families existed (commit 99054bd): the copy family must draw them unchanged.
COPY_DIGEST = "da41bc3433adbe7aff244c8e3f93066f4801b14d01e4fed4ef230791fc74c80c"


def _copy_digest() -> str:
    h = hashlib.sha256()
    probs = task.problem_set("test", 20) + task.problem_set("dev", 20, min_think=30, max_think=120)
    probs += task.problem_set("gate", 10, min_think=150, max_think=700)
    probs += [task.make_problem(f"train:0:{i}:3", min_think=150, max_think=700, early_prob=0.3, slip="times-high") for i in range(10)]
    for p in probs:
        h.update(repr((p.name, p.operands, p.asked, p.steps, p.tokens, p.roles, p.critical_positions)).encode())
    return h.hexdigest()


def test_copy_family_unchanged():
    assert _copy_digest() == COPY_DIGEST
    assert task.problem_set("test", 5) == task.problem_set("test", 5, family="copy")
    assert all(p.family == "copy" for p in task.problem_set("dev", 3))


def _chain(n: int = 60, name: str = "dev", **kw) -> list[task.Problem]:
    return task.problem_set(name, n, min_think=kw.pop("min_think", 150), max_think=kw.pop("max_think", 700), family="chain", **kw)


def test_chain_problems_parse_and_grade():
    probs = _chain()
    assert task.make_problem("x", family="chain") == task.make_problem("x", family="chain")  # deterministic
    reads = 0
    for p in probs:
        assert p.family == "chain"
        w = p.tokens
        assert len(w) == len(p.roles) and w[: task.QUESTION_TOKENS] == tuple(task.question_tokens(p.operands, p.asked))
        assert task.parse_question(p.question) == (p.operands, p.asked)
        assert w[-4:] == (task.END_THINK, f"r{p.asked}=", str(p.answer), task.EOS)
        assert -(-len(p.steps) // 2) <= p.asked <= len(p.steps)  # the asked key lies in the second half
        steps = task.parse_steps(p.text, "chain")
        assert [s[5] for s in steps] == list(range(1, len(p.steps) + 1))
        written: dict[int, int] = {}
        for x, xv, op, y, yv, k, v in steps:
            for name, val in ((x, xv), (y, yv)):
                if name in task.VARIABLES:
                    assert val == p.operands[task.VARIABLES.index(name)]
                else:  # every written operand value equals the referenced, earlier result
                    reads += 1
                    assert int(name[1:]) in written and val == written[int(name[1:])]
            assert v == task.OPS[op](xv, yv)
            written[k] = v
        assert all(task.operand_copies(p.text, p.operands, "chain"))
        # Graded right as a Problem and as question text read as chain; a wrong value is wrong.
        assert task.check_answer(p, p.text) and task.check_answer(p.question, p.text, family="chain")
        wrong = p.text.replace(f"</think> r{p.asked}= {p.answer}", f"</think> r{p.asked}= {(p.answer + 1) % 10}")
        assert not task.check_answer(p, wrong)
        # The copy parser sees only the steps that read no result.
        assert len(task.parse_steps(p.text)) == sum(s.x in task.VARIABLES and s.y in task.VARIABLES for s in p.steps)
        # Step roles are the copy family's: STEP_TOKENS and the key offset hold.
        for i, t in enumerate(w):
            if t in task.RESULT_KEYS and i < w.index(task.END_THINK):
                assert w[i + 2] == task.SEP and w[i - task.KEY_INDEX + 5] == task.GIVES
    assert reads > len(probs)  # chains exist: on average more than one read per problem


def test_chain_check_answer_resolves_the_trace_it_reads():
    q = "a 1 b 2 c 3 d 4 e 5 find r3"
    good = "<think> a 1 plus b 2 gives r1= 3 ; c 3 times d 4 gives r2= 2 ; r1 3 plus r2 2 gives r3= 5 ; </think> r3= 5"
    assert task.expected_answer(q, good, family="chain") == 5 and task.check_answer(q, good, family="chain")
    # A miscopied operand makes the asked step's true value differ from what it wrote.
    bad = good.replace("r1 3 plus r2 2 gives r3= 5", "r1 4 plus r2 2 gives r3= 6").replace("r3= 5", "r3= 6")
    assert task.expected_answer(q, bad, family="chain") == 5 and not task.check_answer(q, bad, family="chain")
    assert task.operand_copies(bad, (1, 2, 3, 4, 5), "chain") == [True, True, True, True, False, True]
    # A wrong result upstream propagates: the true value of r3 uses r1's true value.
    slipped = good.replace("gives r1= 3", "gives r1= 4").replace("r1 3 plus", "r1 4 plus").replace("r3= 5", "r3= 6")
    assert all(task.operand_copies(slipped, (1, 2, 3, 4, 5), "chain"))
    assert not task.check_answer(q, slipped, family="chain")
    # Naming a result never written: no true value.
    assert task.expected_answer(q, "<think> r7 1 plus a 1 gives r3= 2 ; </think> r3= 2", family="chain") is None
    # The copy reading of the same text does not see the chain step.
    assert task.expected_answer(q, good) is None
    with pytest.raises(ValueError, match="contradicts"):
        task.check_answer(_chain(1)[0], good, family="copy")


def test_chain_critical_positions_are_the_answers_chain():
    for p in _chain(80):
        w = p.tokens
        keys = {w[c - 1] for c in p.critical_positions}
        assert w[p.critical_positions[-1] - 1] == f"r{p.asked}="  # the asked value is read last
        assert keys == {f"r{k}=" for k in task.dependency_closure(p.steps, p.asked)}
        for c in p.critical_positions:
            assert p.roles[c] == task.ROLE_STEP_VALUE
            step = p.steps[int(w[c - 1][1:-1]) - 1]
            for name in (step.x, step.y):  # each closure step's results are in the closure too
                if name not in task.VARIABLES:
                    assert f"{name}=" in keys
        assert task.find_critical_positions(w, family="chain") == list(p.critical_positions)
        assert task.find_critical_positions(w, asked=p.asked, family="chain") == list(p.critical_positions)
        # Every value a later step reads is among read_values; the copy family reads none.
        assert set(p.critical_positions[:-1]) <= set(task.read_values(w, "chain"))
    assert any(len(p.critical_positions) >= 3 for p in _chain(80))
    copy = task.make_problem(3)
    assert task.read_values(copy.tokens) == [] and task.read_values(copy.tokens, "chain") == []


def test_chain_namespaces_are_disjoint():
    sets = {name: _chain(40, name) for name in ("dev", "test", "val")}
    sets["gate"] = _chain(40, task.GATE)
    sets["ptest"] = _chain(40, task.PREDICTOR_TEST)
    from eval.harness.ledger import final_run

    with final_run("pytest", [], enabled=True, methods=["m"]):  # the final-only sets open only through the ledger (a tmp file here)
        sets["confirm"] = _chain(40, task.CONFIRM)
        sets["final"] = _chain(40, task.FINAL)
        copy_final = task.problem_set(task.FINAL, 40, min_think=150, max_think=700)  # each family its own stream
    sets["sealed"] = [task.make_problem(f"sealed:150-700:{i}", 150, 700, family="chain") for i in range(40)]  # retired: its seeds
    texts = {name: {p.text for p in probs} for name, probs in sets.items()}
    names = list(texts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not texts[a] & texts[b], (a, b)
    # ... and from the copy family's sets of the same names.
    for name in ("dev", "test"):
        assert not {p.text for p in task.problem_set(name, 40, min_think=150, max_think=700)} & texts[name]
    assert not {p.text for p in copy_final} & texts["final"]
    for space in (task.CONFIRM, task.FINAL):
        with pytest.raises(ValueError, match="final tables"):
            _chain(2, space)
    with pytest.raises(ValueError, match="retired"):
        _chain(2, task.SEALED)
    with pytest.raises(ValueError, match="reserved"):
        _chain(2, "train:x")
    # gate and confirm seed by the length range, as for copy
    assert _chain(3, task.GATE)[0] != task.problem_set(task.GATE, 3, min_think=150, max_think=800, family="chain")[0]


def test_bad_family_is_refused_clearly():
    from eval.harness.benchmarks import load_benchmark
    from trainers.testbed_lm import DataConfig

    for call in (lambda: task.make_problem(1, family="chains"), lambda: task.problem_set("dev", 2, family="chains"),
                 lambda: task.parse_steps("x", family="chains"), lambda: task.check_answer("q", "t", family="chains")):
        with pytest.raises(ValueError, match=r"family='chains'.*\['copy', 'chain'\]"):
            call()
    with pytest.raises(ValueError, match=r"testbed option family='chains'.*\['copy', 'chain'\]"):
        load_benchmark("testbed:n=2,family=chains")
    with pytest.raises(ValueError, match=r"data.family='x'"):
        DataConfig(family="x")
    from data_pipeline.testbed.oracle import OracleEvictor

    with pytest.raises(ValueError, match="family"):
        OracleEvictor(family="nope")
    with pytest.raises(ValueError, match="copy-only"):
        OracleEvictor(family="chain", keep_key=False)


def test_chain_benchmark_spec():
    from eval.harness.benchmarks import load_benchmark

    bench = load_benchmark("testbed:n=4,family=chain,set=dev,max_think=400")
    assert bench.name == "testbed:family=chain,max_think=400,n=4,set=dev"
    assert [ex.answer for ex in bench.examples] == _chain(4, max_think=400)
    for ex in bench.examples:
        assert bench.grader.grade(ex.answer, ex.answer.text).correct
        assert bench.grader.grade(ex.question, ex.answer.text).correct  # question text read as chain
    assert load_benchmark("testbed:n=3,family=copy").name == load_benchmark("testbed:n=3").name == "testbed:n=3"
    assert load_benchmark("testbed:n=3,family=copy").examples == load_benchmark("testbed:n=3").examples


def _simulate(evictor, tokens: list[str], budget: int) -> set[int]:
    """Token-by-token bounded cache over ``tokens``: positions still cached at the end."""
    from dynts.evictors import Segment, TokenInfo

    cached: list[int] = []
    for t in range(len(tokens)):
        cached.append(t)
        if len(cached) > budget:
            info = TokenInfo(
                positions=torch.tensor([cached]), token_ids=torch.tensor([[task.VOCAB.index(tokens[i]) for i in cached]]),
                segments=torch.tensor([[int(Segment.QUESTION if i < task.QUESTION_TOKENS else Segment.THINKING) for i in cached]]),
                n_keep=budget - 16, local_window=16, question_length=task.QUESTION_TOKENS)
            cached = [cached[j] for j in evictor(info)[0].tolist()]
    return set(cached)


def test_chain_oracle_keeps_the_answers_chain():
    from dynts.evictors import make_evictor

    probs = [p for p in _chain(30, max_think=500) if len(p.critical_positions) >= 2][:4]
    for p in probs:
        think = list(p.tokens[: p.tokens.index(task.END_THINK)])
        for keep_step, budget in ((False, 96), (True, 160)):
            kept = _simulate(make_evictor("testbed-oracle", family="chain", keep_step=keep_step), think, budget)
            assert set(p.critical_positions) <= kept, (p.name, keep_step)
            assert {c - 1 for c in p.critical_positions} <= kept  # the keys too
            assert set(range(task.QUESTION_TOKENS)) <= kept
    # Before the asked step is written every result is live; at the end only the closure (value oracle).
    p = probs[0]
    think = list(p.tokens[: p.tokens.index(task.END_THINK)])
    from data_pipeline.testbed.oracle import chain_critical_mask

    info = word_rows_token_info([think], n_keep=len(think) - 1)
    asked = torch.tensor([task.VOCAB.index(f"r{p.asked}=")])
    values = {i + 1 for i, t in enumerate(think) if t in task.RESULT_KEYS}
    protected = set(chain_critical_mask(info, asked).nonzero()[:, 1].tolist())
    assert values & protected == set(p.critical_positions)
    cut = think[: p.critical_positions[-1] - 3]  # the asked step not yet written
    info = word_rows_token_info([cut], n_keep=len(cut) - 1)
    protected = set(chain_critical_mask(info, asked).nonzero()[:, 1].tolist())
    assert {v for v in values if v < len(cut)} <= protected
    # The copy oracle is unchanged by the family field.
    copy = task.make_problem(5, min_think=200, max_think=200)
    rows = [list(copy.tokens[: copy.tokens.index(task.END_THINK)])]
    assert torch.equal(make_evictor("testbed-oracle")(word_rows_token_info(rows, 40)), make_evictor("testbed-oracle", family="copy")(word_rows_token_info(rows, 40)))


def test_chain_training_rows_and_masks():
    from trainers.eviction_masks import FORCED_SHAPES, MECHANISM_SHAPES, draw_kept_set
    from trainers.testbed_lm import LMConfig, TraceStream

    p = _chain(10)[3]
    reads = task.read_values(p.tokens, "chain")
    assert reads
    for shape in FORCED_SHAPES:
        kept, _w, _p = draw_kept_set(list(p.tokens), random.Random(0), (16, 32), 0.0, shape)
        assert all(kept[v] and kept[v - 1] for v in reads), shape  # read results survive every drawn shape
    for shape in MECHANISM_SHAPES:  # a simulated cache keeps only what its scores keep: nothing forced
        kept, _w, _p = draw_kept_set(list(p.tokens), random.Random(0), (16, 32), 0.0, shape)
        assert kept.nonzero().flatten().tolist() == list(range(task.QUESTION_TOKENS)), shape
    cfg = LMConfig.from_dict({"data": {"family": "chain", "evict_frac": 0.5, "drill_frac": 0.0, "short_steps": 0},
                              "stages": [{"steps": 10, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}]})
    batch = TraceStream(cfg, 0).batch(0)
    tokens = [task.VOCAB[i] for i in batch["input_ids"][0].tolist()]
    assert any(t in task.QUERY_KEYS for t in tokens[task.QUESTION_TOKENS :])  # chain operands in the rows


def test_chain_prm_labels_and_step_verifier():
    from eval.rescue.verifiers import testbed_step_verifier
    from trainers.testbed_prm import corrupt

    for p in _chain(20):
        toks, labels = corrupt(p, random.Random(p.name), 0.0, digit_labels=True)
        assert all(labels[i] == 1 for i, t in enumerate(toks) if t == task.SEP)
        toks, labels = corrupt(p, random.Random(p.name), 0.5)
        text = " ".join(toks)
        ops, copies = task.parse_steps(text, "chain"), task.operand_copies(text, p.operands, "chain")
        expect = [int(c1 and c2 and task.OPS[op](xv, yv) == v) for (_x, xv, op, _y, yv, _k, v), c1, c2 in zip(ops, copies[::2], copies[1::2])]
        assert [labels[i] for i, t in enumerate(toks) if t == task.SEP] == expect
    p = next(q for q in _chain(20) if any(s.x not in task.VARIABLES for s in q.steps))
    think = task.thinking_words(p.text)
    ends = [i for i, t in enumerate(think) if t == task.SEP]
    steps, prev = [], 0
    for e in ends:
        steps.append(" ".join(think[prev : e + 1]))
        prev = e + 1
    for k in range(1, len(steps) + 1):
        assert testbed_step_verifier(p.question, steps[:k], family="chain") == 1.0
    k = next(i for i, s in enumerate(p.steps) if s.x not in task.VARIABLES)
    words = steps[k].split()
    j = len(words) - task.STEP_TOKENS  # the step's first word
    words[j + 1] = str((int(words[j + 1]) + 1) % 10)  # miscopy the read result
    assert testbed_step_verifier(p.question, steps[:k] + [" ".join(words)], family="chain") == 0.0
    # the same check through --prm testbed-verifier:chain (the copy rule does not follow the chain)
    from eval.rescue.verifiers import load_eval_prm

    chain, copy = load_eval_prm("testbed-verifier:chain", ";"), load_eval_prm("testbed-verifier", ";")
    request = type("R", (), {"question": p.question, "step_texts": lambda self: steps[:k + 1]})()
    assert chain.score([request]) == [1.0] and copy.score([request]) == [0.0]
    with pytest.raises(ValueError, match="testbed-verifier:<family>"):
        load_eval_prm("testbed-verifier:nope", ";")


def test_lose_reads_and_the_fair_chain_recipe_loads():
    """``keep_reads=False`` forces none of the read results (a drawn shape keeps them only by its own
    draw); ``data.evict_lose_reads`` is validated; configs/testbed/chain-lrm-fair.yaml loads,
    trains from scratch with the mechanism shapes and both lose options, and draws batches."""
    from pathlib import Path

    import yaml

    from trainers.eviction_masks import draw_kept_set
    from trainers.testbed_lm import LMConfig, TraceStream

    p = _chain(10)[3]
    reads = task.read_values(p.tokens, "chain")
    for shape in ("tokens", "values", "windows"):
        kept, _w, _p = draw_kept_set(list(p.tokens), random.Random(0), (16, 32), 0.0, shape, keep_asked=False, keep_reads=False)
        assert not any(kept[v] for v in reads), shape  # keep probability 0: nothing but the question
    with pytest.raises(ValueError, match="evict_lose_reads"):
        LMConfig.from_dict({"data": {"evict_lose_reads": 1.5}, "stages": [{"steps": 1, "lr": 1e-3, "lr_end": 1e-4, "long_frac": 1.0}]})
    root = Path(__file__).resolve().parents[1]
    cfg = LMConfig.from_dict(yaml.safe_load((root / "configs/testbed/chain-lrm-fair.yaml").read_text()))
    assert cfg.init_from is None and cfg.data.family == "chain" and cfg.model["hidden_size"] == 256
    assert cfg.data.evict_lose_asked == cfg.data.evict_lose_reads == 0.3
    assert {"h2o", "snapkv"} <= set(cfg.data.evict_shapes) and cfg.data.evict_shapes["h2o"] + cfg.data.evict_shapes["snapkv"] == pytest.approx(0.5)
    batch = TraceStream(cfg, 0).batch(cfg.data.short_steps + 1)
    assert "attention_mask" in batch and batch["input_ids"].shape[0] in (cfg.data.long_batch, cfg.data.short_batch)
