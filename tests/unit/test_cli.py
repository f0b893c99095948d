"""The CLI: bad input gives a one-line error and a non-zero exit, and writes nothing."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from sagaloop.cli.main import cli

APP = textwrap.dedent(
    """
    from pydantic import BaseModel
    from sagaloop import App, SagaContext, StepContext

    app = App("cliapp")

    class Order(BaseModel):
        id: str
        cents: int

    @app.step(queue="q")
    def charge(ctx: StepContext, order: Order) -> int:
        return order.cents

    @app.saga(name="pay")
    async def pay(ctx: SagaContext, order: Order) -> int:
        await ctx.wait_for_event("go")
        return await ctx.call(charge, order)
    """
)


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "cliapp.py").write_text(APP)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "s.db"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"sqlite:///{path}")
    yield path


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def counts(path: Path) -> tuple[int, int]:
    with sqlite3.connect(path) as conn:
        runs = conn.execute("select count(*) from sagaloop_runs").fetchone()[0]
        queued = conn.execute("select count(*) from sagaloop_outbox").fetchone()[0]
    return runs, queued


def assert_one_line_error(result: Result, *words: str) -> None:
    assert result.exit_code != 0
    lines = [x for x in result.output.strip().splitlines() if x.startswith("Error")]
    assert len(lines) == 1, result.output
    for word in words:
        assert word in lines[0], result.output


def test_commands_refuse_an_unmigrated_database_and_say_what_to_run(db: Path) -> None:
    result = run("list")
    assert_one_line_error(result, "sagaloop db upgrade")


def test_db_upgrade_is_idempotent(db: Path) -> None:
    assert "upgraded from version 0" in run("db", "upgrade").output
    assert "up to date" in run("db", "upgrade").output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["start", "nope", "--input", "{}", "--app", "cliapp"], ["unknown saga 'nope'", "pay"]),
        (["start", "pay", "--input", '{"id": "1"}', "--app", "cliapp"], ["cents", "required"]),
        (["start", "pay", "--input", "{oops", "--app", "cliapp"], ["not valid JSON"]),
        (["start", "pay", "--input", "{}", "--app", "missing_module"], ["cannot import"]),
        (["send-event", "no-such-run", "go"], ["no run with id 'no-such-run'"]),
        (["send-event", "no-such-run", "go", "--data", "[1,"], ["not valid JSON"]),
        (["cancel", "no-such-run"], ["no run with id"]),
        (["retry", "no-such-run"], ["no run with id"]),
        (["status", "no-such-run"], ["no run with id"]),
        (["list", "--limit", "0"], ["0"]),
        (["list", "--status", "bogus"], ["bogus"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    db: Path, args: list[str], words: list[str]
) -> None:
    run("db", "upgrade")
    result = run(*args)
    assert_one_line_error(result, *words)
    assert counts(db) == (0, 0)


def test_start_status_list_and_duplicate_start(db: Path) -> None:
    run("db", "upgrade")
    order = json.dumps({"id": "7", "cents": 250})
    first = run("start", "pay", "--input", order, "--run-id", "r-1", "--app", "cliapp")
    assert first.exit_code == 0 and first.output.strip() == "r-1"
    again = run("start", "pay", "--input", order, "--run-id", "r-1", "--app", "cliapp")
    assert again.output.strip() == "r-1"
    assert counts(db) == (1, 1), "a second start with the same run id starts nothing"
    status = json.loads(run("status", "r-1", "--json").output)
    assert status["run_id"] == "r-1" and status["status"] == "running"
    assert status["waiting_for"][0].startswith("waiting in the start queue for ")
    listing = run("list")
    assert "r-1" in listing.output and "running: 1" in listing.output
    only = run("list", "--status", "running")  # a status by its value, as docs write it
    assert only.exit_code == 0 and "r-1" in only.output, only.output
    assert "r-1" not in run("list", "--status", "completed").output
    retry = run("retry", "r-1")
    assert_one_line_error(retry, "not needs_attention")


def test_schema_prints_the_message_contract() -> None:
    result = run("schema")
    assert result.exit_code == 0
    schemas = json.loads(result.output)
    assert set(schemas) == {"start", "event", "publish", "update"}
    start = schemas["start"]
    assert {"run_id", "saga", "payload"} <= set(start["required"])
    assert start["properties"]["type"]["const"] == "start"
    assert schemas["event"]["properties"]["type"]["const"] == "event"
    assert schemas["publish"]["properties"]["type"]["const"] == "publish"
    assert schemas["update"]["properties"]["type"]["const"] == "update"


def test_service_commands_refuse_an_unknown_queue(db: Path) -> None:
    run("db", "upgrade")
    result = run("worker", "--app", "cliapp", "--queue", "q,nope")
    assert result.exit_code != 0 and "nope" in result.output


def test_signals_go_to_the_engine_of_the_runs_app(db: Path) -> None:
    run("db", "upgrade")
    order = json.dumps({"id": "7", "cents": 250})
    run("start", "pay", "--input", order, "--run-id", "r-2", "--app", "cliapp")
    assert run("send-event", "r-2", "go", "--data", '"now"').exit_code == 0
    assert run("cancel", "r-2").exit_code == 0
    with sqlite3.connect(db) as conn:
        queues = [q for (q,) in conn.execute("select queue from sagaloop_outbox order by id")]
    expected = ["cliapp.starts", "cliapp.engine", "cliapp.engine"]
    assert queues == expected, "start, event and cancel reach the app's engine"


def test_tail_prints_what_the_history_holds(db: Path) -> None:
    run("db", "upgrade")
    order = json.dumps({"id": "7", "cents": 250})
    run("start", "pay", "--input", order, "--run-id", "r-1", "--app", "cliapp")
    result = run("tail", "r-1", "--no-follow")
    assert result.exit_code == 0
    assert result.output.startswith("run_started pay"), "an event of no command: no position"
    lines = [
        json.loads(x) for x in run("tail", "r-1", "--no-follow", "--json").output.split("\n") if x
    ]
    assert [x["kind"] for x in lines] == ["run_started"] and lines[0]["source"] == "history"
    assert (lines[0]["seq"], lines[0]["position"]) == (1, None)
    assert_one_line_error(run("tail", "nope", "--no-follow"), "no run with id")
