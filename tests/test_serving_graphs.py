"""DynTS serving keeps the engine's CUDA graphs: the forward only copies the final-norm output into a
static buffer, and the predictor scores the new tokens after the forward (``update_batch``). On CPU
there are no graphs: the buffered path must give exactly what scoring inside the forward hook gave
(scores, kept sets, tokens); the engine configuration keeps ``use_cuda_graph`` as the caller set it,
except for per-request sampling (host logic inside the sampling step)."""

from __future__ import annotations

import pytest
import torch
from transformers import ContinuousBatchingConfig

import dynts
from conftest import tiny_model
from dynts.predictor import load_predictor
from dynts.models import checkpoints_dir
from dynts.serving import EvictionSettings, init_evicting_batching
from dynts.serving.manager import EvictingBatchingManager, engine_config
from dynts.serving.processor import EvictingBatchProcessor

pytestmark = pytest.mark.usefixtures("one_thread")


def fresh_questions(n: int) -> list[list[int]]:
    from data_pipeline.testbed.task import problem_set, question_tokens

    tok = dynts.models.load_tokenizer("testbed")
    return [tok.convert_tokens_to_ids(question_tokens(p.operands, p.asked)) for p in problem_set("serving-graphs", n)]


def score_in_the_hook(monkeypatch) -> None:
    """The previous path: the predictor runs inside the final-norm hook, during the forward."""

    def no_buffer(self, predictor):
        self.predictor, self.hidden_buffer = None, None

    def score(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        with torch.no_grad():
            self.last_processor.tracker.write_scores(hidden, self.predictor)

    monkeypatch.setattr(EvictingBatchProcessor, "attach_predictor", no_buffer)
    monkeypatch.setattr(EvictingBatchingManager, "_stash_hidden", score)


def serve_and_record(model, tok, predictor, prompts, monkeypatch) -> tuple[list[list[int]], list[tuple]]:
    """Greedy ``generate_batch`` with DynTS; every eviction event's (question length, scores, kept slots)."""
    events = []
    evictor_cls = type(dynts.make_evictor("dynts"))
    call = evictor_cls.__call__

    def recording(self, info):
        kept = call(self, info)
        events.append((info.question_length, info.scores.clone(), kept.clone()))
        return kept

    with monkeypatch.context() as m:
        m.setattr(evictor_cls, "__call__", recording)
        cb = ContinuousBatchingConfig(num_blocks=64, page_size=16, max_batch_tokens=64)
        results = dynts.generate_batch(model, tok, prompts, method="dynts", budget=64, local_window=16,
                                       predictor=predictor, max_new_tokens=200, do_sample=False,
                                       continuous_batching_config=cb)
    return [r.sequence for r in results], events


def test_static_buffer_scores_equal_scoring_in_the_forward(monkeypatch):
    """The testbed LRM and its trained predictor: identical scores at every event, kept sets and tokens."""
    model, tok = dynts.load("testbed", dtype="float32", device="cpu")
    predictor = load_predictor(str(checkpoints_dir() / "testbed-predictor"), model)
    prompts = fresh_questions(4)
    tokens, events = serve_and_record(model, tok, predictor, prompts, monkeypatch)
    with monkeypatch.context() as m:
        score_in_the_hook(m)
        ref_tokens, ref_events = serve_and_record(model, tok, predictor, prompts, m)
    assert tokens == ref_tokens
    assert len(events) == len(ref_events) >= len(prompts)  # every request evicted at least once
    for (q, scores, kept), (ref_q, ref_scores, ref_kept) in zip(events, ref_events):
        assert q == ref_q
        assert not scores.isnan().all()
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(kept, ref_kept)


def test_the_buffer_holds_the_largest_padded_batch():
    """The hook copies the whole (padded) forward; a forward beyond the buffer is a clear error."""
    model = tiny_model("qwen2")
    settings = EvictionSettings("dynts", 32, 4, predictor=dynts.ImportancePredictor(model.config.hidden_size))
    cb = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=24)
    manager = init_evicting_batching(model, settings, continuous_batching_config=cb)
    try:
        processor = manager._create_batch_processor()
        h = model.config.hidden_size
        assert processor.hidden_buffer.shape == (max(24, processor.cb_config.max_requests_per_batch), h)
        hidden = torch.randn(1, 24, h)
        processor.stash_hidden(hidden)
        assert torch.equal(processor.hidden_buffer[:24], hidden[0])
        with pytest.raises(RuntimeError, match="buffer holds"):
            processor.stash_hidden(torch.randn(1, processor.hidden_buffer.shape[0] + 1, h))
    finally:
        manager.destroy()


@pytest.mark.parametrize("configured", [None, True, False, (True, False)])
def test_engine_config_keeps_cuda_graphs_unless_per_request_sampling(configured):
    settings = EvictionSettings("dynts", 64, 8, predictor=dynts.ImportancePredictor(16))
    given = ContinuousBatchingConfig(use_cuda_graph=configured, use_async_batching=True)
    cb = engine_config(given, settings, per_request_sampling=False)
    assert cb.use_cuda_graph == configured and cb.use_async_batching is False and cb.allow_block_sharing is False
    assert engine_config(given, settings, per_request_sampling=True).use_cuda_graph is False
    assert given.use_cuda_graph == configured and given.use_async_batching is True  # the caller's config is untouched


def test_manager_on_a_graph_capable_device_keeps_the_graphs(monkeypatch):
    """With a graph backend (patched: no GPU here), a DynTS manager runs the engine with CUDA graphs as
    asked; per-request sampling turns them off."""
    from transformers.generation.continuous_batching import initialization

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "cuda")
    model = tiny_model("qwen2")
    settings = EvictionSettings("dynts", 32, 4, predictor=dynts.ImportancePredictor(model.config.hidden_size))
    cb = ContinuousBatchingConfig(num_blocks=16, page_size=8, max_batch_tokens=24, use_cuda_graph=True)
    for per_request, graphs in ((False, (True, True)), (True, (False, False))):
        manager = init_evicting_batching(model, settings, continuous_batching_config=cb, per_request_sampling=per_request)
        try:
            assert manager.continuous_batching_config.cuda_graph_booleans == graphs
        finally:
            manager.destroy()
