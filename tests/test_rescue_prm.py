"""PRM scoring: the Qwen2.5-Math-PRM recipe on a tiny random token classifier with the same
interface, a raw token-classification PRM (the testbed's), callables, and loading."""

from __future__ import annotations

import json

import pytest
import torch

from dynts.rescue import CallablePRM, QwenMathPRM, StepRequest, TokenClassificationPRM, load_prm
from rescue_tiny import DELIMITER_ID, tiny_prm, word_tokenizer

QWEN_SPECIALS = ("<extra_0>", "<|im_start|>", "<|im_end|>")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen_like():
    tok = word_tokenizer(extra=QWEN_SPECIALS)
    return tiny_prm(vocab_size=len(tok)), tok


def request(tok, steps, candidate, question="w9 w10 w11"):
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return StepRequest(question, ids("<bos> " + question), [ids(s) for s in steps], ids(candidate), tok)


def test_qwen_recipe_matches_model_card(qwen_like):
    model, tok = qwen_like
    prm = QwenMathPRM(model, tok, step_delimiter=";")
    steps = ["w5 w6 ;", "w7 w8 w9 ;"]
    # the model card: system + user + "<extra_0>".join(steps) + "<extra_0>" through the chat template,
    # softmax over the 2 labels, positive probability at each separator
    text = tok.apply_chat_template(
        [{"role": "system", "content": prm.system}, {"role": "user", "content": "w9 w10 w11"},
         {"role": "assistant", "content": "w5 w6<extra_0>w7 w8 w9<extra_0>"}], tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    sep = tok.convert_tokens_to_ids("<extra_0>")
    with torch.no_grad():
        probs = model(input_ids=ids).logits.softmax(-1)[0]
    card = probs[ids[0] == sep, 1].tolist()
    assert len(card) == 2
    assert prm.step_rewards("w9 w10 w11", steps) == pytest.approx(card, abs=1e-6)
    scores = prm.score([request(tok, steps[:1], steps[1]), request(tok, [], steps[0])])
    assert scores == pytest.approx([card[1], card[0]], abs=1e-5)  # batched, padded, reordered


def test_qwen_recipe_needs_a_one_token_separator(qwen_like):
    model, tok = qwen_like
    with pytest.raises(ValueError, match="separator"):
        QwenMathPRM(model, tok, separator="w5 w6")


def test_token_classification_prm_scores_at_the_separator():
    tok = word_tokenizer()
    model = tiny_prm()
    prm = TokenClassificationPRM(model, tok, separator=";")
    req = request(tok, ["w5 w6 ;"], "w7 w8 ;")
    row = req.prompt_ids + req.steps[0] + req.candidate
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([row])).logits.softmax(-1)[0, -1, 1].item()
    assert prm.score([req]) == pytest.approx([expected], abs=1e-6)
    # a candidate that ends with EOS (or at the token cap) is scored at an appended separator
    eos_req = request(tok, ["w5 w6 ;"], "w7 w8 <eos>")
    assert prm.encode(eos_req) == row
    assert prm.score([eos_req, req]) == pytest.approx([expected, expected], abs=1e-5)
    # a PRM with another vocabulary re-tokenises the decoded trajectory
    other = word_tokenizer(extra=("<extra_0>",))
    text_prm = TokenClassificationPRM(tiny_prm(vocab_size=len(other)), other, separator=";")
    assert not text_prm._shares_vocab(tok) and text_prm.encode(req) == row


def test_callable_prm_gets_question_and_steps():
    tok = word_tokenizer()
    seen = []

    def fn(question, steps):
        seen.append((question, steps))
        return len(steps[-1])

    scores = CallablePRM(fn).score([request(tok, ["w5 w6 ;"], "w7 w8 w9 ;")])
    assert scores == [len("w7 w8 w9 ;")]
    assert seen == [("w9 w10 w11", ["w5 w6 ;", "w7 w8 w9 ;"])]


def test_load_prm_from_directory(tmp_path, qwen_like):
    model, tok = qwen_like
    model.save_pretrained(tmp_path / "prm")
    tok.save_pretrained(tmp_path / "prm")
    loaded = load_prm(str(tmp_path / "prm"), step_delimiter=";")
    assert isinstance(loaded, QwenMathPRM)  # <extra_0> in the vocabulary picks the Qwen recipe
    req = request(tok, ["w5 w6 ;"], "w7 w8 ;")
    assert loaded.score([req]) == pytest.approx(QwenMathPRM(model, tok, step_delimiter=";").score([req]), abs=1e-6)
    assert isinstance(load_prm(str(tmp_path / "prm"), kind="token"), TokenClassificationPRM)


def test_remote_code_prm_needs_explicit_trust(tmp_path):
    d = tmp_path / "remote"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForProcessRewardModel"], "model_type": "qwen2",
        "auto_map": {"AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"},
    }))
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_prm(str(d))


