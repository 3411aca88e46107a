"""``python -m eval.perf.vllm_gpu_bundle`` where no bundle is carried but vLLM's CUDA wheel is installed:
``dynts vllm-check`` on a GPU, vLLM 0.34's V2 runner at vLLM's defaults (async scheduling) with FULL_AND_PIECEWISE
CUDA graphs, on FLASH_ATTN with FA2 and with FA3.

Each run is ``python -m dynts.cli vllm-check`` in its own process (vLLM keeps process-wide state) on a small
random-init Llama with the R1-7B attention head (4 KV heads, head 128; the testbed tokenizer and its chat template)
in bfloat16 (FlashAttention takes no float32), StreamingLLM evicting, each request beside a non-evicting control;
then the testbed LRM with its DynTS predictor on FA2. A bfloat16 run that is inconclusive (exit 4: its control
without eviction already diverges) is rerun in float32 on TRITON_ATTN with the same graphs, and that decisive run
decides; the section passes only when every run is exact, and each run says which run decided it. Skipped, with the
reason, where vLLM is not installed or is not a release on the V2 runner.
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

__all__ = ["FLOAT32", "RUNS", "VERDICTS", "float32_command", "tiny_r1_model", "verdict", "vllm_v2_check"]

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


# ``dynts vllm-check`` exit statuses (dynts.vllm.selfcheck) and what each makes of a run
VERDICTS = {0: "exact", 1: "mismatch", 2: "error", 3: "error", 4: "inconclusive"}
# the decisive rerun of an inconclusive bfloat16 run: float32 on a backend that takes it, same graphs
FLOAT32 = ["--dtype", "float32", "--attention-backend", "TRITON_ATTN"]


def float32_command(command: list[str]) -> list[str]:
    """The same ``vllm-check`` in float32 on TRITON_ATTN (FlashAttention takes no float32), graphs and model kept."""
    out, skip = [], 0
    for i, arg in enumerate(command):
        if skip:
            skip -= 1
            continue
        if arg in ("--dtype", "--attention-backend", "--flash-attn-version"):
            skip = 1
            continue
        if arg == "--json":
            out += [arg, command[i + 1].replace(".json", "-float32.json")]
            skip = 1
            continue
        out.append(arg)
    at = out.index("vllm-check") + 2  # after the model
    return out[:at] + FLOAT32 + out[at:]


def verdict(run: dict) -> str:
    """A run's verdict: ``exact`` or ``mismatch`` from the run that decided it (the bfloat16 run, or the float32 rerun
    of an inconclusive one); ``inconclusive`` when no decisive run could decide; ``error`` otherwise. Only ``exact``
    passes."""
    decided = run.get("float32", run) if run.get("status") == 4 else run
    return VERDICTS.get(decided.get("status"), "error") if "status" in decided else "inconclusive"


def _run_check(command: list[str], json_path: Path, seconds: float) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
        status, tail = proc.returncode, proc.stdout[-3000:] + proc.stderr[-1500:]
    except subprocess.TimeoutExpired:
        status, tail = None, "timed out"
    result = json.loads(json_path.read_text()) if json_path.exists() else {}
    return {"status": status, "engine": result.get("engine"), "requests": result.get("requests"),
            "seconds": time.perf_counter() - t0, "output_tail": tail if status else tail[-600:]}


def vllm_v2_check(dry_run: bool, seconds: float = 420.0) -> dict:
    """Run :data:`RUNS` until ``seconds`` are spent; each run's verdict, engine line and seconds.

    Inconclusive is not a pass: a bfloat16 run that exits 4 (its control already diverges: numerics) is rerun in
    float32 on TRITON_ATTN under the same graphs, and that decisive run decides (``decided_by``). The section is ok
    only when every run is ``exact``."""
    reason = skip_reason()
    if reason is not None:
        print(f"vllm_v2: skipped: {reason}", flush=True)
        return {"skipped": reason}
    from dynts.models import checkpoints_dir

    root = Path(tempfile.mkdtemp(prefix="vllm-check-"))
    models = {"tiny-r1": str(tiny_r1_model(root)), "testbed": "testbed"}
    started, runs = time.perf_counter(), []
    left = lambda: seconds - (time.perf_counter() - started)  # noqa: E731
    for label, model, version, extra in RUNS:
        extra = [str(checkpoints_dir() / "testbed-predictor") if x == "PREDICTOR" else x for x in extra]
        command = [sys.executable, "-m", "dynts.cli", "vllm-check", models[model], "--dtype", "bfloat16",
                   "--attention-backend", "FLASH_ATTN", "--flash-attn-version", str(version), "--cudagraph-mode", GRAPHS,
                   "--gpu-memory-utilization", "0.5", "--json", str(root / f"{label}.json"), *extra]
        if dry_run:  # on CPU: the commands only (FlashAttention and CUDA graphs need the GPU)
            runs.append({"label": label, "command": command, "float32_command": float32_command(command)})
            continue
        if left() < 60:
            runs.append({"label": label, "skipped": "out of time", "verdict": "inconclusive", "decided_by": None})
            continue
        run = {"label": label, **_run_check(command, root / f"{label}.json", left())}
        run["decided_by"] = "bfloat16"
        if run["status"] == 4:  # inconclusive: a float32 run decides
            run["decided_by"] = None
            if left() >= 60:
                run["float32"] = _run_check(float32_command(command), root / f"{label}-float32.json", left())
                run["decided_by"] = "float32"
        run["verdict"] = verdict(run)
        runs.append(run)
        print(f"vllm_v2 {label}: {run['verdict']} (decided by {run['decided_by']}; status {run['status']}"
              f"{', float32 status %s' % run['float32']['status'] if 'float32' in run else ''}) "
              f"{json.dumps(run.get('engine'))}", flush=True)
    if dry_run:
        return {"runs": runs, "ok": True, "dry_run": True}
    verdicts = [r["verdict"] for r in runs]
    return {"runs": runs, "verdicts": verdicts, "ok": bool(verdicts) and all(v == "exact" for v in verdicts)}
