"""What the CLI tests share: an app module written to a folder of its own, a fresh SQLite
database named by SAGALOOP_DATABASE_URL (and no other SAGALOOP_ setting), and click's runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from sagaloop.cli.main import cli


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def cli_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str) -> Path:
    """Write ``source`` as module ``module`` (importable, the current folder), point the CLI at
    a new upgraded database, and return its path."""
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("SAGALOOP_"):
            monkeypatch.delenv(name)
    path = tmp_path / "cli.db"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"sqlite:///{path}")
    assert run("db", "upgrade").exit_code == 0
    return path
