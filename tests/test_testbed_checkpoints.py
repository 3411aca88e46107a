"""The shipped testbed checkpoints load as standard HF directories and still work (fast: < 20 s)."""

from __future__ import annotations

import random

import pytest
import torch

from data_pipeline.testbed import task

# Fixed problems (short traces) the shipped LRM solves with the full cache (seeded sampling).
CI_SEEDS = [f"ci:{i}" for i in range(6)]


@pytest.fixture(scope="module")
def lrm():
    from trainers.testbed_eval import load_testbed

    return load_testbed("testbed")


def _sample(model, tok, problems, max_new_tokens=800):
    """Seeded sampling at the testbed's settings with plain HF ``generate`` (full cache). Greedy
    decoding is no fair check here: the filler words are uniform, so argmax decoding repeats one
    filler word for a whole gap."""
    from trainers.testbed_eval import generate_texts

    return generate_texts(model, tok, problems, max_new_tokens=max_new_tokens, seed=0)


def test_checkpoints_are_standard_hf_dirs():
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedTokenizerFast

    from dynts.models import checkpoints_dir

    for name, auto in (("testbed-lrm", AutoModelForCausalLM), ("testbed-helper", AutoModelForCausalLM),
                       ("testbed-prm", AutoModelForTokenClassification), ("testbed-prm-order", AutoModelForTokenClassification),
                       ("testbed-chain-lrm", AutoModelForCausalLM), ("testbed-chain-helper", AutoModelForCausalLM),
                       ("testbed-chain-prm", AutoModelForTokenClassification)):
        path = checkpoints_dir() / name
        assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
        model = auto.from_pretrained(path, local_files_only=True)
        # Not AutoTokenizer: transformers 5 forces Qwen2Tokenizer (byte-level BPE) on qwen2 dirs.
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        assert model.config.vocab_size == len(tok) == len(task.VOCAB)
        assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True) == "<bos> x <think>"


def test_dynts_load_returns_the_word_level_tokenizer():
    from dynts import load

    _, tok = load("testbed")
    text = task.make_problem(0).text
    assert tok.decode(tok(text)["input_ids"]) == text


def test_lrm_solves_fixed_problems(lrm):
    model, tok = lrm
    problems = [task.make_problem(s, min_think=150, max_think=250) for s in CI_SEEDS]
    texts = _sample(model, tok, problems)
    assert all(task.parse_answer(t) is not None for t in texts), texts
    assert sum(task.check_answer(p, t) for p, t in zip(problems, texts)) >= 5


def test_helper_writes_well_formed_traces():
    from trainers.testbed_eval import load_testbed

    model, tok = load_testbed("testbed-helper")
    problems = [task.make_problem(s, min_think=150, max_think=250) for s in CI_SEEDS[:3]]
    texts = _sample(model, tok, problems)
    assert all(task.parse_answer(t) is not None and task.parse_steps(t) for t in texts), texts


def test_prm_interface_and_it_separates_corrupted_steps():
    """Qwen2.5-Math-PRM interface: 2 labels; a step's score is softmax(logits)[..., 1] at its ";".
    The shipped PRM tells corrupted steps from correct ones on held-out traces."""
    from dynts.models import load
    from trainers.testbed_prm import IGNORE, PRMConfig, auroc, corrupt, heldout, step_scores

    model, _ = load("testbed-prm")
    assert model.config.num_labels == 2 and model.config.id2label[1] == "correct"
    toks, labels = corrupt(task.make_problem("ci-prm", max_think=300), random.Random(0), 0.3)
    with torch.no_grad():
        ids = torch.tensor([[task.VOCAB.index(t) for t in toks]])
        score = model(input_ids=ids).logits.softmax(-1)[0, :, 1]
    steps = [i for i, y in enumerate(labels) if y != IGNORE]
    assert steps == [i for i, t in enumerate(toks) if t == task.SEP]
    assert torch.all((score[steps] >= 0) & (score[steps] <= 1))
    cfg = PRMConfig.from_dict({"corrupt_prob": 0.5, "data": {"min_think": 60, "max_think": 400}})
    scores, truth = step_scores(model, heldout("ci", 12, cfg))
    assert truth.count(0) >= 10 and truth.count(1) >= 10 and auroc(scores, truth) > 0.95


