"""A Triton backend named ``cpu`` that compiles nothing.

vLLM 0.34 on x86 CPUs starts only when ``vllm.triton_utils`` finds a Triton backend called ``cpu``
(``"cpu" in triton.backends.backends``), which PyPI's Triton lacks. This package registers one through
Triton's ``triton.backends`` entry point; its compile stages raise, so every Triton kernel must run in the
interpreter (``TRITON_INTERPRET=1``, set before the engine starts). Never install it beside a GPU.
"""
