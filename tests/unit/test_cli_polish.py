"""The command line's polish (issue 14): global options after the command and from the
environment, ``--broker-url``, what ``status`` and ``list`` show, typed results, colour in a
terminal only, and one-line errors for a bad setting or an app module that raises."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import pytest
from cli_env import cli_database, run
from click.testing import CliRunner
from pydantic import BaseModel

from sagaloop import App, SagaContext, StepContext
from sagaloop.cli import render
from sagaloop.cli.main import _Cli, cli
from sagaloop.client import Client
from sagaloop.errors import ValidationError
from sagaloop.testing import Harness

# --- global options, before or after the command --------------------------------------------


def parsed(*args: str, group: click.Group = cli) -> tuple[dict[str, Any], list[str]]:
    """The group's option values, and what is left for the command (after its name)."""
    ctx = group.make_context("sagaloop", list(args))
    return ctx.params, ctx.args


@pytest.mark.parametrize(
    ("args", "given", "rest"),
    [
        (["--database-url", "X", "-v", "status", "R"], {"database_url": "X", "verbose": 1}, ["R"]),
        (["status", "R", "--database-url", "X", "-v"], {"database_url": "X", "verbose": 1}, ["R"]),
        (["status", "--database-url=X", "R"], {"database_url": "X"}, ["R"]),
        (["-v", "status", "R", "-vv"], {"verbose": 3}, ["R"]),
        (
            ["status", "R", "--verbose", "--log-format", "json"],
            {"verbose": 1, "log_format": "json"},
            ["R"],
        ),
        (["--database-url", "A", "list", "--database-url", "B"], {"database_url": "B"}, []),
        (
            ["dead-letters", "list", "--limit", "5", "--broker-url", "memory", "--json"],
            {"broker_url": "memory"},
            ["list", "--limit", "5", "--json"],
        ),
        (["db", "upgrade", "--database-url", "X"], {"database_url": "X"}, ["upgrade"]),
        # the value of the command's own option stays, even when it looks like a global option
        (["cancel", "R", "--reason", "-v"], {}, ["R", "--reason", "-v"]),
        (["start", "s", "--input=-v", "-v"], {"verbose": 1}, ["s", "--input=-v"]),
        # nothing after -- moves
        (["send-event", "R", "N", "--", "-v"], {}, ["R", "N", "--", "-v"]),
    ],
)
def test_global_options_are_taken_before_or_after_the_command(
    args: list[str], given: dict[str, Any], rest: list[str]
) -> None:
    params, left = parsed(*args)
    expected = {"database_url": None, "broker_url": None, "verbose": None, "log_format": None}
    assert params == {**expected, **given}
    assert left == rest


def test_a_global_option_without_its_value_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli, ["status", "R", "--database-url"])
    assert result.exit_code == 2
    assert "Error: Option '--database-url' requires an argument." in result.output


def test_a_command_option_named_like_a_global_one_is_the_commands() -> None:
    group = _Cli(name="sagaloop", params=list(cli.params))

    @group.command()
    @click.option("-v", "loud", is_flag=True)
    @click.option("--database-url", "url")
    def own(loud: bool, url: str | None) -> None:
        pass

    params, rest = parsed(
        "own", "-v", "--database-url", "X", "-vv", "--log-format", "json", group=group
    )
    assert (params["verbose"], params["database_url"], params["log_format"]) == (None, None, "json")
    assert rest == ["-v", "--database-url", "X", "-vv"]


def test_no_command_declares_a_global_option() -> None:
    """So that moving them never takes one from a command (the test above shows the rule)."""
    names = {name for param in cli.params for name in getattr(param, "opts", [])} - {"--help"}

    def clashes(command: click.Command) -> list[str]:
        found = [
            f"{command.name} {name}"
            for param in command.params
            for name in getattr(param, "opts", [])
            if name in names
        ]
        subcommands = command.commands.values() if isinstance(command, click.Group) else []
        return found + [x for sub in subcommands for x in clashes(sub)]

    ctx = click.Context(cli)
    commands = [cli.get_command(ctx, name) for name in cli.list_commands(ctx)]  # imported lazily
    assert [x for sub in commands if sub is not None for x in clashes(sub)] == []


@pytest.fixture
def driver_levels() -> Iterator[None]:
    before = {name: logging.getLogger(name).level for name in ("pika", "kombu")}
    yield
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    ("args", "env", "level"),
    [
        (["schema", "-v"], {}, logging.WARNING),
        (["schema", "-vv"], {}, logging.DEBUG),
        (["schema"], {"SAGALOOP_VERBOSE": "2"}, logging.DEBUG),
        (["schema", "-v"], {"SAGALOOP_VERBOSE": "2"}, logging.WARNING),  # the option wins
    ],
)
def test_verbosity_comes_after_the_command_or_from_the_environment(
    driver_levels: None, args: list[str], env: dict[str, str], level: int
) -> None:
    assert CliRunner().invoke(cli, args, env=env).exit_code == 0
    assert logging.getLogger("pika").level == level


