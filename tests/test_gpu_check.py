"""``scripts/gpu_check.py --dry-run`` runs on CPU (tiny shapes, every code path) and writes its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_check

    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--methods", "window", "dynts"]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and not result["skipped"]
    assert result["tests"]["returncode"] == 0 and "test_cuda.py" in result["tests"]["output_tail"]
    assert {(c["compile"], c["batch"]) for c in result["bench"]} == {(False, 1), (False, 2), (True, 1)}
    for combo in result["bench"]:
        assert [row["position"] for row in combo["rows"]] == [256, 512]
        for row in combo["rows"]:
            assert set(row["methods"]) == {"window", "dynts"}
            for r in row["methods"].values():
                assert r["t_ms"] > 0 and r["speedup"] > 0 and r["peak_kv_bytes"] < row["full_peak_kv_bytes"]
