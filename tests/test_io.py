"""dynts.io: atomic file writes and directory replacement."""
from __future__ import annotations

import os

import pytest

from dynts import io as dio
from dynts.io import replace_directory, write_atomic


def test_write_atomic_text_and_bytes_create_parents_and_overwrite(tmp_path):
    path = tmp_path / "a" / "b" / "out.json"
    write_atomic(path, "héllo\n")
    assert path.read_bytes() == "héllo\n".encode("utf-8")
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]  # no temp file left


def test_write_atomic_gives_plain_open_permissions(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    write_atomic(tmp_path / "atomic.txt", "x")
    assert (tmp_path / "atomic.txt").stat().st_mode == plain.stat().st_mode


def test_write_atomic_failure_keeps_old_file_and_removes_temp(tmp_path, monkeypatch):
    path = tmp_path / "out.txt"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(dio.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_write_atomic_rejects_non_text(tmp_path):
    with pytest.raises(ValueError, match="data must be str or bytes"):
        write_atomic(tmp_path / "x.json", {"a": 1})
    assert not list(tmp_path.iterdir())


def test_replace_directory_replaces_existing_target(tmp_path):
    target = tmp_path / "dataset"
    target.mkdir()
    (target / "stale").write_text("old")
    tmp = tmp_path / ".tmp-dataset"
    tmp.mkdir()
    (tmp / "fresh").write_text("new")
    assert replace_directory(tmp, target) == target
    assert [p.name for p in target.iterdir()] == ["fresh"] and not tmp.exists()
    fresh = tmp_path / ".tmp-other"
    fresh.mkdir()
    replace_directory(fresh, tmp_path / "other")  # no existing target: a plain rename
    assert (tmp_path / "other").is_dir() and not os.path.exists(fresh)
