"""The CLI starts fast (issue 26): ``sagaloop --help`` and the help of the commands that only
read the store import none of the heavy dependencies, which the commands import where they use
them. Asserted on the set of modules a fresh interpreter loads, not on a timing (the figures are
benchmarks/cli_startup.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sagaloop.cli.main import LAZY_COMMANDS, cli

ROOT = Path(__file__).resolve().parents[2]
HEAVY = (
    "sqlalchemy",
    "pydantic",
    "pydantic_settings",
    "pika",
    "kombu",
    "redis",
    "httpx",
    "starlette",
    "uvicorn",
    "rich",
    "mcp",
    "sagaloop.agents",
    "sagaloop.client",
    "sagaloop.engine.messages",
    "sagaloop.runtime",
    "sagaloop.sagas",
    "sagaloop.store",
    "sagaloop.ui",
)
"""What ``sagaloop --help`` loaded before issue 26 and needs none of."""
STORE = (
    "sqlalchemy",
    "pika",
    "httpx",
    "pydantic",
    "pydantic_settings",
    "sagaloop.client",
    "sagaloop.store",
    "sagaloop.runtime",
)
"""What a command's ``--help`` needs none of: the group reads the settings (and reports a bad
one) before the command's help, without pydantic."""

PROBE = """
import json, sys
from sagaloop.cli.main import main
try:
    sys.argv = ["sagaloop", *json.loads(sys.argv[1])]
    main()
except SystemExit as e:
    code = e.code
print("\\n" + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _started(*args: str, cwd: Path = ROOT) -> tuple[int, set[str], str]:
    """Run ``sagaloop ARGS`` in a fresh interpreter: its exit code, the modules it had loaded
    when it exited, and what it printed."""
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    env.pop("SAGALOOP_DATABASE_URL", None)
    env.pop("SAGALOOP_BROKER_URL", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=False,
    )
    output, _, last = done.stdout.rstrip("\n").rpartition("\n")
    report = json.loads(last)
    return report["code"], set(report["modules"]), output


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in modules or any(m.startswith(n + ".") for m in modules)]


def test_help_imports_none_of_the_heavy_dependencies() -> None:
    code, modules, output = _started("--help")
    assert code == 0
    assert _loaded(modules, HEAVY) == []
    for name in ("status", "list", "dead-letters", "schedule", "ui", "worker"):
        assert f"\n  {name} " in output


def test_import_sagaloop_loads_neither_pydantic_nor_sqlalchemy() -> None:
    code = (
        "import sys, sagaloop; print([n for n in ('pydantic', 'sqlalchemy') if n in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "args",
    [
        ("status", "--help"),
        ("list", "--help"),
        ("tail", "--help"),
        ("cancel", "--help"),
        ("retry", "--help"),
        ("start", "--help"),
        ("send-event", "--help"),
        ("approve", "--help"),
        ("fork", "--help"),
    ],
)
def test_a_command_s_help_does_not_open_the_store(args: tuple[str, ...]) -> None:
    code, modules, output = _started(*args)
    assert code == 0
    assert f"Usage: sagaloop {args[0]}" in output
    assert _loaded(modules, STORE) == []


def test_a_usage_error_does_not_open_the_store() -> None:
    code, modules, _ = _started("status")  # RUN_ID missing
    assert code == 2
    assert _loaded(modules, STORE) == []


def test_the_help_lists_every_command_as_when_all_are_imported() -> None:
    """The short helps kept in LAZY_COMMANDS are the commands' own: the list that ``--help``
    prints without importing them is the one click prints with them all imported."""
    code, _, lazy = _started("--help")
    ctx = click.Context(cli)
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None, name
        if name in LAZY_COMMANDS:
            assert command.get_short_help_str(10_000) == LAZY_COMMANDS[name][1], name
    eager = CliRunner().invoke(cli, ["--help"], prog_name="sagaloop", terminal_width=78)
    # 78: what click makes of COLUMNS=80 (``_started``)
    assert eager.exit_code == code == 0
    assert lazy.strip() == eager.output.strip()


def test_a_lazy_command_runs_as_before() -> None:
    """A command of another module is imported when named, and runs (here: ``schema``)."""
    code, modules, output = _started("schema")
    assert code in (0, None)
    assert "sagaloop.cli.serve" in modules
    assert {"start", "event", "publish", "update"} <= set(json.loads(output))


def test_the_commands_run_on_the_embedded_store(tmp_path: Path) -> None:
    """Real processes on SQLite: a command of cli/main.py and one imported when named read the
    store they open where they need it, as before."""
    assert _started("db", "upgrade", cwd=tmp_path)[0] in (0, None)
    code, modules, output = _started("list", "--json", cwd=tmp_path)
    assert code in (0, None)
    assert json.loads(output) == {"runs": [], "counts": {}}
    assert "sqlalchemy" in modules  # the store was opened, where the command needed it
    code, modules, output = _started("approvals", cwd=tmp_path)
    assert (code in (0, None), output.strip()) == (True, "no approval is pending")
    assert "sagaloop.cli.approvals" in modules


def test_the_cli_s_copy_of_the_nesting_limit_is_the_converter_s() -> None:
    from sagaloop.cli import deploys
    from sagaloop.sagas.convert import MAX_VALUE_DEPTH

    assert deploys.MAX_VALUE_DEPTH == MAX_VALUE_DEPTH


def test_settings_are_read_from_the_environment_in_any_case() -> None:
    """Read without pydantic, as pydantic-settings read them: ``SAGALOOP_<FIELD>`` in any
    case, the command line's over them, each checked."""
    from sagaloop.cli.settings import SettingError, Settings

    read = Settings.read(
        {"verbose": 2},
        {"sagaloop_lease": "5.5", "SAGALOOP_LOG_FORMAT": "JSON", "SAGALOOP_VERBOSE": "1"},
    )
    assert (read.lease, read.log_format, read.verbose, read.queue_type) == (
        5.5,
        "json",
        2,
        "quorum",
    )
    assert Settings.read({}, {}) == Settings()
    for variable, value, said in [
        ("SAGALOOP_LEASE", "soon", "should be a number"),
        ("SAGALOOP_LEASE", "0", "should be greater than 0"),
        ("SAGALOOP_LEASE", "86401", "should be at most 86400"),
        ("SAGALOOP_ACTIVATION_DEADLINE", "nan", "should be greater than 0"),
        ("SAGALOOP_VERBOSE", "-1", "should be 0 or more"),
        ("SAGALOOP_QUEUE_TYPE", "Quorum", "should be 'quorum' or 'classic'"),
    ]:
        with pytest.raises(SettingError) as raised:
            Settings.read({}, {variable: value})
        assert (raised.value.field, raised.value.value, raised.value.message) == (
            variable.removeprefix("SAGALOOP_").lower(),
            value,
            said,
        )


def test_the_help_says_what_app_is_for_where_it_is_optional() -> None:
    """``send-event`` runs without importing the app's code, and says what the engine does
    then; ``start`` says why it needs the code."""
    send = " ".join(CliRunner().invoke(cli, ["send-event", "--help"]).output.split())
    assert "validates the event against the saga's declared events and models" in send
    assert "Without it (faster: no code imported)" in send
    assert "the engine validates the rest: data that does not fit is refused and recorded" in send
    start = " ".join(CliRunner().invoke(cli, ["start", "--help"]).output.split())
    assert "validates the input against the saga's model before anything is written" in start
    assert "sends a debounced saga's start to its window" in start
