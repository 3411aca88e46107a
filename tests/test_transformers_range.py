"""The supported transformers range is checked at ``import dynts`` (every path), in one place."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import dynts
from dynts import hf_compat
from dynts.hf_compat import SUPPORTED_TRANSFORMERS, cache_keyword, check_transformers_version

ROOT = Path(__file__).resolve().parents[1]


def _import_with_version(version: str, statement: str = "import dynts") -> subprocess.CompletedProcess:
    """Run ``statement`` in a fresh interpreter whose transformers reports ``version``."""
    code = f"import transformers; transformers.__version__ = {version!r}; {statement}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("version", ["5.16.1", "5.26.0", "5.26.0.dev0", "6.0.0", "4.57.1"])
def test_outside_the_range_is_refused_with_the_fix(version):
    with pytest.raises(ImportError) as error:
        check_transformers_version(version)
    message = str(error.value)
    assert f"found transformers {version}" in message
    assert ">=5.17.0,<5.26.0" in message
    assert "pip install 'transformers>=5.17,<5.26'" in message


@pytest.mark.parametrize("version", ["5.17.0", "5.17.1", "5.19.0", "5.24.0", "5.24.3", "5.25.0", "5.25.2", "5.25.0rc1"])
def test_inside_the_range_is_accepted(version):
    check_transformers_version(version)


def test_the_installed_release_is_accepted():
    check_transformers_version()
    assert hf_compat.SUPPORTED_TRANSFORMERS == ("5.17.0", "5.26.0")


@pytest.mark.parametrize("statement", ["import dynts", "from dynts.rescue import rows", "import dynts.cache"])
def test_import_refuses_a_patched_version_string(statement):
    """Any import path that reaches the bounded cache runs the check first (a subprocess: no module reloads)."""
    result = _import_with_version("5.16.1", statement)
    assert result.returncode != 0
    assert "ImportError: dynts supports transformers>=5.17.0,<5.26.0" in result.stderr
    assert "found transformers 5.16.1" in result.stderr
    assert "pip install 'transformers>=5.17,<5.26'" in result.stderr


def test_reload_with_a_patched_version_raises(monkeypatch):
    """The same check when the module is re-executed in this process."""
    import importlib

    monkeypatch.setattr(transformers, "__version__", "5.26.0")
    with pytest.raises(ImportError, match=r"found transformers 5\.26\.0"):
        importlib.reload(hf_compat)
    monkeypatch.undo()
    importlib.reload(hf_compat)  # restore the module's state for the tests that follow


def _pyproject_transformers(extra: str | None = None) -> SpecifierSet:
    """The transformers specifier of pyproject.toml's core dependencies (or of ``extra``)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    (spec,) = [Requirement(line).specifier for line in lines if Requirement(line).name == "transformers"]
    return spec


def _short(version: str) -> str:
    """pyproject and the install hint write 5.17, the check 5.17.0."""
    return ".".join(version.split(".")[:2])


def _as_specifier(supported: tuple[str, str]) -> SpecifierSet:
    low, high = supported
    return SpecifierSet(f">={_short(low)},<{_short(high)}")


def test_pyproject_states_the_same_range():
    """pyproject.toml's core pin, hf_compat's import check and its install hint say the same range."""
    assert _pyproject_transformers() == _as_specifier(SUPPORTED_TRANSFORMERS)
    low, high = SUPPORTED_TRANSFORMERS
    assert hf_compat.INSTALL_HINT == f"pip install 'transformers>={_short(low)},<{_short(high)}'"  # users copy it
    for version in ("5.16.1", *SUPPORTED_TRANSFORMERS, "5.25.0", "6.0.0"):
        inside = _pyproject_transformers().contains(version)
        try:
            check_transformers_version(version)
            accepted = True
        except ImportError:
            accepted = False
        assert accepted == inside, (version, accepted, inside)


def test_serve_extra_states_the_serving_range():
    """The ``serve`` extra's pin and ``dynts.serving``'s import check say the same range, inside the core's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_compat", ROOT / "dynts" / "serving" / "compat.py")
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)  # the module alone: dynts.serving itself refuses a release outside its range
    assert _pyproject_transformers("serve") == _as_specifier(compat.SUPPORTED_TRANSFORMERS)
    low, high = (Version(v) for v in compat.SUPPORTED_TRANSFORMERS)
    assert Version(SUPPORTED_TRANSFORMERS[0]) <= low and high <= Version(SUPPORTED_TRANSFORMERS[1])


def test_cache_keyword_follows_the_forward_signature(qwen2):
    major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert cache_keyword(qwen2) == ("cache" if major_minor >= (5, 24) else "past_key_values")

    class Legacy(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return past_key_values

    assert cache_keyword(Legacy()) == "past_key_values"


def test_attach_routes_cache_to_a_past_key_values_model():
    """``model(..., cache=bounded)`` inside ``dynts.attach`` reaches a model whose forward takes
    ``past_key_values`` (transformers 5.17-5.23): the keyword is moved, not silently dropped."""
    seen = {}

    class Legacy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
            seen["past_key_values"], seen["kwargs"] = past_key_values, kwargs
            past_key_values.layers[0].update(torch.zeros(1, 1, input_ids.shape[1], 2), torch.zeros(1, 1, input_ids.shape[1], 2))
            return None

    model = Legacy()
    cache = dynts.BoundedCache(1, dynts.make_evictor("full"))
    with dynts.attach(model, cache):
        model(input_ids=torch.ones(1, 3, dtype=torch.long), cache=cache)
    assert seen["past_key_values"] is cache and "cache" not in seen["kwargs"]
    assert cache.seen == 3
