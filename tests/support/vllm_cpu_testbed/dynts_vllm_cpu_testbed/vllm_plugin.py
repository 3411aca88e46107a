"""vLLM's V2 runner on these CPUs as vLLM runs on a GPU: async scheduling when asked for, sampling that runs.

* vLLM's CPU platform switches async scheduling off (``CpuPlatform.check_and_update_config`` sets
  ``scheduler_config.async_scheduling = False``) although nothing in the engine needs a GPU for it: the engine
  core's batch queue, ``AsyncScheduler``'s one-round lookahead and the V2 runner's async outputs all run on the
  CPU (the CPU worker already turns ``torch.cuda`` events and streams into no-ops). Restore vLLM's own choice
  after the platform's check, so the test bed runs as vLLM runs on a GPU: async scheduling unless the engine
  says ``async_scheduling=False`` (``--no-async-scheduling``).
* vLLM picks its Triton top-k/top-p kernel whenever Triton is present, and that kernel fails in the Triton
  interpreter; the PyTorch path is the one vLLM runs on a CPU without Triton.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """``vllm.general_plugins`` entry point (every vLLM process); idempotent."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False
    check = CpuPlatform.check_and_update_config
    if getattr(check, "__keeps_async__", False):
        return
    original = check.__func__

    def check_and_update_config(cls, vllm_config):
        chosen = vllm_config.scheduler_config.async_scheduling  # vLLM's default resolved already: True unless refused
        original(cls, vllm_config)
        if chosen:
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.__keeps_async__ = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
