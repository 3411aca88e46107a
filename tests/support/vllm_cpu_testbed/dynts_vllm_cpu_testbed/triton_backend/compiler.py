"""The compiler half of the ``cpu`` backend: it accepts the ``cpu`` target and refuses to compile."""

from __future__ import annotations

from triton.backends.compiler import BaseBackend, GPUTarget

__all__ = ["InterpreterOnlyBackend"]


class InterpreterOnlyBackend(BaseBackend):
    """Claims the ``cpu`` target; any compilation is an error (kernels run under ``TRITON_INTERPRET=1``)."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "dynts-triton-cpu-interpreter-only"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError("the dynts test backend compiles no Triton kernel: set TRITON_INTERPRET=1")

    def add_stages(self, stages: dict, options: object, language=None) -> None:
        raise RuntimeError("the dynts test backend compiles no Triton kernel: set TRITON_INTERPRET=1")

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
