"""Atomic, resumable shards of a ``datasets`` (Arrow) dataset.

A long job writes its records in shards under ``<root>/shards/``. A shard is a directory
``shard-<rank>-<ns>`` holding a ``datasets`` dataset (``save_to_disk``) plus ``done.json``: the keys
of every work item the shard decided (kept or not) and why. It is written to a hidden temporary
directory and renamed into place, so a shard exists completely or not at all: a job killed at any
moment (SIGKILL included) and restarted redoes exactly the items of the shards it had not finished,
and never writes an item twice. :meth:`ShardStore.merge` concatenates the shards (dropping
duplicate keys, e.g. from a distributed sampler's padding) into ``<root>/dataset``, again atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from datasets import Dataset, Features, concatenate_datasets, load_from_disk

from dynts.io import replace_directory

__all__ = ["ShardStore", "settings_from_dict", "stage_main"]

DONE_NAME = "done.json"
STATS_NAME = "stats.json"


class ShardStore:
    """Shards of records keyed by ``key_fields`` (e.g. ``("question_id", "sample_id")``).

    Args:
        root: output directory; shards go to ``root/shards``, the merged dataset to ``root/dataset``.
        features: the ``datasets.Features`` of a record (so empty shards have a schema too).
        key_fields: the fields identifying a work item.
    """

    def __init__(self, root: str | Path, features: Features, key_fields: Sequence[str]) -> None:
        self.root = Path(root)
        self.features = features
        self.key_fields = tuple(key_fields)
        missing = [k for k in self.key_fields if k not in features]
        if missing:
            raise ValueError(f"key_fields {missing} are not in the features {list(features)}")

    @property
    def shard_dir(self) -> Path:
        return self.root / "shards"

    @property
    def dataset_dir(self) -> Path:
        return self.root / "dataset"

    def is_complete(self) -> bool:
        """True once :meth:`merge` has written ``root/dataset``."""
        return (self.dataset_dir / STATS_NAME).is_file()

    def shards(self) -> list[Path]:
        if not self.shard_dir.is_dir():
            return []
        return sorted(p for p in self.shard_dir.iterdir() if p.name.startswith("shard-") and (p / DONE_NAME).is_file())

    def clean_partial(self) -> None:
        """Remove temporary directories left by a killed job (call before starting work)."""
        if self.shard_dir.is_dir():
            for p in self.shard_dir.iterdir():
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)
        for p in self.root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)

    def done(self) -> dict[tuple, str]:
        """``key -> status`` of every work item decided by a finished shard."""
        out: dict[tuple, str] = {}
        for shard in self.shards():
            for entry in json.loads((shard / DONE_NAME).read_text()):
                out.setdefault(tuple(entry["key"]), entry["status"])
        return out

    def _dataset(self, records: list[dict[str, Any]]) -> Dataset:
        if not records:  # from_list([]) would drop the schema
            return Dataset.from_dict({name: [] for name in self.features}, features=self.features)
        return Dataset.from_list(records, features=self.features)

    def write(self, records: list[dict[str, Any]], decided: list[tuple[tuple, str]], rank: int = 0) -> Path:
        """Write one shard atomically: ``records`` (kept items) and ``decided`` ``(key, status)``
        for every item the shard covers (kept ones with status ``"kept"``)."""
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        name = f"shard-{rank:03d}-{time.time_ns():020d}"
        tmp = self.shard_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        _save(self._dataset(records), tmp)
        (tmp / DONE_NAME).write_text(json.dumps([{"key": list(k), "status": s} for k, s in decided]))
        _fsync_dir(tmp)
        return replace_directory(tmp, self.shard_dir / name)

    def merge(self, sort_key: Callable[[dict], Any] | None = None, extra_stats: dict | None = None) -> Dataset:
        """Concatenate all shards into ``root/dataset`` (atomically), one record per key.

        ``stats.json`` in it counts the decided items by status.
        """
        parts = [load_from_disk(str(s)) for s in self.shards()]
        merged = concatenate_datasets(parts) if parts else self._dataset([])
        seen: set[tuple] = set()
        keep: list[int] = []
        keys = list(zip(*(merged[k] for k in self.key_fields))) if len(merged) else []
        for i, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        if sort_key is not None:
            rows = [(sort_key({k: v for k, v in zip(self.key_fields, keys[i])}), i) for i in keep]
            keep = [i for _, i in sorted(rows)]
        merged = merged.select(keep) if len(merged) else merged
        status = Counter(self.done().values())
        stats = {"records": len(merged), "decided": sum(status.values()), "by_status": dict(status), **(extra_stats or {})}
        tmp = self.root / f".tmp-dataset-{uuid.uuid4().hex[:8]}"
        _save(merged, tmp)
        (tmp / STATS_NAME).write_text(json.dumps(stats, indent=2))
        replace_directory(tmp, self.dataset_dir)
        return load_from_disk(str(self.dataset_dir))

    def stats(self) -> dict:
        return json.loads((self.dataset_dir / STATS_NAME).read_text())


def _save(dataset: Dataset, path: Path) -> None:
    """``save_to_disk`` that also works for an empty dataset (one empty Arrow file, schema kept)."""
    dataset.save_to_disk(str(path), num_shards=1 if len(dataset) == 0 else None)


def _fsync_dir(path: Path) -> None:
    """Flush a directory's files to disk before it is renamed into place."""
    for p in path.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def stage_main(
    argv: list[str] | None, description: str, section: str, run: Callable[[dict[str, Any]], dict[str, Any]],
    overrides: dict[str, dict[str, Any]] | None = None,
) -> int:
    """Command line of one pipeline stage: ``--config`` names a YAML whose ``section`` (or its top
    level) holds the stage's settings; ``run(settings)`` returns the stats printed as JSON.
    ``overrides``: setting name -> ``argparse`` keywords of an option ``--<name>`` that, when given,
    replaces that setting of the YAML."""
    import argparse

    import yaml

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help=f"YAML with a {section}: section (or the settings at top level)")
    for name, options in (overrides or {}).items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, **options)
    args = parser.parse_args(argv)
    values = yaml.safe_load(Path(args.config).read_text()) or {}
    settings = dict(values.get(section, values))
    settings.update({name: getattr(args, name) for name in overrides or {} if getattr(args, name) is not None})
    stats = run(settings)
    print(json.dumps({k: v for k, v in stats.items() if k != "config"}, indent=2))
    return 0


def settings_from_dict(cls: type, values: dict[str, Any], section: str) -> Any:
    """``cls(**values)`` for a stage's settings dataclass, refusing unknown keys by name."""
    from dataclasses import fields

    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} settings {unknown}; valid: {sorted(known)}")
    return cls(**values)
