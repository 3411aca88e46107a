"""Per-problem records: the compact, committed form of a cell's results that every table is
recomputed from (``python -m eval.harness.compare DIR --from-records``,
``python -m eval.rescue.table DIR ... --from-records``).

One JSON file per cell, ``<run>/records/<cell key>.json``, written atomically next to the cell::

    {"format": "dynts-records/1", "key": "...", "cell": {...settings: method, budget, ...},
     "ids": ["test:0", ...], "k": 1,
     "bits": {"correct": "<hex>", "looped": "<hex>", ...},
     "ints": {"tokens": [...], ...}}

``bits`` and ``ints`` hold one entry per (question, sample), question-major (entry ``q * k + s``);
a bit field is packed eight entries per byte, most significant bit first, written as hex
(200 questions x 1 sample = 50 hex digits).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dynts.io import write_atomic

__all__ = ["EVAL_BITS", "EVAL_INTS", "EVAL_SEEDS", "FORMAT", "cell_record", "eval_record", "pack_bits", "per_question", "read_records",
           "unpack_bits", "write_record"]

FORMAT = "dynts-records/1"
# what a dynts eval cell keeps per (question, sample): samples/<key>.jsonl fields
EVAL_BITS = ("correct", "looped", "truncated", "answered")
EVAL_INTS = ("tokens", "evictions")
# and, where the samples carry them (runs since the seeds were recorded), each sample's random stream:
# the seed of its generate call and its row in that call
EVAL_SEEDS = ("seed", "row")


def pack_bits(values: Sequence[bool]) -> str:
    """``[True, False, True]`` -> ``"a0"`` (MSB first, zero-padded to whole bytes)."""
    out = bytearray((len(values) + 7) // 8)
    for i, v in enumerate(values):
        if v:
            out[i // 8] |= 0x80 >> (i % 8)
    return out.hex()


def unpack_bits(text: str, n: int) -> list[bool]:
    """The first ``n`` bits of a :func:`pack_bits` string."""
    data = bytes.fromhex(text)
    if len(data) != (n + 7) // 8:
        raise ValueError(f"{len(text)} hex digits cannot hold exactly {n} bits; the record is corrupt or n is wrong")
    return [bool(data[i // 8] & (0x80 >> (i % 8))) for i in range(n)]


def cell_record(key: str, cell: dict[str, Any], ids: Sequence[str], k: int, rows: Sequence[dict[str, Any]],
                bits: Sequence[str], ints: Sequence[str] = ()) -> dict[str, Any]:
    """The record of one cell from its per-(question, sample) ``rows`` in question-major order
    (``len(rows) == len(ids) * k``); ``bits`` / ``ints`` name the row fields kept (a missing
    field reads as False / 0)."""
    if len(rows) != len(ids) * k:
        raise ValueError(f"cell {key}: {len(rows)} rows for {len(ids)} questions x k={k}; give one row per question and sample")
    return {"format": FORMAT, "key": key, "cell": cell, "ids": list(ids), "k": k,
            "bits": {f: pack_bits([bool(r.get(f, False)) for r in rows]) for f in bits},
            "ints": {f: [int(r.get(f) or 0) for r in rows] for f in ints}}


def eval_record(key: str, cell: dict[str, Any], ids: Sequence[str], k: int, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The record of a ``dynts eval`` cell from its sample rows (``question``, ``sample``, ``correct``,
    ``tokens``, ...; any order); ``seed`` and ``row`` (:data:`EVAL_SEEDS`) are kept when every row has them."""
    rows = sorted(samples, key=lambda r: (r["question"], r["sample"]))
    seeds = EVAL_SEEDS if rows and all(f in r for r in rows for f in EVAL_SEEDS) else ()
    return cell_record(key, cell, ids, k, rows, EVAL_BITS, (*EVAL_INTS, *seeds))


def write_record(run_dir: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` atomically to ``run_dir/records/<key>.json``."""
    path = Path(run_dir) / "records" / f"{record['key']}.json"
    write_atomic(path, json.dumps(record, separators=(",", ":")) + "\n")
    return path


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of a run directory, bit fields decoded to lists of bools (sorted by key)."""
    out = []
    for path in sorted((Path(run_dir) / "records").glob("*.json")):
        rec = json.loads(path.read_text())
        if rec.get("format") != FORMAT:
            raise ValueError(f"{path}: format {rec.get('format')!r} is not {FORMAT!r}; rewrite it with this version")
        n = len(rec["ids"]) * rec["k"]
        rec["bits"] = {f: unpack_bits(v, n) for f, v in rec["bits"].items()}
        out.append(rec)
    return out


def per_question(record: dict[str, Any], field: str = "correct") -> list[float]:
    """The mean of a (decoded) bit or int field over each question's ``k`` samples."""
    values = record["bits"][field] if field in record["bits"] else record["ints"][field]
    k = record["k"]
    return [sum(values[q * k:(q + 1) * k]) / k for q in range(len(record["ids"]))]
