"""ImportancePredictor: shape contract, safetensors round trip, clear errors on bad files."""

from __future__ import annotations

import json

import warnings

import pytest
import torch

import dynts
import dynts.models
from conftest import tiny_model
from dynts.predictor import load_predictor
from dynts.predictor import (
    PREDICTOR_PATH_ENV,
    WEIGHTS_NAME,
    BaseModelFingerprint,
    PredictorConfig,
    final_norm,
    find_predictor,
    model_basename,
    norm_weight_hash,
)


def test_architecture_and_roundtrip(tmp_path):
    torch.manual_seed(0)
    p = dynts.ImportancePredictor(48, activation="softplus", backbone="tiny")
    shapes = [tuple(m.weight.shape) for m in p.mlp if isinstance(m, torch.nn.Linear)]
    assert shapes == [(96, 48), (24, 96), (1, 24)]  # d -> 2d -> d/2 -> 1
    h = torch.randn(2, 5, 48)
    assert p(h).shape == (2, 5)
    p.save_pretrained(tmp_path)
    q = dynts.ImportancePredictor.from_pretrained(tmp_path)
    assert q.config.backbone == "tiny"
    torch.testing.assert_close(p(h), q(h))


def test_corrupted_and_missing_files(tmp_path):
    dynts.ImportancePredictor(16).save_pretrained(tmp_path)
    (tmp_path / WEIGHTS_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupted"):
        dynts.ImportancePredictor.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="predictor_config.json"):
        dynts.ImportancePredictor.from_pretrained(tmp_path / "missing")


def test_bad_config():
    with pytest.raises(ValueError, match="activation"):
        dynts.ImportancePredictor(16, activation="swishy")
    with pytest.raises(ValueError, match="hidden_size"):
        dynts.ImportancePredictor(0)
    with pytest.raises(ValueError, match="label=1 must be a string"):
        dynts.ImportancePredictor(16, label=1)


def test_scores_come_from_the_same_forward(qwen2):
    """Each new token is scored once, from the final hidden state of the forward that produced it."""
    calls = []
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size)
    predictor.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    ids = torch.randint(3, 100, (1, 7))
    result = dynts.generate(
        qwen2, input_ids=ids, method="dynts", budget=200, local_window=4, predictor=predictor,
        max_new_tokens=5, pad_token_id=0, eos_token_id=None,
    )
    # prefill scored at once; the 4 decode steps' hidden states kept and scored in ONE batched call
    # (defer_scores, the default of build_cache); no second model forward
    assert calls == [7, 4]
    cache = result.cache
    assert not cache.scores[0, : cache.length].isnan().any()


def test_deferred_scores_equal_per_step_scores(qwen2):
    """Scoring decode steps in one batched call at the event gives the per-step scores and kept sets."""
    from conftest import decode_with_cache, padded_batch

    torch.manual_seed(0)
    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size).eval()
    ids, mask = padded_batch([12, 9], seed=5)
    runs = [decode_with_cache(qwen2, ids, mask, "dynts", 24, 30, predictor, defer_scores=d) for d in (False, True)]
    (seq_a, _, visible_a, _, cache_a), (seq_b, _, visible_b, _, cache_b) = runs
    assert cache_a.stats.evictions >= 2 and torch.equal(seq_a, seq_b) and visible_a == visible_b
    n = cache_a.length
    torch.testing.assert_close(cache_b.scores[:, :n], cache_a.scores[:, :n], equal_nan=True)


def test_deep_copied_model_scores_through_its_own_slot(qwen2):
    """The predictor hook stays on the model after a call; a deep copy scores for its own caches."""
    import copy

    predictor = dynts.ImportancePredictor(qwen2.config.hidden_size).eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, method="dynts", budget=24, local_window=4, predictor=predictor, max_new_tokens=30,
              pad_token_id=0, eos_token_id=None)
    first = dynts.generate(qwen2, **kw)
    twin = copy.deepcopy(qwen2)
    second = dynts.generate(twin, **kw)
    assert first.stats["evictions"] >= 2 and torch.equal(first.sequences, second.sequences)


