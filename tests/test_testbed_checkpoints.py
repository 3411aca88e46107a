"""The shipped testbed checkpoints load as standard HF directories and still work (fast: < 20 s)."""

from __future__ import annotations

import random

import pytest
import torch

from data_pipeline.testbed import task

# Fixed problems (short traces) the shipped LRM solves greedily with the full cache.
GREEDY_SEEDS = [f"ci:{i}" for i in range(8)]


@pytest.fixture(scope="module")
def lrm():
    from dynts.models import load

    return load("testbed")


def _greedy(model, tok, problems, max_new_tokens=400):
    from dynts import generate

    chats = [[{"role": "user", "content": p.question}] for p in problems]
    return generate(model, tok, chats, method="full", max_new_tokens=max_new_tokens, do_sample=False).texts


def test_checkpoints_are_standard_hf_dirs():
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from dynts.models import checkpoints_dir

    for name, auto in (("testbed-lrm", AutoModelForCausalLM), ("testbed-helper", AutoModelForCausalLM),
                       ("testbed-prm", AutoModelForTokenClassification)):
        path = checkpoints_dir() / name
        assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
        model = auto.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert model.config.vocab_size == len(tok) == len(task.VOCAB)
        assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True) == "<bos> x <think>"


def test_lrm_solves_fixed_problems_greedily(lrm):
    model, tok = lrm
    problems = [task.make_problem(s, min_think=150, max_think=250) for s in GREEDY_SEEDS]
    texts = _greedy(model, tok, problems)
    assert all(task.parse_answer(t) is not None for t in texts), texts
    assert sum(task.check_answer(p, t) for p, t in zip(problems, texts)) >= 7


def test_helper_writes_well_formed_traces():
    from dynts.models import load

    model, tok = load("testbed-helper")
    problems = [task.make_problem(s, min_think=150, max_think=250) for s in GREEDY_SEEDS[:4]]
    texts = _greedy(model, tok, problems)
    assert all(task.parse_answer(t) is not None and task.parse_steps(t) for t in texts), texts


def test_prm_separates_corrupted_steps():
    from dynts.models import load
    from trainers.testbed_prm import IGNORE, corrupt

    model, _ = load("testbed-prm")
    assert model.config.num_labels == 2
    rows = [corrupt(task.make_problem(f"ci-prm:{i}", max_think=400), random.Random(i), 0.3) for i in range(6)]
    good, bad = [], []
    with torch.no_grad():
        for toks, labels in rows:
            ids = torch.tensor([[task.VOCAB.index(t) for t in toks]])
            score = model(input_ids=ids).logits.softmax(-1)[0, :, 1]
            for i, y in enumerate(labels):
                if y != IGNORE:
                    (good if y == 1 else bad).append(float(score[i]))
    assert bad and good
    assert sum(good) / len(good) > 0.8 and sum(bad) / len(bad) < 0.3
