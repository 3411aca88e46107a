"""``dynts.load``: dtype / device / device_map / attention kernel, hub ids from the local HF cache,
PEFT adapters (unmerged and merged), and the sampling rule of ``dynts generate``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GenerationConfig

import dynts
from dynts import models
from dynts.cli_options import parse_options
from dynts.models import parse_dtype, resolve_path

from conftest import tiny_model
from rescue_tiny import word_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.tensor([[1, 5, 9, 17, 33, 64, 100]])


def save_tiny(directory, dtype=torch.float32, generation: dict | None = None, flat: bool = False):
    """A tiny Qwen2 + word-level tokenizer saved as a local HF directory; ``flat``: a zero LM head
    (uniform next-token distribution: sampling draws random words, greedy always the same one)."""
    model = tiny_model("qwen2").to(dtype)
    if flat:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    if generation is not None:
        model.generation_config = GenerationConfig(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **generation})
    model.save_pretrained(directory)
    word_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_dtype_device_and_attention(tiny_dir, monkeypatch):
    reference, tokenizer = dynts.load(tiny_dir)
    assert reference.dtype == torch.float32 and not reference.training
    assert tokenizer.convert_tokens_to_ids("w5") == 5  # the word-level tokenizer, loaded as saved
    for name, dtype in [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("float16", torch.float16), (torch.float32, torch.float32)]:
        model, _ = dynts.load(tiny_dir, dtype=name, device="cpu")
        assert {p.dtype for p in model.parameters()} == {dtype}, name
        assert next(model.parameters()).device.type == "cpu"
    bf16, _ = dynts.load(tiny_dir, dtype="bf16", attn_implementation="eager")
    assert bf16.config._attn_implementation == "eager"
    torch.testing.assert_close(logits(bf16), logits(reference), atol=0.15, rtol=0.05)  # bf16 rounding only
    seen, from_pretrained = {}, models.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **kw: seen.update(kw) or from_pretrained(*a, **kw))
    mapped, _ = dynts.load(tiny_dir, device_map={"": "cpu"})  # accelerate places it
    assert seen["device_map"] == {"": "cpu"} and seen["local_files_only"] and next(mapped.parameters()).device.type == "cpu"
    torch.testing.assert_close(logits(mapped), logits(reference))


def test_auto_dtype_keeps_the_checkpoint_dtype(tmp_path):
    model, _ = dynts.load(save_tiny(tmp_path / "bf16", dtype=torch.bfloat16))
    assert model.dtype == torch.bfloat16
    assert dynts.load(tmp_path / "bf16", dtype="float32")[0].dtype == torch.float32


def test_bad_options_raise(tiny_dir):
    with pytest.raises(ValueError, match=r"dtype='int8' is unknown; choose one of .*bfloat16"):
        dynts.load(tiny_dir, dtype="int8")
    with pytest.raises(ValueError, match="floating"):
        parse_dtype(torch.int64)
    with pytest.raises(ValueError, match="device=... or device_map"):
        dynts.load(tiny_dir, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="task='seq2seq' is unknown"):
        dynts.load(tiny_dir, task="seq2seq")
    with pytest.raises(ValueError, match="nothing is downloaded"):
        dynts.load("no-such-model")


def test_prm_loads_as_token_classification_from_its_config():
    model, tokenizer = dynts.load("testbed-prm")
    assert type(model).__name__.endswith("ForTokenClassification")
    assert type(dynts.load("testbed")[0]).__name__.endswith("ForCausalLM")
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("find")) == ["find"]


def fake_hub_cache(root, repo_id: str, source, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch, tiny_dir):
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen2", tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_path("tiny-org/tiny-qwen2") == snapshot
    model, tokenizer = dynts.load("tiny-org/tiny-qwen2", dtype="bf16")
    assert model.dtype == torch.bfloat16 and tokenizer.convert_tokens_to_ids("w9") == 9
    torch.testing.assert_close(logits(model), logits(dynts.load(tiny_dir, dtype="bf16")[0]))
    with pytest.raises(ValueError, match="local HF cache"):
        dynts.load("tiny-org/not-cached")


def make_adapter(base_dir, adapter_dir):
    """A LoRA adapter with non-zero B (so it changes the logits), saved as peft writes it."""
    from peft import LoraConfig, get_peft_model

    base, _ = dynts.load(base_dir)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    return logits(peft_model.eval())


def test_lora_adapter_changes_logits_and_merges(tmp_path, tiny_dir):
    adapter_dir = tmp_path / "adapter"
    expected = make_adapter(tiny_dir, adapter_dir)
    base = logits(dynts.load(tiny_dir)[0])
    assert (expected - base).abs().max() > 1e-2  # the adapter does something

    unmerged, tokenizer = dynts.load(tiny_dir, adapter=adapter_dir)
    torch.testing.assert_close(logits(unmerged), expected, atol=1e-5, rtol=1e-5)
    from_adapter_dir, _ = dynts.load(adapter_dir)  # base from adapter_config.json, same resolver
    torch.testing.assert_close(logits(from_adapter_dir), expected, atol=1e-5, rtol=1e-5)
    merged, _ = dynts.load(adapter_dir, merge_adapter=True)
    assert not any("lora" in name for name, _ in merged.named_modules())
    torch.testing.assert_close(logits(merged), logits(unmerged), atol=1e-4, rtol=1e-4)
    assert tokenizer.convert_tokens_to_ids("w7") == 7

    # the injected model runs under dynts hooks and evicts like any transformers model
    result = dynts.generate(unmerged, input_ids=IDS, method="window", budget=12, local_window=4,
                            max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert result.stats["evictions"] > 0 and result.stats["peak_cache_tokens"] <= 12
    with pytest.raises(ValueError, match="adapter_config.json"):
        dynts.load(tiny_dir, adapter=tiny_dir)


# ------------------------------------------------------------------ sampling follows generation_config


def run_generate(capsys, model, *flags):
    from dynts.generate_cli import main as generate_main

    assert generate_main(["w5 w9 w17", "--model", str(model), "--method", "window", "--budget", "64",
                          "--local-window", "8", "--max-new-tokens", "12", *flags]) == 0
    return capsys.readouterr().out.splitlines()[0]


def test_generate_follows_generation_config(tmp_path, capsys):
    sampling = save_tiny(tmp_path / "sampling", generation={"do_sample": True, "top_k": 0}, flat=True)
    first, second = run_generate(capsys, sampling, "--seed", "1"), run_generate(capsys, sampling, "--seed", "2")
    assert first != second  # the model's do_sample=True was followed
    greedy = [run_generate(capsys, sampling, "--greedy", "--seed", str(s)) for s in (1, 2)]
    assert greedy[0] == greedy[1]
    greedy_dir = save_tiny(tmp_path / "greedy", generation={"do_sample": False}, flat=True)
    assert run_generate(capsys, greedy_dir, "--seed", "1") == run_generate(capsys, greedy_dir, "--seed", "2")
    assert run_generate(capsys, greedy_dir, "--do-sample", "--temperature", "5", "--seed", "1") != \
        run_generate(capsys, greedy_dir, "--do-sample", "--temperature", "5", "--seed", "2")


def test_generate_passes_method_options_and_rejects_bad_ones(tmp_path, capsys):
    directory = save_tiny(tmp_path / "m")
    run_generate(capsys, directory, "--method", "streamingllm", "--method-option", "sink_size=2", "--greedy")
    assert parse_options(["sink_size=2", "selection=random", "official=true", "ratio=0.5"]) == {
        "sink_size": 2, "selection": "random", "official": True, "ratio": 0.5}
    with pytest.raises(ValueError, match="key=value"):
        parse_options(["sink_size"])
    with pytest.raises(SystemExit):
        run_generate(capsys, directory, "--greedy", "--temperature", "0.5")
    with pytest.raises(SystemExit):
        run_generate(capsys, directory, "--method", "streamingllm", "--method-option", "no_such_field=1")
    assert "no_such_field" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_generate_samples_when_its_config_says_so(smollm2, monkeypatch, capsys):
    """``dynts generate --model smollm2-135m``: greedy under SmolLM2's shipped config (no
    do_sample), sampling once that config turns it on, with no flag passed."""
    import dynts.generate_cli

    model, tokenizer = smollm2
    monkeypatch.setattr(dynts.generate_cli, "load", lambda name, **kw: (model, tokenizer))
    assert not model.generation_config.do_sample
    assert run_generate(capsys, "smollm2-135m", "--seed", "1") == run_generate(capsys, "smollm2-135m", "--seed", "2")
    monkeypatch.setattr(model, "generation_config", GenerationConfig(**{**model.generation_config.to_dict(),
                                                                        "do_sample": True, "temperature": 1.5}))
    assert run_generate(capsys, "smollm2-135m", "--seed", "1") != run_generate(capsys, "smollm2-135m", "--seed", "2")


@pytest.mark.parametrize("command", ["demo", "demo-smollm2", "generate", "eval", "rescue bench", "rescue generate",
                                     "rescue calibrate", "analyze traces", "analyze pareto"])
def test_every_model_command_takes_the_loading_flags(command, capsys):
    from dynts import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main([*command.split(), "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--dtype", "--device", "--device-map", "--attn-implementation", "--adapter"):
        assert flag in out, (command, flag)
