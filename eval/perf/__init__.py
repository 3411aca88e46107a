"""Performance benches: what eviction costs per decode step, apart from accuracy.

The decode cost of a bounded cache by position against the full cache (:mod:`.decode_bench`, its
output :mod:`.decode_report`; ``scripts/bench_decode.py`` and ``scripts/gpu_check.py``), the per-step
cost of the vLLM worker hooks on a stand-in model runner (:mod:`.vllm_hooks_bench`;
``scripts/bench_vllm_hooks.py``) and the host-device sync counter they and ``scripts/bench_serve_vllm.py``
use (:mod:`.syncs`).

May import ``dynts`` only; no other room imports it (the scripts and ``scripts/gpu_check.py`` do).
"""
