"""A Lightning ``last.ckpt`` as a resume point that can be committed: tensors in safetensors, the rest in JSON.

A training longer than a session outlives it only through what is committed, and a Lightning checkpoint is a
pickle, which this project never loads from the repository. :func:`save` splits a run's ``ckpt/last.ckpt`` into
``resume.safetensors`` (every tensor: the weights, the optimizer's moments and step counts) and ``resume.json``
(loop counters, scheduler state, hyper-parameters: plain values, with each dict key's type and every tuple kept,
and the SHA-256 of the tensors file), beside a copy of the run's CSV logs (the training curve so far).
:func:`restore` checks both, rebuilds the same checkpoint dict and writes it as ``<run_dir>/ckpt/last.ckpt`` for
``--resume``. The round trip is exact, so the resumed run draws the batches and takes the steps the uninterrupted
one would (batches are a function of ``(seed, step)``; ``tests/test_resume_point.py``).

    dynts testbed resume-point save --run-dir runs/testbed-chain-lrm-fair-s1
    dynts testbed resume-point restore --run-dir runs/testbed-chain-lrm-fair-s1

The default place is ``checkpoints/resume/<run name>/``; ``scripts/run_fair_seeds.sh carry`` saves every
unfinished training of its queue there and its training steps restore from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "dynts-resume-point/1"
TENSORS, MANIFEST = "resume.safetensors", "resume.json"
RESUME_ROOT = Path("checkpoints/resume")


def default_dir(run_dir: str | Path) -> Path:
    """``checkpoints/resume/<run name>``: where a run's committed resume point lives."""
    return RESUME_ROOT / Path(run_dir).name


def _encode(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """A JSON value for ``obj``; tensors go to ``tensors`` (a copy each: tied weights share storage)."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").clone().contiguous()
        return {"tensor": name}
    if type(obj) in (dict, OrderedDict):  # a state_dict is an OrderedDict; kept as one
        return {type(obj).__name__: [[_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return {kind: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"resume point: {where} holds a {type(obj).__name__}, which has no plain form; only tensors, "
                    "dicts (plain or ordered), lists, tuples, numbers, strings, booleans and None can be carried")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, dict):
        return node
    (kind, value), = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind in ("dict", "OrderedDict"):
        return (dict if kind == "dict" else OrderedDict)((_decode(k, tensors), _decode(v, tensors)) for k, v in value)
    items = [_decode(v, tensors) for v in value]
    return tuple(items) if kind == "tuple" else items


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save(run_dir: str | Path, dest: str | Path | None = None) -> Path:
    """Write ``<run_dir>/ckpt/last.ckpt`` as a resume point in ``dest`` (default :func:`default_dir`)."""
    ckpt = Path(run_dir) / "ckpt" / "last.ckpt"
    if not ckpt.is_file():
        raise FileNotFoundError(f"resume point: {ckpt} does not exist; --run-dir must name a run with a Lightning "
                                "last.ckpt (a training started with ckpt_every)")
    state = torch.load(ckpt, map_location="cpu", weights_only=True)  # this machine's own file
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "checkpoint")
    dest = Path(dest) if dest is not None else default_dir(run_dir)
    dest.mkdir(parents=True, exist_ok=True)
    _write_atomically(dest / TENSORS, lambda p: save_file(tensors, str(p)))
    manifest = {"format": FORMAT, "run_dir": str(run_dir), "global_step": state.get("global_step"),
                "tensors_sha256": _sha256(dest / TENSORS), "checkpoint": tree}
    _write_atomically(dest / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1) + "\n"))
    _copy_logs(Path(run_dir), dest)
    return dest


def _copy_logs(src_root: Path, dest_root: Path) -> None:
    """The CSV logger's files (``logs/version_*/*.{csv,yaml}``), so the carried run keeps its curve."""
    for path in sorted((src_root / "logs").glob("version_*/*")):
        if path.suffix in (".csv", ".yaml"):
            target = dest_root / path.relative_to(src_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


def saved_step(src: str | Path) -> int | None:
    """The global step of the resume point in ``src``, or None if there is none."""
    path = Path(src) / MANIFEST
    return json.loads(path.read_text()).get("global_step") if path.is_file() else None


def restore(src: str | Path, run_dir: str | Path, force: bool = False) -> Path:
    """Rebuild ``<run_dir>/ckpt/last.ckpt`` from the resume point in ``src``; refuse to replace an existing one
    unless ``force``."""
    src = Path(src)
    manifest_path, tensors_path = src / MANIFEST, src / TENSORS
    if not manifest_path.is_file() or not tensors_path.is_file():
        raise FileNotFoundError(f"resume point: {src} lacks {MANIFEST} or {TENSORS}; save one first "
                                "(dynts testbed resume-point save --run-dir RUN)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"resume point: {manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    if _sha256(tensors_path) != manifest["tensors_sha256"]:
        raise ValueError(f"resume point: {tensors_path} does not match {manifest_path} (its SHA-256 differs); "
                         "the two files come from different saves: save the resume point again")
    ckpt = Path(run_dir) / "ckpt" / "last.ckpt"
    if ckpt.exists() and not force:
        raise FileExistsError(f"resume point: {ckpt} exists; restoring would replace it (pass force=True / --force)")
    state = _decode(manifest["checkpoint"], load_file(str(tensors_path)))
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(ckpt, lambda p: torch.save(state, p))
    _copy_logs(src, Path(run_dir))
    return ckpt