def test_shipped_predictor_ranks_the_critical_token_high(lrm):
    """The bundled importance predictor fits the testbed LRM and, from its final hidden states,
    ranks the value the answer reads in the top 20% of thinking tokens on fresh reference traces."""
    from dynts.predictor import final_norm, load_predictor
    from dynts.models import checkpoints_dir

    model, _ = lrm
    predictor = load_predictor(str(checkpoints_dir() / "testbed-predictor"), model)
    top20 = []
    for i in range(10):
        p = task.make_problem(f"ci-predictor:{i}", min_think=150, max_think=400)
        end = p.tokens.index(task.END_THINK)
        ids = torch.tensor([[task.VOCAB.index(t) for t in p.tokens[:end]]])
        seen = {}
        hook = final_norm(model).register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
        try:
            with torch.no_grad():
                model(input_ids=ids)
                scores = predictor(seen["h"])[0]
        finally:
            hook.remove()
        thinking = scores[task.QUESTION_TOKENS : end]
        rank = min(int((thinking > scores[c]).sum()) for c in p.critical_positions)
        top20.append(rank < 0.2 * len(thinking))
    assert sum(top20) >= 8, top20


def test_helper_slips_by_its_rule_and_reads_its_context():
    """The shipped helper (configs/testbed/helper.yaml) writes products with a first operand >= 6
    one too high (task.SLIPS["times-high"]) and every other step right, and answers with the value it
    wrote: its errors are of capability, not of context."""
    from trainers.testbed_eval import load_testbed

    model, tok = load_testbed("testbed-helper")
    problems = [task.make_problem(s, min_think=200, max_think=300) for s in CI_SEEDS]
    texts = _sample(model, tok, problems)
    slip = task.SLIPS["times-high"]
    hit = [v == slip(op, xv, yv, task.OPS[op](xv, yv)) for _p, t in zip(problems, texts)
           for (_x, xv, op, _y, yv, _k, v) in task.parse_steps(t) if op == "times" and xv >= 6]
    rest = [v == task.OPS[op](xv, yv) for _p, t in zip(problems, texts)
            for (_x, xv, op, _y, yv, _k, v) in task.parse_steps(t) if not (op == "times" and xv >= 6)]
    assert len(hit) >= 3 and sum(hit) >= 0.8 * len(hit), hit
    assert sum(rest) >= 0.95 * len(rest)
    for p, t in zip(problems, texts):  # the answer copies the value the trace wrote for the asked key
        written = [v for *_r, k, v in task.parse_steps(t) if k == p.asked]
        assert task.parse_answer(t) is not None and (not written or task.parse_answer(t)[1] in written)


def test_lrm_keeps_solving_with_only_the_question_asked_step_and_recent_tokens(lrm):
    """The shipped LRM was fine-tuned under eviction-shaped masks (configs/testbed/lrm-robust.yaml):
    with the oracle evictor (question + the asked step + 40 recent tokens, budget 64) it still
    answers the fixed problems."""
    import data_pipeline.testbed.oracle  # noqa: F401  (registers "testbed-oracle")
    from dynts import generate

    model, tok = lrm
    problems = [task.make_problem(s, min_think=150, max_think=250) for s in CI_SEEDS]
    torch.manual_seed(0)
    out = generate(model, tok, [[{"role": "user", "content": p.question}] for p in problems], method="testbed-oracle",
                   method_options={"keep_step": True}, budget=64, local_window=40, max_new_tokens=800,
                   do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    assert out.stats["peak_cache_tokens"] <= 64 and out.stats["evictions"] > 0
    assert sum(task.check_answer(p, t) for p, t in zip(problems, out.texts)) >= 5, out.texts
