"""Test support for vLLM 0.34's CPU build (``make check-vllm-v2``); never installed beside a GPU.

Two pieces, each registered through an entry point:

* ``triton_backend``: a Triton backend named ``cpu`` that compiles nothing. vLLM's CPU platform starts only when
  Triton has a ``cpu`` backend; with ``TRITON_INTERPRET=1`` every Triton kernel of the V2 runner then runs in
  the interpreter.
* ``vllm_plugin``: a ``vllm.general_plugins`` entry that keeps vLLM's async-scheduling choice (on unless an
  engine says ``async_scheduling=False``, as on a GPU; the CPU platform turns it off) and sends top-k/top-p masking to vLLM's PyTorch path (its Triton kernel does
  not run in the interpreter).
"""
