"""The driver half of the ``cpu`` backend: never active, so Triton never launches through it."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

__all__ = ["InterpreterOnlyDriver"]


class InterpreterOnlyDriver(DriverBase):
    """Inactive driver whose target is ``cpu`` (what vLLM's CPU platform looks for)."""

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("the dynts test backend launches no Triton kernel: set TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", "x86_64", 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("the dynts test backend has no benchmarker")
