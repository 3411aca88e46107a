"""The vLLM engine section of ``scripts/gpu_check.py``: ``dynts vllm-check`` on a GPU, vLLM 0.34's V2 runner at
vLLM's defaults (async scheduling) with FULL_AND_PIECEWISE CUDA graphs, on FLASH_ATTN with FA2 and with FA3.

Each run is ``python -m dynts.cli vllm-check`` in its own process (vLLM keeps process-wide state) on a small
random-init Llama with the R1-7B attention head (4 KV heads, head 128; the testbed tokenizer and its chat template)
in bfloat16 (FlashAttention takes no float32), StreamingLLM evicting, each request beside a non-evicting control;
then the testbed LRM with its DynTS predictor on FA2. Skipped, with the reason, where vLLM is not installed or is
not a release on the V2 runner.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .random_models import random_llama

__all__ = ["RUNS", "tiny_r1_model", "vllm_v2_check"]

GRAPHS = "FULL_AND_PIECEWISE"
RUNS = [  # (label, model, flash_attn_version, extra flags)
    ("fa2-streamingllm", "tiny-r1", 2, []),
    ("fa3-streamingllm", "tiny-r1", 3, []),
    ("fa2-testbed-dynts", "testbed", 2, ["--predictor", "PREDICTOR"]),
]


def tiny_r1_model(root: Path) -> Path:
    """A random-init 2-layer Llama with R1-Distill-7B's attention head shape, saved with the testbed tokenizer."""
    return random_llama(root / "tiny-r1", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)


def skip_reason() -> str | None:
    """Why the engine check cannot run here (``None``: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed here: install vLLM 0.34 beside this checkout (pip install "
                "'dynts-lrm[vllm]') to run dynts vllm-check on this GPU")
    from dynts.vllm.compat import installed_vllm, runner_of

    if runner_of() != "v2":
        return f"vLLM {installed_vllm()} is not a release the plugin drives on the V2 runner (vLLM 0.34)"
    return None


def vllm_v2_check(dry_run: bool, seconds: float = 420.0) -> dict:
    """Run :data:`RUNS` until ``seconds`` are spent; each run's verdict, engine line and seconds."""
    reason = skip_reason()
    if reason is not None:
        print(f"vllm_v2: skipped: {reason}", flush=True)
        return {"skipped": reason}
    from dynts.models import checkpoints_dir

    root = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    models = {"tiny-r1": str(tiny_r1_model(root)), "testbed": "testbed"}
    started, runs = time.perf_counter(), []
    for label, model, version, extra in RUNS:
        extra = [str(checkpoints_dir() / "testbed-predictor") if x == "PREDICTOR" else x for x in extra]
        command = [sys.executable, "-m", "dynts.cli", "vllm-check", models[model], "--dtype", "bfloat16",
                   "--attention-backend", "FLASH_ATTN", "--flash-attn-version", str(version), "--cudagraph-mode", GRAPHS,
                   "--gpu-memory-utilization", "0.5", "--json", str(root / f"{label}.json"), *extra]
        if dry_run:  # on CPU: the commands only (FlashAttention and CUDA graphs need the GPU)
            runs.append({"label": label, "command": command})
            continue
        left = seconds - (time.perf_counter() - started)
        if left < 60:
            runs.append({"label": label, "skipped": "out of time"})
            continue
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=left)
            status, tail = proc.returncode, proc.stdout[-3000:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            status, tail = None, "timed out"
        out = root / f"{label}.json"
        result = json.loads(out.read_text()) if out.exists() else {}
        runs.append({"label": label, "status": status, "engine": result.get("engine"),
                     "requests": result.get("requests"), "seconds": time.perf_counter() - t0,
                     "output_tail": tail if status else tail[-600:]})
        print(f"vllm_v2 {label}: status {status} {json.dumps(result.get('engine'))}", flush=True)
    ran = [r for r in runs if "status" in r]
    return {"runs": runs, "ok": all(r["status"] in (0, 4) for r in ran)}  # 4: inconclusive (bf16 numerics)
