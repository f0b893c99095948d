"""``sagaloop send-event`` and ``status`` with events sent before the wait begins (issue 23,
item 5): a saga's declared events are refused at the door, without the saga's code; an event
refused later is shown in ``status`` with its reason, and events received and not yet taken
are listed."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cli_env import cli_database, run

from sagaloop.testing.harness import Harness, VirtualClock

MODULE = "declared_events_cli"
SOURCE = textwrap.dedent(
    """
    from datetime import timedelta
    from pydantic import BaseModel
    from sagaloop import App, SagaContext

    class Reply(BaseModel):
        text: str
        accepted: bool

    app = App("declared_cli")

    @app.saga(name="declared", events={"go": None, "reply": Reply})
    async def declared(ctx: SagaContext) -> str:
        await ctx.wait_for_event("go")
        return (await ctx.wait_for_event("reply")).text

    @app.saga(name="continues", events={"go": None, "reply": Reply})
    async def continues(ctx: SagaContext, rounds: int) -> str:
        if rounds:
            ctx.continue_as_new(rounds - 1)
        await ctx.wait_for_event("go")
        return (await ctx.wait_for_event("reply")).text

    @app.saga(name="undeclared")
    async def undeclared(ctx: SagaContext) -> str:
        await ctx.wait_for_event("go")
        reply = await ctx.wait_for_event("reply", model=Reply, timeout=timedelta(days=1))
        return reply.text
    """
)


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return cli_database(tmp_path, monkeypatch, MODULE, SOURCE)


def written(path: Path) -> tuple[int, int, int]:
    with sqlite3.connect(path) as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(f"select count(*) from sagaloop_{table}").fetchone()[0]
            for table in ("runs", "history", "outbox")
        )


def one_line_error(output: str, exit_code: int, *words: str) -> None:
    assert exit_code not in (0, None), output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    for word in words:
        assert word in output, output


def test_send_event_refuses_a_declared_event_that_does_not_fit_before_the_wait_begins(
    db: Path,
) -> None:
    """It used to print "sent" and exit 0; the engine refused the event when the wait began."""
    started = run("start", "declared", "--run-id", "r-1", "--app", MODULE)
    assert started.exit_code == 0, started.output
    before = written(db)
    result = run("send-event", "r-1", "reply", "--data", '{"text": "typo"}')
    one_line_error(result.output, result.exit_code, "accepted", "nothing was sent")
    result = run("send-event", "r-1", "replied", "--data", '{"text": "yes", "accepted": true}')
    one_line_error(result.output, result.exit_code, "does not accept", "'go', 'reply'")
    assert written(db) == before, "nothing was written"
    good = run("send-event", "r-1", "reply", "--data", '{"text": "yes", "accepted": true}')
    assert good.exit_code == 0 and "sent" in good.output


def test_status_shows_an_event_refused_when_its_wait_began_and_the_events_kept(
    db: Path,
) -> None:
    import declared_events_cli as module  # the app module the CLI imports

    h = Harness(module.app, url=f"sqlite:///{db}", clock=VirtualClock(datetime.now(UTC)))
    run_id = h.start(module.undeclared, run_id="r-2")
    h.run_until_idle(skip_time=False)
    # no declaration and no wait for it yet: the client cannot tell, the event is kept
    assert run("send-event", run_id, "reply", "--data", '{"text": "typo"}').exit_code == 0
    h.clock.set(datetime.now(UTC))  # the CLI stamped its message with the real time
    h.run_until_idle(skip_time=False)
    kept = run("status", run_id)
    assert "event 'reply' received at" in kept.output and "kept" in kept.output, kept.output
    assert json.loads(run("status", run_id, "--json").output)["kept"][0]["name"] == "reply"

    assert run("send-event", run_id, "go").exit_code == 0
    h.clock.set(datetime.now(UTC))
    h.run_until_idle(skip_time=False)
    status = run("status", run_id)
    assert status.exit_code == 0, status.output
    assert "waiting for event 'reply'" in status.output, status.output
    assert "1 refused, the last:" in status.output and "accepted" in status.output
    assert "events refused:" in status.output, status.output
    data = json.loads(run("status", run_id, "--json").output)
    assert [w["events"] for w in data["waits"]] == [["reply"]]
    assert data["kept"] == []
    [refused] = data["refused"]
    assert refused["name"] == "reply" and "accepted" in refused["reason"]


def test_send_event_with_app_checks_a_run_continued_as_new(db: Path) -> None:
    """The engine writes a continued run's start: ``--app`` checks with the app's declaration."""
    import declared_events_cli as module

    h = Harness(module.app, url=f"sqlite:///{db}", clock=VirtualClock(datetime.now(UTC)))
    run_id = h.start(module.continues, 1, run_id="r-3")
    h.run_until_idle(skip_time=False)
    typo = ("send-event", run_id, "reply", "--data", '{"text": "typo"}')
    result = run(*typo, "--app", MODULE)
    one_line_error(result.output, result.exit_code, "accepted", "nothing was sent")
    result = run("send-event", run_id, "other", "--app", MODULE)
    one_line_error(result.output, result.exit_code, "does not accept")
