"""The cost model reproduces the constants printed in the DynTS and KV-Rescue papers.

Configs are built from the models' published shapes (no downloads)."""

from __future__ import annotations

import json

import pytest

from dynts import cost
from dynts.cli import COMMANDS
from dynts.cost import ModelShape
from dynts.cost_cli import cost_report, main

KIB = 1024

# config.json fields of the published checkpoints (Qwen2.5-Math-*-Instruct, DeepSeek-R1-Distill-Qwen-7B)
QWEN25_MATH_7B = dict(
    model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
    intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, torch_dtype="bfloat16",
)
QWEN25_MATH_72B = dict(
    model_type="qwen2", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
    intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False, torch_dtype="bfloat16",
)
QWEN25_MATH_15B = dict(
    model_type="qwen2", num_hidden_layers=28, hidden_size=1536, num_attention_heads=12, num_key_value_heads=2,
    intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16",
)


@pytest.fixture(scope="module")
def shapes() -> dict[str, ModelShape]:
    return {
        "7b": ModelShape.from_config(QWEN25_MATH_7B, name="Qwen2.5-Math-7B"),
        "72b": ModelShape.from_config(QWEN25_MATH_72B, name="Qwen2.5-Math-72B"),
        "1.5b": ModelShape.from_config(QWEN25_MATH_15B, name="Qwen2.5-Math-1.5B"),
    }


def test_kv_bytes_per_token_match_kvrescue_eq8(shapes):
    assert shapes["7b"].kv_bytes_per_token == 56 * KIB
    assert shapes["1.5b"].kv_bytes_per_token == 28 * KIB
    assert shapes["72b"].kv_bytes_per_token == 320 * KIB


def test_parameters_and_flops_match_kvrescue_table4(shapes):
    # Table 4: P = 7.62e9, 72.7e9, 1.54e9; text: C_dense 15.2 / 145.4 GFLOP, C_attn 0.401M*l / 2.62M*l
    assert shapes["7b"].parameters / 1e9 == pytest.approx(7.62, abs=0.005)
    assert shapes["72b"].parameters / 1e9 == pytest.approx(72.7, abs=0.05)
    assert shapes["1.5b"].parameters / 1e9 == pytest.approx(1.54, abs=0.005)
    assert shapes["7b"].dense_flops / 1e9 == pytest.approx(15.2, abs=0.05)
    assert shapes["72b"].dense_flops / 1e9 == pytest.approx(145.4, abs=0.05)
    assert shapes["7b"].attention_flops(1) / 1e6 == pytest.approx(0.401, abs=0.0005)
    assert shapes["72b"].attention_flops(1) / 1e6 == pytest.approx(2.62, abs=0.005)
    # "at l = 4k attention is only 11% (7B) / 7% (72B)" (relative to the dense part)
    assert round(shapes["7b"].attention_flops(4096) / shapes["7b"].dense_flops, 2) == 0.11
    assert round(shapes["72b"].attention_flops(4096) / shapes["72b"].dense_flops, 2) == 0.07


def test_break_even_volume_matches_dynts_corollary(shapes):
    # R1-Qwen = DeepSeek-R1-Distill-Qwen-7B, same shape as Qwen2.5-Math-7B: K = 900 >= 1.5d/(n_i L) = 192
    assert cost.break_even_volume(shapes["7b"]) == 192.0
    assert cost.break_even_volume(shapes["7b"], events=2) == 96.0
    assert cost.break_even_volume(shapes["7b"], exact=True) == pytest.approx(192.0, abs=0.01)
    assert cost.predictor_flops(3584) == 6 * 3584**2 + 3584
    # Theorem 5.1: the first event saves 4 L d K attention FLOPs, more than the predictor iff K >= 192
    m, budget = 100, 5000
    for volume, gains in [(900, True), (150, False)]:
        step = budget - m  # the step of the first eviction
        assert cost.eviction_count(step, m, budget, volume) == 1
        saved = cost.decode_flops(shapes["7b"], m + step) - cost.dynts_decode_flops(shapes["7b"], step, m, budget, volume)
        assert (saved > 0) == gains


