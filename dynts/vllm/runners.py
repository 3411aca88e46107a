"""Where the plugin meets vLLM's model runner: the V1 runner (vLLM 0.32, :mod:`dynts.vllm.worker`) or the V2
runner (vLLM 0.34, :mod:`dynts.vllm.worker_v2`), chosen by the release (:func:`dynts.vllm.compat.runner_of`).

Class-level wrappers run once per engine; the per-step ones are bound on the runner object of an engine that
asked for dynts, when its KV cache is allocated (:func:`dynts.vllm.wrapping.bind`):

| runner | method | what dynts adds |
|---|---|---|
| both | ``profile_run`` | the hooks' persistent state (tokenizer, evictor, the fixed slot table, the predictor: :class:`~dynts.vllm.memory.HookState`) is made inside vLLM's memory profile, and one dummy eviction round at the engine's limits runs there (:func:`~dynts.vllm.memory.profile_round`): vLLM sizes the KV cache without their memory |
| both | ``initialize_kv_cache`` | builds and checks the worker hooks on that state (layout, KV groups and their kind, cross-layer KV sharing, kernel blocks, tokenizer, predictor), compiles the eviction kernels (:func:`dynts.kernels.warm_up_kernels`); binds the rest |
| both | ``Worker.determine_available_memory`` (and the CPU worker's) | where vLLM measured no profile (the CPU worker's fixed KV space, an explicit ``kv_cache_memory_bytes``), the hooks' device bytes from the shapes (:func:`~dynts.vllm.memory.hooks_bytes`) are charged against the KV cache |
| V1 | ``execute_model`` / ``_prepare_inputs`` / ``_model_forward`` (bound) | :class:`~dynts.vllm.worker.WorkerHooks`: events, recording, scores |
| V1 | ``execute_model``, ``sample_tokens`` (bound) | requests the worker failed (an event for a request it does not track) ride on the round's ``ModelRunnerOutput`` to the scheduler (:func:`report_faults`) |
| V2 | ``execute_model`` (bound) | :class:`~dynts.vllm.worker_v2.RunnerV2Hooks`: events before the round's block writes |
| V2 | ``prepare_attn`` (bound) | recording; ``seq_lens`` and slot mappings from the stored slots, RoPE on logical positions |
| V2 | ``sample_tokens`` (bound) | scores after vLLM's sampling (its copy of the sampled tokens queued first) |
| V2 | ``execute_model``, ``sample_tokens`` (bound) | requests the worker failed (a broken invariant) ride on the round's ``ModelRunnerOutput`` to the scheduler (:func:`report_faults`) |
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ..kernels import warm_up_kernels
from .checks import check_kv_sharing
from .config import PluginConfig
from .memory import hooks_bytes, profile_round
from .worker import WorkerHooks
from .worker_v2 import RunnerV2Hooks
from .wrapping import bind, wrap

__all__ = ["install_runner", "report_faults"]


def _profiling(args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("is_profiling") or (args and args[0] is True))


def _bind_v1(runner: Any) -> None:
    def execute(original: Callable) -> Callable:
        def execute_model(self, scheduler_output, *args, **kwargs):
            self._dynts.before_step(scheduler_output)
            return report_faults(self._dynts, original(self, scheduler_output, *args, **kwargs))
        return execute_model

    def prepare(original: Callable) -> Callable:
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
            self._dynts.after_prepare_inputs(num_scheduled_tokens)
            return out
        return _prepare_inputs

    def forward(original: Callable) -> Callable:
        def _model_forward(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            self._dynts.after_forward(out)
            return out
        return _model_forward

    bind(runner, "execute_model", execute)
    bind(runner, "_prepare_inputs", prepare)
    bind(runner, "_model_forward", forward)
    bind(runner, "sample_tokens", _reporting_faults)


def _bind_v2(runner: Any) -> None:
    def execute(original: Callable) -> Callable:
        def execute_model(self, scheduler_output, *args, **kwargs):
            if kwargs.get("dummy_run") or (len(args) > 1 and args[1]):  # profiling, warm-up, capture, DP padding
                return original(self, scheduler_output, *args, **kwargs)
            self._dynts.before_step(scheduler_output)
            out = original(self, scheduler_output, *args, **kwargs)
            self._dynts.after_execute()
            return report_faults(self._dynts, out)
        return execute_model

    def attention(original: Callable) -> Callable:
        def prepare_attn(self, input_batch):
            stored_positions = self._dynts.before_attention(input_batch)
            if stored_positions is None:
                return original(self, input_batch)
            logical = input_batch.positions  # RoPE reads these; slot mappings the stored ones
            input_batch.positions = stored_positions
            try:
                return original(self, input_batch)
            finally:
                input_batch.positions = logical
        return prepare_attn

    def sample(original: Callable) -> Callable:
        def sample_tokens(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            self._dynts.after_sample()  # the predictor queued after the sampled tokens' copy to the host
            return report_faults(self._dynts, out)
        return sample_tokens

    bind(runner, "execute_model", execute)
    bind(runner, "prepare_attn", attention)
    bind(runner, "sample_tokens", sample)


def _profiled(worker: Any) -> bool:
    """Whether vLLM sized this worker's KV cache from a memory profile that saw the hooks' state and dummy round
    (a CUDA worker without an explicit ``kv_cache_memory_bytes``)."""
    runner = getattr(worker, "model_runner", None)
    state = getattr(runner, "_dynts_state", None)
    return (state is not None and state.table.device.type == "cuda"
            and not getattr(worker.cache_config, "kv_cache_memory_bytes", None))


def _reporting_faults(original: Callable) -> Callable:
    def sample_tokens(self, *args, **kwargs):
        return report_faults(self._dynts, original(self, *args, **kwargs))
    return sample_tokens


def report_faults(hooks: WorkerHooks, output: Any) -> Any:
    """Hand the requests the worker failed this round (:meth:`WorkerHooks.take_faults`) to the scheduler on the
    round's ``ModelRunnerOutput`` (``dynts_faults``: request id -> why; pickled with it to the engine core under a
    multi-process executor). V2's ``AsyncOutput`` returns the ``ModelRunnerOutput`` it holds; a bare one is
    copied first (it may be vLLM's shared empty output). Without an output to carry them they wait for the next."""
    if output is None or not hooks.faults:
        return output
    target = getattr(output, "model_runner_output", output)
    if not hasattr(target, "req_ids"):  # an intermediate pipeline stage's tensors
        return output
    if target is output:
        output = target = copy.copy(output)
    target.dynts_faults = {**(getattr(target, "dynts_faults", None) or {}), **hooks.take_faults()}
    return output


RUNNERS = {  # runner -> (module, hooks, the attribute holding the kernel block sizes, binder)
    "v1": ("vllm.v1.worker.gpu_model_runner", WorkerHooks, "_kernel_block_sizes", _bind_v1),
    "v2": ("vllm.v1.worker.gpu.model_runner", RunnerV2Hooks, "kernel_block_sizes", _bind_v2),
}


def install_runner(kind: str) -> None:
    """Wrap the model runner the plugin drives on this release (``"v1"`` or ``"v2"``) and the workers' memory
    report."""
    import importlib

    from vllm.v1.worker.gpu_worker import Worker

    module, hooks_cls, kernel_attr, binder = RUNNERS[kind]
    runner_cls = importlib.import_module(module).GPUModelRunner
    workers = [Worker]
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker

        workers.append(CPUWorker)
    except ImportError:  # a build without the CPU worker
        pass

    def init_cache(original: Callable) -> Callable:
        def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
            original(self, kv_cache_config, *args, **kwargs)
            if _profiling(args, kwargs):
                return
            state = getattr(self, "_dynts_state", None)  # made in the profiling run, where vLLM profiled
            config = state.config if state is not None else PluginConfig.from_vllm(self.vllm_config)
            if config is not None:
                check_kv_sharing(self)
            # built and checked now (backend layout, KV groups, kernel blocks, tokenizer, predictor), not at a request
            self._dynts = hooks_cls(self, config, getattr(self, kernel_attr, None), state) if config else None
            if self._dynts is not None:  # Triton compiles the round's kernels now, not at the first eviction round
                warm_up_kernels(self._dynts.kv)
            if config is not None and "execute_model" not in vars(self):  # once, even if the cache is rebuilt
                binder(self)
        return initialize_kv_cache

    def profile(original: Callable) -> Callable:
        def profile_run(self, *args, **kwargs):
            original(self, *args, **kwargs)
            state = getattr(self, "_dynts_state", None)
            if state is None:
                config = PluginConfig.from_vllm(self.vllm_config)
                if config is None:
                    return
                state = self._dynts_state = hooks_cls.reserve(self, config)
            profile_round(state, self.vllm_config, self.model_config.dtype)
        return profile_run

    def available(original: Callable) -> Callable:
        def determine_available_memory(self, *args, **kwargs):
            free = original(self, *args, **kwargs)
            config = PluginConfig.from_vllm(self.vllm_config)
            if config is None or _profiled(self):
                return free
            return max(0, free - hooks_bytes(config, self.vllm_config))
        return determine_available_memory

    wrap(runner_cls, "profile_run", profile)
    wrap(runner_cls, "initialize_kv_cache", init_cache)
    for worker in workers:
        if "determine_available_memory" in vars(worker):  # each class that defines its own
            wrap(worker, "determine_available_memory", available)
