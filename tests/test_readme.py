"""Every ```python block of README.md runs as written (from the repository root, in order, in one
namespace), with ``max_new_tokens`` capped at ``README_MAX_NEW_TOKENS`` (default 200) to stay fast."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def cap_tokens(code: str, cap: int) -> str:
    return re.sub(r"max_new_tokens=(\d+)", lambda m: f"max_new_tokens={min(int(m.group(1)), cap)}", code)


def test_readme_has_python_examples():
    assert readme_blocks(), "README.md lost its python examples"
    assert (ROOT / "README.md").read_text().startswith("# dynts\n\n```bash\nmake demo")


def test_readme_python_blocks_run(monkeypatch, capsys):
    import torch

    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    cap = int(os.environ.get("README_MAX_NEW_TOKENS", "200"))
    namespace: dict = {"__name__": "__readme__"}
    for i, code in enumerate(readme_blocks()):
        try:
            exec(compile(cap_tokens(code, cap), f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - name the block that failed
            pytest.fail(f"README.md python block {i + 1} raised {type(err).__name__}: {err}\n{code}")
    printed = capsys.readouterr().out
    assert printed.strip(), "the README examples print their results"




def test_readme_first_screen_ends_at_its_first_link_out():
    """What dynts is, the two commands and the three ways to use it on a model come before the first link out, in
    about one screen."""
    lines = (ROOT / "README.md").read_text().splitlines()
    first_link = next(i for i, line in enumerate(lines) if "](" in line)
    assert first_link < 80, f"README's first link out is on line {first_link + 1}"
    screen = "\n".join(lines[:first_link])
    for heading in ("## Use it on your model", "**1. In Python.**", "**2. In vLLM**", "**3. A predictor for a new model.**",
                    "## Results at a glance"):
        assert heading in screen, heading


def test_readme_path_to_a_predictor_for_a_new_model():
    """The pipeline command README gives runs a committed config, whose export lands where ``predictor="auto"``
    looks for that model (``dynts-predictor-<model basename>``), under the name README says."""
    import json

    import yaml

    from dynts.core.settings import EVICTION_FIELDS

    text = (ROOT / "README.md").read_text()
    config = re.search(r"dynts pipeline --config (\S+)", text).group(1)
    pipeline = yaml.safe_load((ROOT / config).read_text())
    export = pipeline["export_dir"]
    assert Path(export).name == f"dynts-predictor-{Path(pipeline['traces']['model']).name}"
    assert f"# -> {export}," in text and 'predictor="auto"' in text and "--predictor auto" in text
    train = yaml.safe_load((ROOT / pipeline["train"]["config"]).read_text())
    assert train["model"]["export_dir"] == export and f"{train['trainer']['max_epochs']} epochs on {train['trainer']['devices']} GPUs" in text
    samples, tokens = pipeline["traces"]["samples_per_question"], pipeline["traces"]["max_new_tokens"]
    assert f"{samples} samples of\nup to {tokens:,} tokens" in text
    assert "(7,500 questions)" in (ROOT / config).read_text() and "7,500 MATH questions" in text  # MATH's train split
    assert f"up to {round(7500 * samples * tokens / 1e6)} M generated tokens" in text
    vllm = re.search(r"--additional-config '(.*?)'", text, re.S).group(1)
    assert set(json.loads(vllm)["dynts"]) <= set(EVICTION_FIELDS)
