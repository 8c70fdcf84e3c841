"""The ``datadist`` command is one module per command (issue 39): ``datadist.cli:main`` stays
the console entry point, ``python -m datadist.cli`` still runs, and no command module grows
back into the 600-line file it was split from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from datadist import cli

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(cli.__file__).parent


def test_entry_point_is_cli_main():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\n[project.scripts]\ndatadist = "datadist.cli:main"\n' in pyproject
    assert callable(cli.main)


def test_each_command_has_its_own_small_module():
    for name in ("demo", "info", "probe", "bench"):
        module = PACKAGE / f"{name}.py"
        assert module.is_file(), f"datadist/cli/{name}.py is missing"
        assert "def add_parser(" in module.read_text(), f"cli/{name}.py declares no options"
    for module in PACKAGE.glob("*.py"):
        lines = len(module.read_text().splitlines())
        assert lines <= 300, f"{module.name} has {lines} lines: split it further"


def test_python_dash_m_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "datadist.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "info", "probe", "bench"):
        assert command in out.stdout
