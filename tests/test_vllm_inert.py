"""Installing dynts never stops a vLLM engine that does not ask for it.

vLLM calls the plugin in every engine process of an environment dynts is installed in. On a release outside
the supported range the plugin installs nothing that changes vLLM: a stock engine starts and is token-identical
to vLLM without dynts (``VLLM_PLUGINS`` naming every plugin but dynts keeps vLLM from loading it), while an engine or a request that asks
for dynts is refused with the supported range. On a supported release a stock engine runs no dynts wrapper per
step. Runs in each vLLM venv (``make check-vllm``: the 0.32 CPU wheel, V1 runner; ``make check-vllm-v2``: the 0.34
build, V2 runner); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs a vLLM CPU build (make check-vllm / make check-vllm-v2)")

from dynts.models import checkpoints_dir  # noqa: E402
from dynts.vllm.compat import SUPPORTED_RELEASES, unsupported_reason  # noqa: E402
from test_vllm_plugin import run_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TESTBED = checkpoints_dir() / "testbed-lrm"
ENV = {"TRITON_INTERPRET": "1"}  # vLLM 0.34's CPU build runs its Triton kernels in the interpreter
ASKS = {"dynts": {"method": "window", "budget": 64}}  # request 2 asks for dynts


def requests(ask: bool) -> list[dict]:
    torch.manual_seed(3)
    out = [{"prompt_token_ids": torch.randint(4, 80, (n,)).tolist(), "max_tokens": 24, "arrive_at_step": step}
           for n, step in [(9, 0), (17, 0), (12, 0), (23, 2)]]
    if ask:
        out[2]["extra_args"] = ASKS
    return out


def tokens(result: dict, skip: str | None = None) -> dict[str, list[int]]:
    return {rid: out["token_ids"] for rid, out in result["outputs"].items() if rid != skip}


@pytest.fixture(scope="module")
def without_dynts(tmp_path_factory) -> dict:
    """The same engine and requests with the plugin not loaded: vLLM as if dynts were not installed."""
    plugins = "dynts_cpu_testbed"  # the 0.34 test bed's own plugin (tests/support/vllm_cpu_testbed), not dynts
    return run_engine(tmp_path_factory.mktemp("stock"), TESTBED, requests(ask=False), env={**ENV, "VLLM_PLUGINS": plugins})


def test_unsupported_release_runs_stock_and_refuses_only_what_asks_for_dynts(tmp_path, without_dynts):
    force = unsupported_reason() is None  # a supported release is made to look unsupported
    needs = "vllm>=0.0.1,<0.0.2" if force else " or ".join(f"vllm>={lo},<{hi}" for lo, hi, _ in SUPPORTED_RELEASES)
    forced = run_engine(tmp_path, TESTBED, requests(ask=True), force_unsupported=force, env=ENV)
    assert forced["wrapped"] == []
    assert tokens(forced, skip="2") == tokens(without_dynts, skip="2")
    assert len(tokens(without_dynts)) == 4 and all(len(t) > 0 for t in tokens(without_dynts).values())
    # the request that asks for dynts gets vLLM's validation error (HTTP 400) naming the range; the rest are served
    assert f"dynts.vllm needs {needs}" in forced["outputs"]["2"]["error"]
    assert forced["outputs"]["2"]["error"].startswith("VLLMValidationError")

    refused = run_engine(tmp_path, TESTBED, requests(ask=False), force_unsupported=force, env=ENV,
                         additional_config={"dynts": {"method": "window", "budget": 64}})
    assert refused["engine_error"].startswith(f"ValueError: dynts.vllm needs {needs}")
    assert "Start vLLM without additional_config['dynts']" in refused["engine_error"]


def test_supported_release_stock_engine_runs_no_wrapper_per_step(tmp_path, without_dynts):
    reason = unsupported_reason()
    if reason is not None:
        pytest.skip(f"the installed vLLM is outside the plugin's range: {reason}")
    stock = run_engine(tmp_path, TESTBED, requests(ask=True), env=ENV)
    assert stock["wrapped"] == []
    assert tokens(stock, skip="2") == tokens(without_dynts, skip="2")
    assert "started without additional_config['dynts']" in stock["outputs"]["2"]["error"]