def test_load_prm_bad_input(tmp_path):
    tok = word_tokenizer()
    with pytest.raises(ValueError, match="tokenizer"):
        load_prm(tiny_prm())
    with pytest.raises(ValueError, match="kind"):
        load_prm((tiny_prm(), tok), kind="orm")
    with pytest.raises(ValueError, match="not 'testbed-prm' nor a local directory"):
        load_prm(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="must be a StepScorer"):
        load_prm(42)
    assert isinstance(load_prm(lambda q, s: 0.5), CallablePRM)
    assert DELIMITER_ID == tok.convert_tokens_to_ids(";")


def test_prefix_reuse_matches_full_forwards_step_after_step():
    tok = word_tokenizer()
    model = tiny_prm()
    reused = TokenClassificationPRM(model, tok)
    full = TokenClassificationPRM(model, tok, reuse_prefix=False)
    steps: list[str] = []
    candidates = ["w5 w6 ;", "w7 w8 w9 ;", "w10 <eos>"]
    for t in range(4):
        reqs = [request(tok, steps, c) for c in candidates] + [request(tok, steps[:1], "w11 ;", question="w3 w4")]
        assert reused.score(reqs) == pytest.approx(full.score(reqs), abs=1e-5)
        steps.append(candidates[t % 2])
    assert reused.prefix.verified is True
    # the committed context is encoded incrementally, not once per candidate and step
    context = len(request(tok, steps, "w5").prompt_ids) + sum(len(s.split()) for s in steps)
    assert reused.prefix.prefix_tokens < 2 * context + 10


def test_prefix_reuse_switches_off_for_bidirectional_prms():
    tok = word_tokenizer()
    model = tiny_prm()
    model.config.is_causal = False  # a bidirectional encoder: future tokens change earlier scores
    prm = TokenClassificationPRM(model, tok)
    reqs = [request(tok, ["w5 w6 ;"], c) for c in ("w7 w8 ;", "w9 ;")]
    scores = prm.score(reqs)
    assert prm.prefix.verified is False
    assert scores == pytest.approx(TokenClassificationPRM(model, tok, reuse_prefix=False).score(reqs), abs=1e-6)


def test_likelihood_prm_reduces_candidate_token_logprobs():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from conftest import TINY
    from dynts.rescue import LikelihoodPRM

    tok = word_tokenizer()
    torch.manual_seed(3)
    lm = Qwen2ForCausalLM(Qwen2Config(**TINY, attn_implementation="sdpa")).eval()
    req = request(tok, ["w5 w6 ;"], "w7 w8 ;")
    row = req.prompt_ids + req.steps[0] + req.candidate
    with torch.no_grad():
        logp = lm(input_ids=torch.tensor([row])).logits[0, :-1].log_softmax(-1)
    start = len(row) - len(req.candidate)
    token_logp = logp[torch.arange(start - 1, len(row) - 1), torch.tensor(row[start:])]  # the candidate's tokens only
    assert load_prm((lm, tok), kind="likelihood").score([req]) == pytest.approx([token_logp.min().exp().item()], rel=1e-5)
    mean = LikelihoodPRM(lm, tok, reduce="mean", batch_size=1)
    short = request(tok, [], "w9 ;")
    scores = mean.score([req, short])  # batched and padded: each row scored as if alone
    assert scores[0] == pytest.approx(token_logp.mean().exp().item(), rel=1e-5)
    assert scores[1] == pytest.approx(LikelihoodPRM(lm, tok, reduce="mean").score([short])[0], rel=1e-5)
    # a verifier with another vocabulary scores the re-tokenised text of the same candidate
    other = word_tokenizer(extra=("<extra_0>",))
    assert LikelihoodPRM(lm, other).encode(req) == (row, start)
    with pytest.raises(ValueError, match="reduce"):
        LikelihoodPRM(lm, tok, reduce="max")
    with pytest.raises(ValueError, match="likelihood"):
        load_prm(lambda q, s: 1.0, kind="likelihood")


def test_likelihood_prm_separates_corrupted_testbed_steps():
    """The testbed LRM as a full-context verifier tells corrupted steps from correct ones."""
    from dynts.models import load
    from trainers.testbed_prm import scorer_gate

    lm, tok = load("testbed")
    result = scorer_gate(load_prm((lm, tok), kind="likelihood"), 12, tok)
    assert result["gate_wrong_steps"] > 5 and result["gate_auroc"] > 0.95


def test_product_of_verifiers():
    """``ProductPRM``: a step's score is the product of every scorer's; ``A*B`` in the bench builds it."""
    from dynts.rescue import CallablePRM, ProductPRM, StepRequest
    from eval.rescue.verifiers import load_eval_prm

    half = CallablePRM(lambda q, steps: 0.5)
    by_length = CallablePRM(lambda q, steps: 1.0 / len(steps))
    requests = [StepRequest("q", [1], [[2]] * k, [3]) for k in range(3)]
    for r in requests:
        r.tokenizer = type("T", (), {"decode": staticmethod(lambda ids, skip_special_tokens=True: str(ids))})()
    assert ProductPRM([half, by_length]).score(requests) == [0.5 * 1.0, 0.5 / 2, 0.5 / 3]
    with pytest.raises(ValueError, match="two or more"):
        ProductPRM([half])
    combined = load_eval_prm("testbed-verifier*testbed-verifier", ";")
    assert isinstance(combined, ProductPRM) and len(combined.scorers) == 2
