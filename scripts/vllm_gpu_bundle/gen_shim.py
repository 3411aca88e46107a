"""Generate ``vllm/_C_stable_libtorch.py``, a pure-Python stand-in for vLLM's compiled ``_C_stable_libtorch``.

    python gen_shim.py UNPACKED_WHEEL_DIR OUT.py

It declares the op schemas (read from the real ``.so`` files with ``strings``) of every ``torch.ops.<ns>.<op>``
that vLLM's Python code names outside a ``hasattr`` guard, so import-time lookups such as
``torch.ops._C.silu_and_mul.default`` succeed; implements in PyTorch the few ops a TRITON_ATTN + native-custom-op
+ V2-runner + CUDA-graph run calls (``weak_ref_tensor``, ``get_cuda_view_from_cpu_tensor``, the shared-memory
query); answers "not supported" to capability probes (``..._supported(int) -> bool``). Any other compiled op
raises when called ("Could not run '_C::<op>' ... CUDA backend"): a path that needs a real kernel fails loudly.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

NAMESPACES = ("_C", "_C_cache_ops", "_C_cuda_utils", "_C_custom_ar", "_moe_C")
EXTENSIONS = ("vllm/_moe_C_stable_libtorch.abi3.so", "vllm/_C_stable_libtorch.abi3.so")  # later ones win


def schemas(so: str) -> dict[str, dict[str, str]]:
    """``{op: {overload: schema}}`` of every op schema string in the shared object ``so``."""
    found: dict[str, dict[str, str]] = {}
    text = subprocess.run(["strings", "-n", "8", so], capture_output=True, text=True, check=True).stdout
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_0-9]+)(\.[A-Za-z_0-9]+)?\((.*)\) -> ", line)
        if m:
            found.setdefault(m.group(1), {}).setdefault(m.group(2) or "", re.sub(r"\s+", " ", line))
    return found


def referenced_ops(package_dir: str) -> set[tuple[str, str]]:
    """Every ``(namespace, op)`` of a ``torch.ops.<namespace>.<op>`` attribute in the package's ``.py`` files."""
    refs = set()
    for folder, _, files in os.walk(package_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for n in ast.walk(tree):
                if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr in NAMESPACES
                        and isinstance(n.value.value, ast.Attribute) and n.value.value.attr == "ops"):
                    refs.add((n.value.attr, n.attr))
    return refs


TEMPLATE = '''# SPDX-License-Identifier: Apache-2.0
"""Pure-Python stand-in for vllm/_C_stable_libtorch.abi3.so (generated).

Declares the schemas of the compiled ops that vLLM's Python code names, and implements
the handful used by a TRITON_ATTN + native-custom-op + CUDA-graph run in PyTorch.
Calling any other op fails with "Could not run '_C::<op>' ... CUDA backend".
"""
import torch

_SCHEMAS = %s

_LIBS = {}
for _ns, _schema in _SCHEMAS:
    _lib = _LIBS.get(_ns) or _LIBS.setdefault(_ns, torch.library.Library(_ns, "FRAGMENT"))
    _lib.define(_schema)


def _weak_ref_tensor(t):
    # Same storage, no ownership (like the C++ from_blob without deleter).
    st = t.untyped_storage()
    s = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        s, t.storage_offset(), t.size(), t.stride())


class _CAI:
    # Owns the pinned CPU tensor; exposes its bytes through __cuda_array_interface__.
    def __init__(self, t):
        st = t.untyped_storage()
        self._keep = t
        self.__cuda_array_interface__ = {
            "shape": (st.nbytes(),), "typestr": "|u1", "data": (st.data_ptr(), False),
            "version": 3, "strides": None}


def _get_cuda_view_from_cpu_tensor(t):
    # UVA: a pinned host buffer is addressable from the GPU at the same pointer.
    assert t.is_pinned(), "get_cuda_view_from_cpu_tensor needs a pinned tensor"
    raw = torch.as_tensor(_CAI(t), device="cuda")
    return raw.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())


def _max_smem(device_id):
    return int(torch.cuda.get_device_properties(device_id).shared_memory_per_block_optin)


def _false(*args, **kwargs):
    return False


# Capability probes ("..._supported(int) -> bool", no tensor args) are called at import
# time (e.g. w8a8_utils.cutlass_block_fp8_supported): answer "not supported".
for _ns, _schema in _SCHEMAS:
    _name, _rest = _schema.split("(", 1)
    _args, _ret = _rest.rsplit(") ->", 1)
    if "Tensor" not in _args and _ret.strip() == "bool" and "." not in _name:
        _LIBS[_ns].impl(_name, _false, "CompositeExplicitAutograd")
_LIBS["_C"].impl("machete_supported_schedules", lambda *a: [], "CompositeExplicitAutograd")

_C = _LIBS["_C"]
_C.impl("weak_ref_tensor", _weak_ref_tensor, "CUDA")
_C.impl("weak_ref_tensor", _weak_ref_tensor, "CPU")
_C.impl("get_cuda_view_from_cpu_tensor", _get_cuda_view_from_cpu_tensor, "CPU")
if "_C_cuda_utils" in _LIBS:
    _LIBS["_C_cuda_utils"].impl(
        "get_max_shared_memory_per_block_device_attribute", _max_smem,
        "CompositeExplicitAutograd")
'''


def main(wheel_dir: str, out_path: str) -> None:
    known: dict[str, dict[str, str]] = {}
    for so in EXTENSIONS:
        known.update(schemas(os.path.join(wheel_dir, so)))
    defs = sorted((ns, schema) for ns, op in referenced_ops(os.path.join(wheel_dir, "vllm")) if op in known
                  for _, schema in sorted(known[op].items()))
    if not any(ns == "_C" and schema.startswith("weak_ref_tensor(") for ns, schema in defs):
        sys.exit("gen_shim: no _C::weak_ref_tensor schema found (a vLLM change): the shim would not run CUDA graphs")
    source = TEMPLATE % ("[\n" + "".join(f"    ({ns!r}, {s!r}),\n" for ns, s in defs) + "]")
    with open(out_path, "w") as f:
        f.write(source)
    print(f"gen_shim: {len(defs)} op schemas, {len(source)} bytes -> {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
