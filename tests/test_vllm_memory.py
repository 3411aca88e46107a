"""The vLLM worker hooks' memory, without vLLM: the engine's ``max_budget`` bounds every request's budget (the slot
table's width), the reserved table never grows, and the profiling round runs the predictor and the evictor at the
engine's limits and leaves the table empty. (The soak on a running engine:
tests/test_vllm_plugin.py::test_the_slot_table_never_grows_across_a_soak_with_budget_overrides.)"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from dynts.core import SlotTable
from dynts.models import checkpoints_dir
from dynts.predictor import ImportancePredictor
from dynts.vllm.config import PluginConfig
from dynts.vllm.memory import HookState, profile_round, slot_table_shape
from eval.perf.vllm_standin import Recording

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_request_budget_above_max_budget_is_refused_with_the_fix():
    config = PluginConfig({"method": "window", "budget": 64, "local_window": 16})
    assert config.max_budget == 64  # the engine's budget by default
    assert config.for_request({"dynts_budget": 48}).bounds.budget == 48
    with pytest.raises(ValueError, match=r"budget=96 exceeds this server's max_budget=64.*'max_budget': 96"):
        config.for_request({"dynts_budget": 96})
    wider = PluginConfig({"method": "window", "budget": 64, "local_window": 16, "max_budget": 128})
    assert wider.for_request({"dynts_budget": 128}).bounds.budget == 128
    assert wider.for_request({"dynts_method": "full"}).bounds is None  # no budget: nothing to hold
    for bad in (32, True, "128", 0):
        with pytest.raises(ValueError, match=r"max_budget=.* must be an int >= the engine's budget"):
            PluginConfig({"method": "window", "budget": 64, "local_window": 16, "max_budget": bad})
    with pytest.raises(ValueError, match=r"budget=64: this server reserved no per-request budget.*'max_budget': 64"):
        PluginConfig({"method": "full"}).for_request({"dynts_method": "window", "dynts_budget": 64,
                                                     "dynts_local_window": 8})


def test_a_fixed_table_never_reallocates():
    table = SlotTable(torch.device("cpu"), rows=3, width=16, fixed=True)
    pointers = [column.data_ptr() for _, column in table.columns()]
    rows = [table.acquire_row() for _ in range(3)]
    table.ensure_width(16)
    with pytest.raises(RuntimeError, match="reserved for 3 rows of 16 slots"):
        table.ensure_width(17)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        table.acquire_row()
    table.release_row(rows[0])
    assert table.acquire_row() == rows[0]
    assert [column.data_ptr() for _, column in table.columns()] == pointers


@pytest.mark.parametrize("method", ["dynts", "sepllm", "window"])
def test_the_profiling_round_runs_at_the_engine_limits_and_leaves_the_table_empty(method):
    """vLLM sizes its KV cache from the peak of its profiling run; the plugin's round there runs the predictor over
    ``max_num_batched_tokens`` hidden states and the evictor over every request row at the table's width."""
    predictor_dir = checkpoints_dir() / "testbed-predictor"
    engine = {"method": method, "budget": 96, "local_window": 16, "max_budget": 128}
    if method == "dynts":
        engine["predictor"] = str(predictor_dir)
    config = PluginConfig(engine)
    from dynts.models import load_tokenizer

    tokenizer = load_tokenizer("testbed")
    config.settings.evictor.bind(tokenizer)
    hidden = 64
    predictor = ImportancePredictor(hidden) if method == "dynts" else None  # as the worker loads it, random weights
    vllm_config = NS(scheduler_config=NS(max_num_seqs=6, max_num_batched_tokens=300),
                     model_config=NS(max_model_len=1024, get_hidden_size=lambda: hidden), cache_config=NS(block_size=16))
    rows, width = slot_table_shape(config, vllm_config)
    state = HookState(config, tokenizer, SlotTable(torch.device("cpu"), rows=rows, width=width, fixed=True), predictor)
    seen: dict[str, tuple] = {}
    if predictor is not None:
        predictor.register_forward_hook(lambda module, args, out: seen.setdefault("predictor", tuple(args[0].shape)))
    config.settings.evictor = recording = Recording(config.settings.evictor)
    profile_round(state, vllm_config, torch.bfloat16)
    positions, kept = recording.calls[0]
    seen["evictor"] = tuple(positions.shape), kept.shape[1]
    assert seen["evictor"][0] == (rows - 1, 128)  # every request row at the full width
    assert seen["evictor"][1] == config.settings.bounds.n_keep(1)
    if predictor is not None:
        assert seen["predictor"] == (300, hidden)
    for name, column in state.table.columns():
        fill = SlotTable.FILL[name]
        assert (column.isnan().all() if fill != fill else (column == fill).all()), name

