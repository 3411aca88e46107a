"""Sharded models: the cache never assumes that the layers, the slot table and the
predictor share one device.

CPU has one real device, so these tests use ``meta`` as the second one: tensors on ``meta`` carry
shapes but no data, and copies go cpu -> meta only, so each test puts the *receiving* side of the
code under test on ``meta``. Meta kernels do not check devices, so :class:`StrictDevices` (a
:class:`~torch.overrides.TorchFunctionMode`) raises, as CUDA does, when one op mixes tensors of two
devices (explicit copies, ``.to`` / ``copy_`` / item assignment, are allowed, as on CUDA), and
:class:`CountCopies` counts the index copies. The
``cuda`` test at the end runs generation with a model split over two GPUs.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import dynts
from dynts.evictors.rkv import RKV
from dynts.predictor import load_predictor
from dynts.kernels import compact_, compact_torch_
from conftest import padded_batch, tiny_model

META = torch.device("meta")


class CountCopies(TorchFunctionMode):
    """Counts ``Tensor.to`` calls per target device type."""

    def __init__(self):
        super().__init__()
        self.to = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.device != args[0].device:
            self.to[out.device.type] = self.to.get(out.device.type, 0) + 1
        return out


class StrictDevices(TorchFunctionMode):
    """Raise when an op other than a copy gets tensors on two devices (0-dim CPU scalars allowed)."""

    COPIES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__setitem__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.COPIES:
            found = set()
            stack = [*args, *kwargs.values()]
            while stack:
                item = stack.pop()
                if isinstance(item, (list, tuple)):
                    stack.extend(item)
                elif isinstance(item, torch.Tensor) and not (item.dim() == 0 and item.device.type == "cpu"):
                    found.add(item.device)
            if len(found) > 1:
                raise RuntimeError(f"{getattr(func, '__name__', func)} mixes devices {sorted(map(str, found))}")
        return func(*args, **kwargs)


def test_strict_devices_catches_a_mixed_op():
    with pytest.raises(RuntimeError, match="mixes devices"), StrictDevices():
        torch.zeros(3, device=META).add_(torch.ones(3))


def test_compaction_copies_the_index_once_per_device(monkeypatch):
    monkeypatch.setenv("DYNTS_KERNELS", "torch")
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(2, 3, 10, 4, generator=g) for _ in range(3)]
    meta = [torch.empty(2, 3, 10, 4, device=META) for _ in range(3)]
    kept = torch.tensor([[0, 2, 3, 7], [1, 4, 5, 9]])
    want = [t.clone() for t in cpu]
    compact_torch_(want, kept, 10)
    with StrictDevices(), CountCopies() as counter:
        compact_([cpu[0], meta[0], cpu[1], meta[1], cpu[2], meta[2]], kept, 10)
    assert counter.to == {"meta": 1}  # three meta layers, one index copy
    for got, ref in zip(cpu, want):
        assert torch.equal(got, ref)
    assert all(t.shape == (2, 3, 10, 4) for t in meta)


def _meta_table_cache(method: str, prompt: int = 12):
    """A cache whose slot table lives on ``meta`` (as on the input GPU) while its layers' K/V
    buffers and the attention rows live on the CPU (another GPU)."""
    cache = dynts.build_cache(tiny_model("qwen2"), dynts.make_evictor(method), dynts.Budget(40, 4, 0.5), observation_window=3)
    ids = torch.randint(3, 100, (2, prompt), device=META)
    cache.begin_forward(ids, None, 2, prompt, META)
    assert cache.positions.device == META
    for layer in cache.layers:  # the layers write their K/V on "their" device (cpu)
        layer.update(torch.randn(2, 2, prompt, 16), torch.randn(2, 2, prompt, 16))
    return cache


@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv"])
def test_statistics_move_to_the_table_device(method):
    cache = _meta_table_cache(method)
    probs = torch.softmax(torch.randn(2, 4, 12, 12), -1)  # computed by a layer on the cpu
    with StrictDevices():
        cache.record_attention(probs[:, :, :5], 0)
        cache.record_attention(probs[:, :, 5:], 5)
    stat = cache.attention if method == "h2o" else cache.window_attention
    assert stat.device == META
    cache.end_forward()
    with StrictDevices():
        info = cache.token_info()
    if method == "rkv":
        assert info.keys.device == META and info.keys.shape == (2, 2, 12, 16)


def test_scores_move_to_the_table_device():
    cache = _meta_table_cache("dynts")
    with StrictDevices():
        cache.write_scores(torch.randn(2, 12))  # the predictor ran on the cpu
    assert cache.scores.device == META


def test_predictor_is_placed_on_the_final_norm_device():
    model = tiny_model("qwen2")
    model.model.norm.to(META)  # the last shard
    predictor = load_predictor(dynts.ImportancePredictor(model.config.hidden_size), model)
    assert next(predictor.parameters()).device == META
    assert next(model.parameters()).device.type == "cpu"


def test_eviction_event_with_layers_on_two_devices(monkeypatch):
    """A full eviction event (selection on the table's device, compaction on each layer's device)
    with one layer's buffers on the cpu and the other's on ``meta``."""
    monkeypatch.setenv("DYNTS_KERNELS", "torch")
    cache = dynts.build_cache(tiny_model("qwen2"), RKV(), dynts.Budget(20, 2, 0.5))
    ids, mask = padded_batch([14, 10])
    cache.begin_forward(ids, mask, 2, 14, torch.device("cpu"))
    keys = torch.randn(2, 2, 14, 16)
    cache.layers[0].update(torch.empty(2, 2, 14, 16, device=META), torch.empty(2, 2, 14, 16, device=META))
    cache.layers[1].update(keys, keys.clone())  # the keys layer of R-KV (the last one)
    cache.record_attention(torch.softmax(torch.randn(2, 4, 14, 14), -1))
    cache.end_forward()
    with StrictDevices():
        for step in range(8):
            cache.begin_forward(torch.tensor([[5], [6]]), None, 2, 1, torch.device("cpu"))
            cache.layers[0].update(torch.empty(2, 2, 1, 16, device=META), torch.empty(2, 2, 1, 16, device=META))
            cache.layers[1].update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16))
            cache.record_attention(torch.softmax(torch.randn(2, 4, 1, cache.length + 1), -1))
            cache.end_forward()
    assert cache.stats.evictions >= 1
    assert cache.layers[0].keys.device == META and cache.layers[1].keys.device.type == "cpu"
    assert cache.length <= 20 and cache.layers[1].keys.shape[2] >= cache.length


# ---------------------------------------------------------------- real split over two GPUs
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("method", ["h2o", "snapkv", "rkv", "dynts"])
def test_generate_with_a_model_split_over_two_gpus(method):
    from accelerate import dispatch_model

    reference = tiny_model("qwen2").to("cuda:0")
    split = dispatch_model(
        tiny_model("qwen2"),
        device_map={"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                    "model.norm": 1, "lm_head": 1},
    )
    predictor = dynts.ImportancePredictor(reference.config.hidden_size) if method == "dynts" else None
    ids, mask = padded_batch([30, 22])
    kw = dict(input_ids=ids, attention_mask=mask, method=method, budget=40, local_window=4, max_new_tokens=48,
              predictor=predictor, think_end=None)
    want = dynts.generate(reference, **kw)
    got = dynts.generate(split, **kw)
    assert got.stats["evictions"] >= 2
    assert got.sequences.cpu().tolist() == want.sequences.cpu().tolist()
    devices = {layer.keys.device for layer in got.cache.layers}
    assert devices == {torch.device("cuda", 0), torch.device("cuda", 1)}
