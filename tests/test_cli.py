"""The `dynts` command dispatches lazily and reports unknown commands."""

from __future__ import annotations

import subprocess
import sys

from dynts import cli


def test_help_lists_commands(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_library_import_does_not_pull_upper_layers():
    code = "import sys, dynts, dynts.cli; bad = [m for m in ('trainers', 'eval', 'data_pipeline', 'scripts') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
