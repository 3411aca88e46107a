"""The GPU-shaped decode loop: device-side top-k/top-p equal to transformers' warpers, sampling
independent of batch composition, at most one host read per decode step and never a [rows, V]
one (counted with dynts.rescue.hostsync), and an incremental text tail equal to a full decode."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import dynts.rescue.engine as engine
from dynts.rescue import DegenerationDetector, RescueConfig, Sampler, candidate_generator, load_prm, rescue_generate
from dynts.rescue.detok import TextTail
from dynts.rescue.hostsync import count_host_reads
from rescue_tiny import DELIMITER, step_model, tiny_prm, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 20, 0.95), (0.8, 20, 0.5), (1.0, 5, 1.0), (0.7, 0, 0.9)])
def test_device_warping_equals_transformers(temperature, top_k, top_p):
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(0)) * 3
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    expected = LogitsProcessorList(warpers)(None, logits.clone()).softmax(-1)
    probs, ids = Sampler(temperature, top_k, top_p).candidates(logits)
    assert probs.shape == ids.shape == (7, top_k or 300)
    torch.testing.assert_close(torch.zeros_like(expected).scatter_(1, ids, probs), expected, atol=1e-6, rtol=0)


def test_sampling_does_not_depend_on_the_batch():
    sampler = Sampler(0.8, 20, 0.95)
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    streams = lambda rows: [candidate_generator(0, r, 0, "base", 0) for r in rows]  # noqa: E731
    alone = [sampler.draw(logits[[r]], streams([r]))[0][0] for r in range(6)]
    for rows in ([0, 1, 2, 3, 4, 5], [5, 3, 1], [2, 0, 4]):
        tokens, _ = sampler.draw(logits[rows], streams(rows))
        assert tokens == [alone[r] for r in rows]
    drawn = [sampler.draw(logits[[0]], [g])[0][0] for g in [random.Random(s) for s in range(300)]]
    probs, ids = sampler.candidates(logits[[0]])
    assert set(drawn) <= set(ids[0][probs[0] > 0].tolist())  # only tokens top-k/top-p kept
    assert len(set(drawn)) > 1


def test_one_host_read_per_decode_step_and_no_vocabulary_copy(monkeypatch):
    tok = word_tokenizer()
    prm = load_prm((tiny_prm(), tok), kind="token", separator=DELIMITER)
    counted = {"reads": 0, "steps": 0, "shapes": []}
    decode = engine.StepDecoder.decode

    def counting(self, *args, **kwargs):
        before = self.decode_steps
        with count_host_reads() as reads:
            out = decode(self, *args, **kwargs)
        counted["reads"] += reads.count
        counted["steps"] += self.decode_steps - before
        counted["shapes"] += reads.shapes
        return out

    monkeypatch.setattr(engine.StepDecoder, "decode", counting)
    detector = DegenerationDetector(entropy_threshold=4.6, entropy_window=2, guard=3, compress_threshold=0.3,
                                    compress_window=40, loop=dict(repeat_ngram=3))
    rescue_generate(step_model(0), step_model(1), prm, tok, ["<bos> w5 w9 w20 w33", "<bos> w40 w41"], method="window",
                    budget=16, local_window=4, think_end=None,
                    config=RescueConfig(n_base=3, n_helper=2, step_delimiter=DELIMITER, detector=detector, seed=3,
                                        max_steps=6, max_step_tokens=8, max_tokens=40))
    assert counted["steps"] > 20
    assert counted["reads"] <= counted["steps"]
    vocab = len(tok)
    assert all(not shape or shape[-1] < vocab for _, shape in counted["shapes"])  # [rows, 2k + 1], never [rows, V]


def test_counter_sees_every_kind_of_read():
    x = torch.randn(3, 4)
    with count_host_reads() as reads:
        x.tolist(), bool(x.any()), int(x[0, 0] > 0), x.sum().item(), float(x[1, 1]), x.cpu()
        y = x[1] * 2  # device work: no read
    assert [name for name, _ in reads.shapes] == ["tolist", "__bool__", "__int__", "item", "__float__", "cpu"]
    assert reads.largest() == 12 and y.shape == (4,)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld 中文字 ÿ∑∂ the quick brown fox ; 12 + 3 = 15"] * 20
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_text_tail_equals_a_full_decode(kind):
    tok = byte_level_tokenizer() if kind == "byte-level" else word_tokenizer()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.randrange(4, len(tok)) for _ in range(50)]
        tail = TextTail(decode, 25)
        for i in range(1, len(ids) + 1):
            text, full = tail.push(ids[:i]), decode(ids[:i])
            if not full.endswith("\ufffd"):  # an incomplete UTF-8 character is held back
                assert text == full[-25:]
