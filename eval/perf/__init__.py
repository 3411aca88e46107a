"""Performance benches: what eviction costs per decode step, apart from accuracy.

The decode cost of a bounded cache by position against the full cache (:mod:`.decode_bench`, its
output :mod:`.decode_report`; ``scripts/bench_decode.py`` and ``scripts/gpu_check.py``), the per-step
cost of the vLLM worker hooks on a stand-in model runner (:mod:`.vllm_hooks_bench`;
``scripts/bench_vllm_hooks.py``: vLLM 0.32's V1 runner, :mod:`.vllm_v1_standin`, or 0.34's V2 runner,
:mod:`.vllm_v2_standin`, sharing :mod:`.vllm_standin`), the V2 hooks between CUDA graph replays of a stand-in
forward (:mod:`.vllm_standin_forward`, :mod:`.vllm_graph_check`) and the host-device sync counter they and
``scripts/bench_serve_vllm.py`` use (:mod:`.syncs`).

May import ``dynts`` only; no other room imports it (the scripts and ``scripts/gpu_check.py`` do).
"""
