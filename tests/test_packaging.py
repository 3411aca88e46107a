"""Packaging: a non-editable install runs ``dynts demo`` from another directory (checkpoints and
configs ship as data files), and each extra declares what its code path imports.

The install test is offline and cheap: the wheel is built without build isolation, installed with
``--no-deps`` into a fresh venv that sees the current environment's packages through a ``.pth``
line (which adds that directory to ``sys.path`` without running its ``.pth`` files, so the
editable install of this checkout stays invisible)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def source_copy(target: Path) -> Path:
    """The tracked files of this checkout (what a clean clone holds); everything when not in git."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / name)
    else:
        shutil.copytree(ROOT, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", "build", "dist"))
    return target


@pytest.mark.slow
def test_wheel_install_runs_the_demo_from_another_directory(tmp_path):
    src = source_copy(tmp_path / "src")
    run = lambda *cmd, **kw: subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)  # noqa: E731
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src))
    wheel = next((tmp_path / "dist").glob("dynts_lrm-*.whl"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    purelib = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (purelib / "parent_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DYNTS_CHECKPOINTS")}
    where = run(str(python), "-c", "import dynts, dynts.models as m; print(dynts.__file__); print(m.checkpoints_dir()); "
                "print(m.configs_dir())", cwd=elsewhere, env=env).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where  # the installed copy, not the source tree
    assert (Path(where[2]) / "testbed" / "lrm.yaml").is_file()
    demo = run(str(venv / "bin" / "dynts"), "demo", "--n", "2", "--max-new-tokens", "24", "--batch-size", "2",
               "--threads", "1", cwd=elsewhere, env=env, timeout=300)
    rows = [line.split("|")[1].strip() for line in demo.stdout.splitlines() if line.startswith("| ")]
    assert {"full", "dynts"} <= set(rows), demo.stdout + demo.stderr  # the short names of the demo's table
    assert "tuned on dev" in demo.stdout and "dynts: W_l=" in demo.stdout, demo.stdout  # its settings under the table
    assert (elsewhere / "runs" / "demo" / "copy" / "results.md").is_file()
    assert (elsewhere / "runs" / "demo" / "chain" / "results.md").is_file()  # both families ship


# ------------------------------------------------------------------ extras match imports

# import name -> distribution name, for every third-party module the packages import
DISTRIBUTIONS = {
    "torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
    "numpy": "numpy", "huggingface_hub": "transformers", "tqdm": "transformers", "triton": "triton",
    "lightning": "lightning", "torchmetrics": "torchmetrics", "datasets": "datasets", "jsonargparse": "jsonargparse",
    "yaml": "pyyaml", "peft": "peft", "scipy": "scipy", "math_verify": "math-verify", "matplotlib": "matplotlib",
    "spacy": "spacy", "vllm": "vllm", "accelerate": "accelerate", "gguf": "gguf", "fastapi": "fastapi", "starlette": "starlette",
    "uvicorn": "uvicorn", "openai": "openai", "nbclient": "nbclient", "nbformat": "nbformat", "kvpress": "kvpress",
    "packaging": "packaging", "prometheus_client": "prometheus-client",
}
FIRST_PARTY = {"dynts", "trainers", "eval", "data_pipeline", "scripts", "conftest"}
# which requirement groups each package's code may rely on
PATHS = {"dynts": ("core", "models", "kernels", "serve", "vllm"), "trainers": ("core", "train"),
         "data_pipeline": ("core", "train", "vllm"), "eval": ("core", "eval", "vllm")}  # eval/perf's vLLM engine runs


def imported_modules(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in FIRST_PARTY}


def requirement_names(requirements: list[str]) -> set[str]:
    out = set()
    for req in requirements:
        name = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        out.add(name.strip().lower())
    return out


@pytest.mark.parametrize("package", sorted(PATHS))
def test_each_extra_declares_what_its_code_imports(package):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    allowed = set().union(*(requirement_names(groups[g]) for g in PATHS[package]))
    unknown = imported_modules(package) - DISTRIBUTIONS.keys()
    assert not unknown, f"{package} imports {sorted(unknown)}: add them to DISTRIBUTIONS and to an extra"
    missing = {DISTRIBUTIONS[m] for m in imported_modules(package)} - allowed
    assert not missing, f"{package} imports {sorted(missing)} but extras {PATHS[package]} do not declare them"
