"""Every entry point works whatever the grad / inference mode of this call and of the calls before it.

dynts keeps some tensors across calls (the host staging of :mod:`dynts.core.upload`, one per device and shared
by every cache and thread; the kernels' pointer tables). One made inside ``torch.inference_mode()`` is an
inference tensor that no later call outside inference mode may write, so each test runs a method that evicts in
both orders on a fresh staging cache, and once with two threads sharing it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import ContinuousBatchingConfig

import dynts
from dynts.core import upload as upload_module
from dynts.models import checkpoints_dir
from dynts.rescue import RescueConfig, load_prm, rescue_generate
from conftest import tiny_model
from rescue_tiny import DELIMITER, step_model, tiny_prm, word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

ORDERS = {"inside-then-outside": (True, False), "outside-then-inside": (False, True)}


@pytest.fixture(autouse=True)
def fresh_staging(monkeypatch):
    """Each test starts with no staging buffer, so its first call is the one that creates it."""
    monkeypatch.setattr(upload_module, "_SHARED", {})


def in_mode(inference: bool, fn, *args, **kwargs):
    with torch.inference_mode(inference):
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def testbed():
    return dynts.load("testbed", dtype="float32", device="cpu")


QUESTION = [[{"role": "user", "content": "a 6 b 0 c 4 d 8 e 7 find r2"}]]
GREEDY = dict(budget=64, local_window=16, max_new_tokens=300, do_sample=False)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("method", ["streamingllm", "dynts"])
def test_generate_in_both_orders(testbed, order, method):
    model, tok = testbed
    predictor = checkpoints_dir() / "testbed-predictor" if method == "dynts" else None
    first, second = (in_mode(mode, dynts.generate, model, tok, QUESTION, method=method, predictor=predictor, **GREEDY)
                     for mode in ORDERS[order])
    assert first.stats["evictions"] > 0  # the staging path ran in the first call's mode
    assert second.texts == first.texts
    assert second.stats["evictions"] == first.stats["evictions"]


def test_staging_made_under_inference_mode_is_written_outside_it():
    device = torch.device("cpu")
    with torch.inference_mode():
        (inside,) = upload_module.upload(([1, 2, 3],), device)
    (outside,) = upload_module.upload(([4, 5, 6, 7],), device)  # the same buffer, written outside
    assert not outside.is_inference()
    assert inside.tolist() == [1, 2, 3] and outside.tolist() == [4, 5, 6, 7]
    with torch.inference_mode():
        (again,) = upload_module.upload(([8],), device)
    assert again.tolist() == [8] and inside.tolist() == [1, 2, 3]  # an upload never aliases an earlier one


def generate_batch(model, prompts):
    return dynts.generate_batch(
        model, None, prompts, method="streamingllm", budget=24, local_window=4, max_new_tokens=30,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, page_size=8, max_batch_tokens=64),
        eos_token_id=None,
    )


@pytest.mark.parametrize("order", ORDERS)
def test_generate_batch_in_both_orders(order):
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 5, 12)]
    first, second = (in_mode(mode, generate_batch, model, prompts) for mode in ORDERS[order])
    assert all(r.stats["evictions"] > 0 for r in first)
    assert [r.sequence for r in second] == [r.sequence for r in first]


@pytest.mark.parametrize("order", ORDERS)
def test_rescue_in_both_orders(order):
    tok = word_tokenizer()
    prm = load_prm((tiny_prm(), tok), kind="token", separator=DELIMITER)
    base, helper = step_model(0), step_model(1)
    prompts = ["<bos> w5 w9 w20 w33", "<bos> w7 w8 w9 w10 w11 w12"]
    config = RescueConfig(n_base=2, n_helper=1, step_delimiter=DELIMITER, detector=None, seed=3,
                          max_steps=5, max_step_tokens=10, max_tokens=30)
    kw = dict(method="streamingllm", budget=12, local_window=4, think_end=None, config=config)
    first_mode, second_mode = ORDERS[order]
    first = in_mode(first_mode, rescue_generate, base, helper, prm, tok, prompts, **kw)
    assert upload_module._SHARED  # the base's evictions made the staging in the first call's mode
    second = in_mode(second_mode, rescue_generate, base, helper, prm, tok, prompts, **kw)
    assert [p.tokens for p in second.problems] == [p.tokens for p in first.problems]


def test_two_threads_share_the_staging(testbed):
    """A serving process generates on several threads at once; one of them under inference mode."""
    model, tok = testbed
    kw = dict(method="streamingllm", **GREEDY)
    results, errors = {}, []

    def run(name: str, inference: bool) -> None:
        try:
            results[name] = in_mode(inference, dynts.generate, model, tok, QUESTION, **kw).texts
        except Exception as error:  # surfaced below, with the thread's name
            errors.append((name, error))

    threads = [threading.Thread(target=run, args=(f"t{i}", i % 2 == 0)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    expected = dynts.generate(model, tok, QUESTION, **kw).texts  # after the threads: they made the staging
    assert results == {"t0": expected, "t1": expected}
