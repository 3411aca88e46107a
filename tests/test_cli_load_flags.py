"""Every ``dynts`` command that loads a model takes the shared loading flags (``dynts.cli_options``)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from dynts.cli import COMMANDS, main

SHARED = ("--dtype", "--device", "--device-map", "--attn-implementation", "--adapter", "--merge-adapter",
          "--trust-remote-code")
# (sub)commands that load no model weights through dynts.load, and why
LOADS_NO_MODEL = {
    "cost": "reads a config.json only",
    "pipeline": "its YAML config carries every stage's loading options",
    "train-predictor": "LightningCLI: loading options live in its config",
    "testbed train": "trains a bundled toy from scratch",
    "testbed sample": "the bundled CPU testbed checkpoints",
    "testbed report": "the bundled CPU testbed checkpoints",
    "testbed resume-point": "converts a Lightning checkpoint's tensors; loads no model",
    "analyze pos": "a tokenizer only",
    "analyze sparsity": "reads a trace dataset only",
    "vllm-check": "vLLM loads the model (one engine, its --dtype and engine options); the transformers reference mirrors them",
}


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code in (0, None), argv
    return out.getvalue()


def commands() -> list[str]:
    found = []
    for name in COMMANDS:
        text = help_text([name])
        subs = re.search(r"usage: dynts \S+ \[-h\] \{([\w,-]+)\}", text)
        found += [f"{name} {s}" for s in subs.group(1).split(",")] if subs else [name]
    return found


def test_every_command_that_loads_a_model_lists_the_shared_loading_flags():
    missing = {}
    for command in commands():
        if command in LOADS_NO_MODEL:
            continue
        text = help_text(command.split())
        lacking = [flag for flag in SHARED if not re.search(rf"{re.escape(flag)}\b(?![-\w])", text)]
        if lacking:
            missing[command] = lacking
    assert not missing, f"commands without the shared loading flags (dynts.cli_options.add_load_arguments): {missing}"


def test_serve_takes_bf16_defaults_to_one_device_and_refuses_a_device_map():
    from dynts.serving.server import parse_args, resolve_device

    args = parse_args(["testbed", "--dtype", "bf16", "--kv-method", "full"])
    options = resolve_device(args)
    assert options["dtype"] == "bf16" and options["device"] in ("cuda", "cpu")
    with pytest.raises(ValueError, match="one device; use --device cuda:N"):
        resolve_device(parse_args(["testbed", "--device-map", "auto"]))
