"""What a newcomer types first: input from a file (`--input @order.json`), the app as a path
(`--app shop/app.py`), and a command run in a folder with no database (nothing is created)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_cli import APP, assert_one_line_error, counts, run


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working folder, with no SAGALOOP_ setting."""
    for name in list(os.environ):
        if name.startswith("SAGALOOP_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_app_can_be_a_path_to_its_file(folder: Path) -> None:
    (folder / "shop").mkdir()
    (folder / "shop" / "payments.py").write_text(APP)
    assert run("db", "upgrade").exit_code == 0
    order = {"id": "o1", "cents": 5}
    result = run("start", "pay", "--app", "shop/payments.py", "--input", json.dumps(order))
    assert result.exit_code == 0, result.output
    assert counts(folder / "sagaloop.db") == (1, 1)
    result = run("start", "pay", "--app", "shop/payments.py:app", "--input", json.dumps(order))
    assert result.exit_code == 0, result.output


def test_a_bad_app_path_is_one_line(folder: Path) -> None:
    assert run("db", "upgrade").exit_code == 0
    result = run("start", "pay", "--app", "shop/nope.py")
    assert_one_line_error(result, "shop/nope.py", "no such file")
    (folder / "broken.py").write_text("import not_a_module_anywhere\n")
    result = run("start", "pay", "--app", "broken.py")
    assert_one_line_error(result, "broken.py", "not_a_module_anywhere")


def test_input_can_be_read_from_a_file(folder: Path) -> None:
    (folder / "cliapp.py").write_text(APP)
    assert run("db", "upgrade").exit_code == 0
    (folder / "order.json").write_text(json.dumps({"id": "o1", "cents": 5}))
    result = run("start", "pay", "--app", "cliapp", "--input", "@order.json")
    assert result.exit_code == 0, result.output
    assert counts(folder / "sagaloop.db") == (1, 1)
    result = run("start", "pay", "--app", "cliapp", "--input", "@missing.json")
    assert_one_line_error(result, "missing.json")
    assert counts(folder / "sagaloop.db") == (1, 1)


def test_a_command_in_a_folder_without_a_database_creates_none(folder: Path) -> None:
    for args in (["status", "r1"], ["list"], ["approvals"]):
        result = run(*args)
        assert_one_line_error(result, "sagaloop db upgrade", "sagaloop dev")
    assert not (folder / "sagaloop.db").exists()
