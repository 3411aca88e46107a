"""bf16 / fp16 on CPU for every method on tiny Llama, Qwen2 and Qwen3: with a budget that never fills,
``dynts.generate`` is token-identical to ``model.generate`` in the same dtype; under eviction each
decode step's logits equal a plain forward with the explicit 4-D mask of the kept positions within
a few units in the last place of the dtype. The fp32 versions: ``test_exactness.py``, ``test_eviction.py``."""

from __future__ import annotations

import pytest
import torch

import dynts
from conftest import FAMILIES, decode_with_cache, explicit_mask_logits, padded_batch, tiny_model
from test_exactness import METHODS, reference

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.bfloat16, torch.float16]


def evictor(method: str):
    """The method, with SepLLM's separators set to every 4th id of the tiny vocabulary."""
    return dynts.make_evictor("sepllm", separator_token_ids=tuple(range(3, 128, 4))) if method == "sepllm" else method


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lengths", [[9], [5, 12, 3, 8]], ids=["batch1", "batch4-padded"])
def test_no_eviction_is_token_identical(dtype, family, lengths):
    model = tiny_model(family, dtype=dtype)
    ids, mask = padded_batch(lengths)
    new = 24
    expected = reference(model, ids, mask, new)
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    for method in METHODS:
        result = dynts.generate(
            model, input_ids=ids, attention_mask=mask, method=method, budget=ids.shape[1] + new + 8, local_window=4,
            predictor=predictor, max_new_tokens=new, pad_token_id=0, do_sample=False, think_end=None,
        )
        assert result.stats["evictions"] == 0
        assert torch.equal(result.sequences, expected), method


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("lengths", [[10], [10, 6]], ids=["batch1", "batch2-padded"])
def test_logits_under_eviction_match_explicit_mask(dtype, family, lengths):
    model = tiny_model(family, dtype=dtype)
    ids, mask = padded_batch(lengths, seed=1)
    predictor = dynts.ImportancePredictor(model.config.hidden_size)
    for method in [m for m in METHODS if m != "full"]:
        seq, logits, visible, sizes, cache = decode_with_cache(model, ids, mask, evictor(method), 22, 40, predictor)
        assert cache.stats.evictions >= 3 and max(sizes) <= 22
        assert logits.dtype == dtype
        ref = explicit_mask_logits(model, ids, mask, seq, visible)
        # the two paths sum attention over different key layouts: allow 2-4 ulps of the largest logit
        atol = 2 * torch.finfo(dtype).eps * float(ref.float().abs().max())
        torch.testing.assert_close(logits[:, :-1].float(), ref.float(), atol=atol, rtol=0, msg=lambda m: f"{method}: {m}")


def test_bf16_prm_keeps_prefix_reuse():
    """A bf16 PRM's reused prefix differs from a full forward by bf16 rounding only: reuse must stay
    on (the former fixed ``atol=1e-4`` switched it off silently, making scoring quadratic)."""
    from dynts.rescue import StepRequest, TokenClassificationPRM
    from dynts.rescue.prefix import PrefixScorer, reuse_tolerance
    from rescue_tiny import tiny_prm, word_tokenizer

    tok = word_tokenizer()
    model = tiny_prm().to(torch.bfloat16)
    reused, full = TokenClassificationPRM(model, tok), TokenClassificationPRM(model, tok, reuse_prefix=False)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    steps = [ids("w5 w6 w7 w8 ;"), ids("w9 w10 w11 w12 w13 ;")]
    reqs = [StepRequest("w9 w10", ids("<bos> w9 w10"), steps, ids(c), tok) for c in ("w5 w6 ;", "w7 ;", "w20 w21 w22 ;")]
    assert reused.score(reqs) == pytest.approx(full.score(reqs), abs=reuse_tolerance(torch.bfloat16))
    assert reused.prefix.verified is True
    # the same check with the fp32 tolerance refuses the bf16 rounding
    rows = [r.prompt_ids + sum(r.steps, []) + r.candidate for r in reqs]
    assert PrefixScorer(model, 0).check(rows, [len(r) - 1 for r in rows], atol=1e-4) is False
    assert reuse_tolerance(torch.float32) == 1e-4 and reuse_tolerance(torch.bfloat16) == 4 * 2**-7
