"""Make a pure-Python vLLM wheel from its CUDA wheel: without the compiled extensions, kernels and C/CUDA sources,
with extra files added (the ``_C_stable_libtorch`` stand-in, the patched ``vllm_flash_attn/__init__.py``), RECORD
and WHEEL rewritten (``py3-none-any``).

    python strip_wheel.py CUDA.whl OUT.whl [ARCNAME=LOCAL_PATH ...]

An ``ARCNAME`` given replaces the wheel's file of that name, or is added.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import sys
import zipfile

DROP_SUFFIX = (".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".cpp", ".c")
DROP_PREFIX = ("vllm/vllm-rs", "vllm/third_party/deep_gemm/", "vllm/third_party/fmha_sm100/", "vllm/third_party/tml_fa4/",
               "vllm/third_party/flashmla/", "vllm/vllm_flash_attn/cute/")
WHEEL = b"Wheel-Version: 1.0\nGenerator: dynts strip_wheel\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def strip(src: str, dst: str, extra: dict[str, str]) -> None:
    zin = zipfile.ZipFile(src)
    dist_info = next(n.split("/")[0] for n in zin.namelist() if n.endswith(".dist-info/WHEEL"))
    record = []
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        def put(name: str, data: bytes) -> None:
            zout.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append([name, f"sha256={digest}", str(len(data))])

        for info in zin.infolist():
            name = info.filename
            if (name.endswith(DROP_SUFFIX) or name.startswith(DROP_PREFIX) or name in extra
                    or name == f"{dist_info}/RECORD"):
                continue
            put(name, WHEEL if name == f"{dist_info}/WHEEL" else zin.read(name))
        for arcname, path in extra.items():
            with open(path, "rb") as f:
                put(arcname, f.read())
        record.append([f"{dist_info}/RECORD", "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(record)
        zout.writestr(f"{dist_info}/RECORD", buf.getvalue())
    print(f"strip_wheel: {dst}: {os.path.getsize(dst) / 2**20:.2f} MiB")


if __name__ == "__main__":
    strip(sys.argv[1], sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:]))