def test_a_bad_setting_is_one_line_naming_the_variable() -> None:
    result = CliRunner().invoke(cli, ["list"], env={"SAGALOOP_LEASE": "soon"})
    assert result.exit_code == 2 and "Traceback" not in result.output
    [line] = [x for x in result.output.splitlines() if x.startswith("Error")]
    assert line.startswith("Error: Invalid value for SAGALOOP_LEASE: 'soon'"), line
    upper = CliRunner().invoke(cli, ["schema"], env={"SAGALOOP_LOG_FORMAT": "JSON"})
    assert upper.exit_code == 0


# --- on a database: the options at work, status and list -------------------------------------

APP = """
from datetime import timedelta

from pydantic import BaseModel
from sagaloop import App, SagaContext, StepContext

app = App("polish")


class Receipt(BaseModel):
    order: str
    cents: int


@app.step
def charge(ctx: StepContext, cents: int) -> int:
    return cents


@app.saga(name="pay")
async def pay(ctx: SagaContext, cents: int) -> Receipt:
    await ctx.call(charge, cents)
    ctx.publish("progress", {"charged": cents})
    await ctx.wait_for_event("go", timeout=timedelta(days=1), prompt="ship it?")
    return Receipt(order="o1", cents=cents)


@app.saga(name="ask")
async def ask(ctx: SagaContext) -> None:
    await ctx.approval("refund", {"cents": 5}, reason="the parcel was lost")


@app.saga(name="nap")
async def nap(ctx: SagaContext) -> None:
    await ctx.sleep(timedelta(hours=2))
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    db = cli_database(tmp_path, monkeypatch, "polish_cli", APP)
    import polish_cli

    env = Harness(polish_cli.app, url=f"sqlite:///{db}")
    yield env
    env.close()


def test_status_shows_waits_published_values_and_the_cancel_reason(
    env: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paying = env.start("pay", 250, run_id="paying")
    asking = env.start("ask", run_id="asking")
    napping = env.start("nap", run_id="napping")
    env.run_until_idle(skip_time=False)
    env.cancel(napping, "no longer needed")
    env.run_until_idle(skip_time=False)
    # on the harness's database through the option after the command, the variable elsewhere
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")

    text = run("status", paying, "--database-url", url).output
    assert "waiting for event 'go' until 2026-01-02 00:00:00 UTC, asking \"ship it?\"" in text
    assert 'published:\n  progress = {"charged": 250}' in text, text

    text = run("status", asking, "--database-url", url).output
    assert "waiting for event 'approval:0' (the approval below)" in text
    assert 'approvals asked:\n  0: refund {"cents": 5} (pending): the parcel was lost\n' in text
    assert "answer: sagaloop approve asking 0, or sagaloop deny asking 0 --reason TEXT" in text
    assert "approval:0 =" not in text, "shown above, not twice"

    text = run("status", napping, "--database-url", url).output
    assert "status    cancelled\n" in text and "cancel    requested: no longer needed" in text

    data = json.loads(run("status", paying, "--json", "--database-url", url).output)
    assert data["waits"] == [
        {
            "kind": "event",
            "events": ["go"],
            "until": "2026-01-02T00:00:00+00:00",
            "prompt": "ship it?",
        }
    ]
    assert data["published"] == {"progress": {"charged": 250}} and data["cancel_reason"] is None
    [wait] = json.loads(run("--database-url", url, "status", asking, "--json").output)["waits"]
    assert (wait["kind"], wait["events"], wait["prompt"]["approve"]) == (
        "approval",
        ["approval:0"],
        "refund",
    )
    cancelled = json.loads(run("status", napping, "--json", "--database-url", url).output)
    assert cancelled["cancel_reason"] == "no longer needed" and cancelled["waits"] == []


def test_status_shows_a_sleep_and_list_shows_the_app(env: Harness) -> None:
    env.start("nap", run_id="napping")
    env.run_until_idle(skip_time=False)
    [sleep] = env.status("napping").waits
    assert (sleep.kind, sleep.events, sleep.until) == (
        "sleep",
        [],
        env.clock.now() + timedelta(hours=2),
    )

    listed = run("list").output.splitlines()
    assert listed[0].split() == [
        "run",
        "app",
        "saga",
        "status",
        "started",
        "(UTC)",
        "updated",
        "(UTC)",
    ]
    assert listed[2].split()[:4] == ["napping", "polish", "nap", "waiting"]
    [row] = json.loads(run("list", "--json").output)["runs"]
    assert (row["run_id"], row["app"], row["saga"]) == ("napping", "polish", "nap")


def test_broker_url_after_the_command_overrides_the_environment(
    env: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAGALOOP_BROKER_URL", "carrier-pigeon")
    assert "unsupported SAGALOOP_BROKER_URL 'carrier-pigeon'" in run("dead-letters", "list").output
    assert (
        run("dead-letters", "list", "--broker-url", "database").output.strip() == "no dead letters"
    )


def test_an_app_module_that_raises_is_one_line_and_v_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cli_database(tmp_path, monkeypatch, "raising_app", "\n\nraise RuntimeError('no config')\n")
    result = CliRunner().invoke(cli, ["start", "pay", "--app", "raising_app"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.strip() == (
        "Error: cannot import app module 'raising_app': RuntimeError: no config, raised at "
        f"{tmp_path / 'raising_app.py'}:3 (-v shows the traceback)"
    )
    with caplog.at_level(logging.DEBUG, logger="sagaloop.cli.settings"):
        CliRunner().invoke(cli, ["start", "pay", "--app", "raising_app", "-v"])
    [record] = [r for r in caplog.records if r.name == "sagaloop.cli.settings"]
    assert record.exc_info is not None and "raising_app" in record.getMessage()


# --- typed results ---------------------------------------------------------------------------


class Receipt(BaseModel):
    order: str
    cents: int


@dataclasses.dataclass
class Parcel:
    tracking: str
    weight_g: int


def typed_app() -> App:
    app = App("typed")

    @app.step
    def charge(ctx: StepContext, cents: int) -> Receipt:
        return Receipt(order="o1", cents=cents)

    @app.saga(name="pay")
    async def pay(ctx: SagaContext, cents: int) -> Receipt:
        return await ctx.call(charge, cents)

    @app.saga(name="ship")
    async def ship(ctx: SagaContext) -> Parcel:
        return Parcel("t-1", 900)

    @app.saga(name="plain")
    async def plain(ctx: SagaContext) -> dict[str, int]:
        return {"a": 1}

    return app


def test_result_has_the_type_the_saga_declares_when_the_client_has_the_app() -> None:
    env = Harness(typed_app())
    paid, shipped, plain = env.start("pay", 250), env.start("ship"), env.start("plain")
    env.run_until_idle()
    assert env.client.result(paid) == Receipt(order="o1", cents=250)
    assert env.result(paid) == Receipt(order="o1", cents=250), "the harness's is the client's"
    assert env.client.result(shipped) == Parcel("t-1", 900)
    assert env.client.result(plain) == {"a": 1}
    # without the app (or with its name only), the stored JSON
    for client in (Client(env.store), Client(env.store, "typed")):
        assert client.result(paid) == {"order": "o1", "cents": 250}
    # a run of another app with a saga of the same name: its JSON, not this app's type
    other = App("other")

    @other.saga(name="pay")
    async def pay(ctx: SagaContext, cents: int) -> Receipt:
        raise AssertionError("never runs")

    assert Client(env.store, other).result(paid) == {"order": "o1", "cents": 250}
    env.close()


def test_a_stored_output_that_no_longer_fits_says_how_to_read_it() -> None:
    env = Harness(typed_app())
    run_id = env.start("plain")
    env.run_until_idle()
    changed = App("typed")

    @changed.saga(name="plain")
    async def plain(ctx: SagaContext) -> Receipt:
        raise AssertionError("never runs")

    with pytest.raises(ValidationError, match=r"Client.get\(run_id\).output"):
        Client(env.store, changed).result(run_id)
    env.close()


# --- colour in a terminal only ---------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("tty", "env", "colour"),
    [
        (True, {}, True),
        (False, {}, False),
        (True, {"NO_COLOR": "1"}, False),
        (True, {"NO_COLOR": ""}, True),  # no-color.org: set and not empty
        (True, {"TERM": "dumb"}, False),
    ],
)
def test_tables_are_in_colour_only_on_a_terminal_without_no_color(
    monkeypatch: pytest.MonkeyPatch, tty: bool, env: dict[str, str], colour: bool
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("sys.stdout", Terminal() if tty else io.StringIO())
    table = render.text_table(["run", "status"], [["r1", "completed"], ["r2", "failed"]])
    assert render.in_colour() is colour
    if colour:
        assert "\x1b[32mcompleted" in table and "\x1b[1;31mfailed" in table, repr(table)
    else:
        assert table == "run  status\n---  ---------\nr1   completed\nr2   failed"


def test_piped_commands_print_plain_text(env: Harness) -> None:
    env.start("nap")
    env.run_until_idle(skip_time=False)
    for args in (["list"], ["health"], ["dead-letters", "list"], ["approvals"]):
        assert "\x1b" not in run(*args).output