def test_eviction_schedule_matches_section5():
    # n_i = max(0, floor((M + i - B) / K) + 1), S_i = M + i - n_i K
    assert cost.eviction_count(10, 100, 200, 50) == 0
    assert cost.eviction_count(100, 100, 200, 50) == 1
    assert cost.effective_length(100, 100, 200, 50) == 150
    assert cost.effective_length(149, 100, 200, 50) == 199
    assert cost.effective_length(150, 100, 200, 50) == 150
    with pytest.raises(ValueError, match="eviction volume"):
        cost.eviction_count(1, 1, 10, 0)


def test_kvrescue_crossover_memory_and_helper(shapes):
    # Eq. 14: l* = (1 + alpha) B' ~= 2500 for B' = 640 and alpha ~= 2.9
    assert cost.crossover_length(640, 2.9) == pytest.approx(2496)
    # Eq. 10: l / B' = 8192 / 640 = 12.8x
    assert shapes["7b"].kv_bytes(8192) / shapes["7b"].kv_bytes(640) == pytest.approx(12.8)
    # Eq. 11 at l = 4k, B = 512 (B' = 640), N = 8: 1.75 / 1.15 GiB (7B) and 10.0 / 2.44 GiB (72B)
    gib = 2**30
    full, rescue = cost.kvrescue_memory(shapes["7b"], shapes["1.5b"], 4096, 640, 8)
    assert (round(full / gib, 2), round(rescue / gib, 2)) == (1.75, 1.15)
    full, rescue = cost.kvrescue_memory(shapes["72b"], shapes["1.5b"], 4096, 640, 8)
    assert (round(full / gib, 1), round(rescue / gib, 2)) == (10.0, 2.44)
    # Eq. 15: the 1.5B helper costs about 24% of a 7B base token and 2.5% of a 72B one at 4k
    assert cost.helper_fraction(shapes["1.5b"], shapes["7b"], 4096, 640, 2.9) == pytest.approx(0.24, abs=0.01)
    assert cost.helper_fraction(shapes["1.5b"], shapes["72b"], 4096, 640, 2.9) == pytest.approx(0.025, abs=0.001)
    # below the crossover evicted decode costs more than full, above it less
    assert cost.evicted_decode_flops(shapes["7b"], 640, 2.9) > cost.decode_flops(shapes["7b"], 2000)
    assert cost.evicted_decode_flops(shapes["7b"], 640, 2.9) < cost.decode_flops(shapes["7b"], 3000)


def test_bad_config_and_settings_raise():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config({"hidden_size": 8})
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape.from_config({**QWEN25_MATH_7B, "num_key_value_heads": 5})
    with pytest.raises(ValueError, match="alpha"):
        cost.crossover_length(640, -1)
    with pytest.raises(ValueError, match="neither"):
        ModelShape.load("/nonexistent/model")


def test_cli_reads_config_json(tmp_path, capsys):
    assert COMMANDS["cost"][0] == "dynts.cost_cli:main"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN25_MATH_7B))
    assert main([str(tmp_path), "--budget", "5000", "--local-window", "2000", "--prefill", "100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["kv_bytes_per_token"] == 56 * KIB
    assert report["break_even_volume"] == 192.0 and report["break_even_satisfied"]
    rows = {r["position"]: r for r in report["positions"]}
    assert rows[16384]["kv_ratio"] == pytest.approx(5000 / 16384)
    assert rows[16384]["flops_ratio"] < 1.0 < rows[1024]["flops_ratio"]  # before the budget fills only the predictor costs
    assert main([str(path), "--helper", str(path)]) == 0
    assert "break-even" in capsys.readouterr().out


def test_report_uses_the_cache_budget(shapes):
    report = cost_report(shapes["7b"], budget=1024, local_window=128, retention=0.4, prefill=32)
    assert report["budget"]["eviction_volume"] == 1024 - report["budget"]["n_keep"]
    assert report["positions"][0]["position"] == 1024
