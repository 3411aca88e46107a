#!/usr/bin/env bash
# Build the carry bundle: vLLM 0.34.0 as pure Python plus the dependencies the GPU image lacks, as wheels in
# OUT/wheels (default .vllm-gpu-bundle under the checkout's root; `make vllm-gpu-bundle`). A GPU run carries OUT
# (the device tool's `carry`, 64 MiB a call with the working tree) and installs it with
# `pip install --no-index --no-deps --target DIR OUT/wheels/*.whl` (python -m eval.perf.vllm_gpu_bundle does on the GPU).
#
#   scripts/vllm_gpu_bundle/build.sh [OUT] [CACHE]
#
# CACHE (default .vllm-gpu-bundle-cache) keeps vLLM's CUDA wheel (239 MB, downloaded once from PyPI) and the
# intermediate files. Steps: the CUDA wheel's Python files without its compiled parts (strip_wheel.py), a generated
# stand-in for vllm/_C_stable_libtorch (gen_shim.py), a one-line patch to vllm/vllm_flash_attn/__init__.py (it
# raises when the FA2/FA3 binaries are absent), then requirements-bundle.txt as CPython 3.12 manylinux wheels.
# Fails when the wheels exceed MAX_MIB (default 40).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-$ROOT/.vllm-gpu-bundle}
CACHE=${2:-$ROOT/.vllm-gpu-bundle-cache}
MAX_MIB=${MAX_MIB:-40}
PY=${PYTHON:-python3}
VLLM_VERSION=0.34.0
CUDA_WHEEL=vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
# The GPU image: CPython 3.12 on x86-64 Linux (glibc >= 2.35).
PLATFORM=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_35_x86_64
          --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)

mkdir -p "$CACHE/cuda"
if [ ! -f "$CACHE/cuda/$CUDA_WHEEL" ]; then
    echo "downloading vLLM $VLLM_VERSION's CUDA wheel (239 MB, once) into $CACHE/cuda"
    nice -n 19 "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$CACHE/cuda" "vllm==$VLLM_VERSION"
fi
WHEEL=$CACHE/cuda/$CUDA_WHEEL

# The compiled extensions are read only for their op schemas (gen_shim.py); the .py files for the ops they name.
rm -rf "$CACHE/unpacked" && mkdir -p "$CACHE/unpacked"
unzip -q "$WHEEL" 'vllm/*.py' 'vllm/_C_stable_libtorch.abi3.so' 'vllm/_moe_C_stable_libtorch.abi3.so' \
    -d "$CACHE/unpacked"
"$PY" "$HERE/gen_shim.py" "$CACHE/unpacked" "$CACHE/_C_stable_libtorch.py"
unzip -p "$WHEEL" vllm/vllm_flash_attn/__init__.py | "$PY" "$HERE/patch_flash_attn.py" > "$CACHE/flash_attn_init.py"

rm -rf "$OUT" && mkdir -p "$OUT/wheels"
nice -n 19 "$PY" "$HERE/strip_wheel.py" "$WHEEL" "$OUT/wheels/vllm-$VLLM_VERSION-py3-none-any.whl" \
    "vllm/_C_stable_libtorch.py=$CACHE/_C_stable_libtorch.py" "vllm/vllm_flash_attn/__init__.py=$CACHE/flash_attn_init.py"
nice -n 19 "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT/wheels" -r "$HERE/requirements-bundle.txt"

bytes=$(du -cb "$OUT"/wheels/*.whl | tail -1 | cut -f1)
count=$(ls "$OUT"/wheels/*.whl | wc -l)
"$PY" - "$OUT" "$bytes" "$count" <<'EOF'
import json, sys, time
out, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
json.dump({"vllm": "0.34.0", "python": "cp312", "wheels": count, "bytes": size, "mib": round(size / 2**20, 2),
           "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(f"{out}/bundle.json", "w"), indent=1)
EOF
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "vllm-gpu-bundle: $count wheels, $mib MiB in $OUT/wheels (limit $MAX_MIB MiB)"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
    echo "vllm-gpu-bundle: over $MAX_MIB MiB: a run carries 64 MiB with the working tree" >&2
    exit 1
fi