# ---------------------------------------------------------------- bound to its base model


def trained(family: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model whose final norm looks trained (random init leaves every norm at 1.0)."""
    model = tiny_model(family, seed=seed)
    with torch.no_grad():
        norm = final_norm(model).weight
        norm.copy_(1 + 0.1 * torch.randn(norm.shape, generator=torch.Generator().manual_seed(seed)))
    return model.to(dtype)


def _bound(model, name: str | None = None) -> dynts.ImportancePredictor:
    torch.manual_seed(0)
    p = dynts.ImportancePredictor(model.config.hidden_size)
    p.config.base_model = BaseModelFingerprint.from_model(model, name)
    return p


def test_a_predictor_refuses_another_model_of_the_same_hidden_size(tmp_path):
    a, b = trained(seed=0), trained(seed=1)  # same shapes, other weights
    a.config._name_or_path, b.config._name_or_path = "org/tiny-a", "org/tiny-b"
    _bound(a).save_pretrained(tmp_path)
    assert load_predictor(str(tmp_path), a).config.base_model.name_or_path == "org/tiny-a"
    with pytest.raises(ValueError, match="final_norm_sha256") as err:
        load_predictor(str(tmp_path), b)
    assert "org/tiny-a" in str(err.value) and "org/tiny-b" in str(err.value) and "strict=False" in str(err.value)
    with pytest.raises(ValueError, match="trained on org/tiny-a"):  # generate routes through the same check
        dynts.generate(b, input_ids=torch.tensor([[1, 5, 6]]), method="dynts", predictor=str(tmp_path),
                       budget=16, local_window=4, max_new_tokens=2)
    predictor = dynts.ImportancePredictor.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="used anyway"):
        assert load_predictor(predictor, b, strict=False) is predictor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_predictor(predictor, b)  # accepted once: generate's own check passes silently
    llama = trained("llama", seed=7)
    with pytest.raises(ValueError, match="trained on"):
        load_predictor(str(tmp_path), llama)


def test_fingerprint_is_dtype_and_device_independent_and_callable_from_a_config():
    model = trained()
    fp32 = BaseModelFingerprint.from_model(model)
    bf16 = BaseModelFingerprint.from_model(trained(dtype=torch.bfloat16))
    assert fp32.final_norm_sha256 == bf16.final_norm_sha256 and not fp32.differences(bf16)
    assert (fp32.num_hidden_layers, fp32.hidden_size, fp32.vocab_size) == (2, 64, 128)
    norm = final_norm(model).weight
    # an engine without an HF model object (vLLM) has the config and the final norm's weight
    from_config = BaseModelFingerprint.from_config(model.config, norm.detach().clone().to(torch.bfloat16))
    assert from_config == fp32
    predictor = _bound(model)
    assert load_predictor(predictor, model.config, final_norm_weight=norm) is predictor
    other = trained(seed=3)
    with pytest.raises(ValueError, match="final_norm_sha256"):
        load_predictor(predictor, other.config, final_norm_weight=final_norm(other).weight)
    assert norm_weight_hash(torch.empty(4, device="meta")) is None


def test_fingerprint_round_trips_and_an_unbound_predictor_checks_the_hidden_size(tmp_path):
    model = trained()
    _bound(model, "tiny").save_pretrained(tmp_path / "bound")
    assert dynts.ImportancePredictor.from_pretrained(tmp_path / "bound").config.base_model == BaseModelFingerprint.from_model(model, "tiny")
    dynts.ImportancePredictor(64).save_pretrained(tmp_path / "unbound")
    with pytest.warns(UserWarning, match="records no base model"):
        load_predictor(str(tmp_path / "unbound"), model)
    with pytest.raises(ValueError, match="hidden_size 32 != 64"):
        load_predictor(dynts.ImportancePredictor(32), model)
    with pytest.raises(ValueError, match="base_model.hidden_size"):
        dynts.ImportancePredictor(PredictorConfig(hidden_size=32, base_model={"hidden_size": 64}))
    assert model_basename("/hub/models--deepseek-ai--DeepSeek-R1-Distill-Qwen-7B/snapshots/abc123") == "DeepSeek-R1-Distill-Qwen-7B"
    assert model_basename("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B") == model_basename("models/DeepSeek-R1-Distill-Qwen-7B/")


def test_auto_finds_a_predictor_by_base_name(tmp_path, monkeypatch):
    model = trained()
    model.config._name_or_path = "/models/tiny-reasoner"
    monkeypatch.delenv(PREDICTOR_PATH_ENV, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="dynts-predictor-tiny-reasoner") as err:
        load_predictor("auto", model)
    assert "dynts pipeline --config" in str(err.value)
    # a local directory list: the search_dirs argument or $DYNTS_PREDICTOR_PATH
    _bound(model).save_pretrained(tmp_path / "mine" / "dynts-predictor-tiny-reasoner")
    assert load_predictor("auto", model, search_dirs=[tmp_path / "mine"]).config.base_model is not None
    monkeypatch.setenv(PREDICTOR_PATH_ENV, str(tmp_path / "mine"))
    assert find_predictor("org/tiny-reasoner") == tmp_path / "mine" / "dynts-predictor-tiny-reasoner"
    monkeypatch.delenv(PREDICTOR_PATH_ENV)
    # the local HF cache: a hub repo <org>/dynts-predictor-<basename>
    repo = tmp_path / "hub" / "models--someone--dynts-predictor-tiny-reasoner"
    _bound(model).save_pretrained(repo / "snapshots" / "c0ffee")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee")
    assert find_predictor(BaseModelFingerprint.from_model(model)) == repo / "snapshots" / "c0ffee"
    # the predictor found must still be this model's
    other = trained(seed=5)
    other.config._name_or_path = "/elsewhere/tiny-reasoner"
    with pytest.raises(ValueError, match="final_norm_sha256"):
        load_predictor("auto", other)


def test_shipped_testbed_predictor_is_bound_and_carded():
    directory = dynts.models.checkpoints_dir() / "testbed-predictor"
    card = (directory / "README.md").read_text()
    measured = json.loads((directory / "metrics.json").read_text())  # held-out numbers at export
    assert f"{measured['val/kendall']:.3f}" in card and f"{measured['val/overlap']:.3f}" in card
    assert "dynts pipeline --config configs/predictor/testbed.pipeline.yaml" in card
    model, _ = dynts.load("testbed")
    predictor = load_predictor("auto", model)  # found by its fingerprint: the directory is testbed-predictor
    assert predictor.config.base_model.name_or_path == "testbed"
    assert predictor.config.base_model.final_norm_sha256 in card
    assert find_predictor("testbed") == directory  # and by the base name it records
    with pytest.raises(ValueError, match="trained on testbed"):
        load_predictor(predictor, tiny_model_of_width(model.config.hidden_size))


def tiny_model_of_width(hidden: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=87, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4)).eval()


def test_config_only_check_compares_names_when_the_weights_are_unknown():
    model = trained()
    predictor = _bound(model, "org/tiny-reasoner")
    assert load_predictor(predictor, model.config, name_or_path="/models/tiny-reasoner") is predictor
    with pytest.raises(ValueError, match="name 'tiny-reasoner' != 'other'"):
        load_predictor(predictor, model.config, name_or_path="org/other")


def test_cli_predictor_auto(capsys):
    from dynts.generate_cli import main as generate_main

    assert generate_main(["a 6 b 6 find r1 <think>", "--model", "testbed", "--method", "dynts", "--predictor", "auto",
                          "--budget", "32", "--local-window", "8", "--max-new-tokens", "40", "--greedy"]) == 0
    assert "'method': 'dynts'" in capsys.readouterr().out
