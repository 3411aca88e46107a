"""The demo (``python -m eval.demo``) runs every method on the bundled testbed checkpoints; here on
a tiny random stand-in placed where the bundled checkpoints live (``$DYNTS_CHECKPOINTS``)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import dynts
from eval import demo


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the demo sets 1


def make_checkpoints(root, predictor: bool):
    from data_pipeline.testbed.tokenizer import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(root / "testbed-lrm")
    tok.save_pretrained(root / "testbed-lrm")
    if predictor:
        dynts.ImportancePredictor(32).save_pretrained(root / "testbed-predictor")


def test_demo_without_checkpoints_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DYNTS_CHECKPOINTS", str(tmp_path))
    assert demo.main(["--run-dir", str(tmp_path / "run")]) == 1
    assert "dynts testbed train" in capsys.readouterr().err


@pytest.mark.parametrize("predictor", [False, True], ids=["no-predictor", "predictor"])
def test_demo_runs_every_method(tmp_path, monkeypatch, capsys, one_thread, predictor):
    make_checkpoints(tmp_path, predictor)
    monkeypatch.setenv("DYNTS_CHECKPOINTS", str(tmp_path))
    code = demo.main(["--n", "2", "--budget", "24", "--local-window", "6", "--max-new-tokens", "24",
                      "--run-dir", str(tmp_path / "run")])
    assert code == 0
    captured = capsys.readouterr()
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    methods = [r["method"]["name"] for r in results]
    assert methods[0] == "full" and "testbed-oracle" in methods and "window" in methods
    assert ("dynts" in methods) == predictor
    if not predictor:
        assert "skipping dynts" in captured.err
    assert "| full |" in captured.out and "accuracy_vs_budget.png" in captured.out
