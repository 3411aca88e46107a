"""The analysis notebooks (eval/analyses/notebooks/) execute end to end on tiny inputs, so they never rot."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

from data_pipeline.testbed import task
from data_pipeline.testbed.tokenizer import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "eval" / "analyses" / "notebooks"


@pytest.fixture(scope="module")
def tiny_testbed_dir(tmp_path_factory) -> Path:
    """A random tiny model over the testbed vocabulary, saved like a checkpoint."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(task.VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=task.VOCAB.index(task.BOS), eos_token_id=task.VOCAB.index(task.EOS), pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("tiny-testbed")
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def test_notebooks_are_committed_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.fixture(scope="module")
def kernel(tiny_testbed_dir, tmp_path_factory):
    """One kernel for both notebooks (starting one and importing torch, transformers and spaCy costs
    ~20 s); each notebook starts from an empty namespace (``%reset -f``). Parameters: tiny inputs."""
    from jupyter_client.manager import KernelManager

    out = tmp_path_factory.mktemp("notebook-out")
    tiny = {
        "TESTBED_MODEL": str(tiny_testbed_dir), "TESTBED_TRACES": "2", "TESTBED_SAMPLED": "0",
        "MIN_THINK": "24", "MAX_THINK": "40", "PERCENTS": "30", "RUNS": "1", "STRATEGIES": "top,random",
        "SMOLLM2_TRACES": "1", "SMOLLM2_TOKENS": "16", "SMOLLM2_ANSWER_TOKENS": "2", "SMOLLM2_PERCENTS": "30",
        "PARTS": "4", "THREADS": "1", "OUT": str(out),
    }
    env = {**os.environ, **{f"DYNTS_NB_{k}": v for k, v in tiny.items()}}
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(NOTEBOOKS), env=env)
    yield km, out
    km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pareto", "pos_ratio"])
def test_notebook_executes(name, kernel):
    km, out = kernel
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    NotebookClient(nb, timeout=600, km=km, resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    stem = "pos" if name == "pos_ratio" else "pareto"
    figures = sorted(p.relative_to(out).as_posix() for p in out.rglob(f"*{stem}*.png"))
    assert figures == sorted(f"{model}/{stem}{'_deciles' if stem == 'pos' else ''}.png" for model in ("smollm2", "testbed"))
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the testbed and SmolLM2 figures are shown in the notebook
