"""Dead letters as an operator manages them, on the database and memory brokers: a resent
message reaches its run, and ``sagaloop dead-letters`` and ``sagaloop health`` on the database
broker. (The DeadLetters contract itself runs in test_broker_contract.py; RabbitMQ's in
tests/integration/test_dead_letters_rabbitmq.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from sagaloop import App, Client, SagaContext
from sagaloop.brokers.dead_letters import UNSIGNED_MARK, DeadLetters, resend_trusted
from sagaloop.cli.common import Obj
from sagaloop.cli.main import cli
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.errors import BrokerError
from sagaloop.runtime.consumers import decode
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness

app = App("dlshop")


@app.saga(name="wait-for-go")
async def wait_for_go(ctx: SagaContext, _: Any) -> Any:
    return await ctx.wait_for_event("go", timeout=timedelta(days=1))


def event(run_id: str, message_id: str, data: Any) -> bytes:
    return Envelope(
        type="event",
        run_id=run_id,
        message_id=message_id,
        payload={"name": "go", "data": data},
        created_at=datetime(2026, 11, 29, tzinfo=UTC),
    ).to_bytes()


@pytest.mark.parametrize("broker", ["database", "memory"])
def test_a_resent_event_reaches_the_run_that_did_not_exist_yet(broker: Any) -> None:
    h = Harness(app, broker=broker)
    try:
        dead = h.broker
        assert isinstance(dead, DeadLetters)
        body = event("late", "go-1", {"ok": 1})
        dead_queue = engine_queue(app.name)
        h.broker.publish_raw(dead_queue, body)  # type: ignore[attr-defined]
        h.run_until_idle()
        (letter,) = dead.list_dead_letters()
        assert (letter.queue, letter.body, letter.message_id) == (dead_queue, body, "go-1")
        assert (letter.message_type, letter.run_id) == ("event", "late")
        assert "no run with id 'late'" in letter.reason and letter.at is not None
        assert dead.count_dead_letters() == 1

        run = h.start(wait_for_go, None, run_id="late")
        h.run_until_idle(skip_time=False)
        assert h.get(run).status == "waiting"
        assert [d.id for d in dead.resend_dead_letters([letter.id])] == [letter.id]
        h.run_until_idle(skip_time=False)
        assert h.result(run) == {"ok": 1}, "the resent event reached the run"
        assert dead.list_dead_letters() == [] and dead.count_dead_letters() == 0
    finally:
        h.close()


def test_only_an_internal_message_refused_as_unsigned_comes_back_untrusted(tmp_path: Path) -> None:
    """The database's table does not record trust: the reason the engine gave tells."""
    step = b'{"type":"step","run_id":"r","message_id":"step:r:0:1"}'
    h = Harness(app, url=f"sqlite:///{tmp_path / 'db'}")
    try:
        h.broker.publish_raw(app.name + ".steps.q", step)  # type: ignore[attr-defined]
        (delivery,) = h.broker.receive([app.name + ".steps.q"], 1, 1)
        assert decode(delivery) is None, "an unsigned step is refused"
        (letter,) = h.broker.list_dead_letters()  # type: ignore[attr-defined]
        assert UNSIGNED_MARK in letter.reason, "the mark resend_trusted looks for"
        h.broker.resend_dead_letters()  # type: ignore[attr-defined]
        (again,) = h.broker.receive([app.name + ".steps.q"], 1, 1)
        assert (again.body, again.trusted) == (step, False)
    finally:
        h.close()
    assert resend_trusted("q", step, "worker does not know step 'x'")
    assert resend_trusted("q", b'{"type":"event"}', f"event {UNSIGNED_MARK}")
    assert not resend_trusted("q", step, f"step message 'x' {UNSIGNED_MARK}")


# --- the CLI on the database broker ------------------------------------------------------------


def run(*args: str, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), input=input)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SqlStore]:
    """A database with three dead letters (ids 1, 2, 3), named by SAGALOOP_DATABASE_URL."""
    for name in list(os.environ):
        if name.startswith("SAGALOOP_"):
            monkeypatch.delenv(name)
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    store = SqlStore(url)
    store.upgrade()
    now = datetime(2026, 11, 29, 9, 4, 32, tzinfo=UTC)
    bodies = [event("r-1", "m-1", 1), b"\xff not json", event("r-3", "m-3", 3)]
    store.enqueue_raw([("dlshop.engine", b) for b in bodies], now)
    for i, row in enumerate(store.claim(None, 10, now, timedelta(seconds=60))):
        reason = "not JSON" if i == 1 else f"no run with id 'r-{i + 1}'\nsecond line"
        store.dead_letter(row.id, row.claim_token, reason, now)
    yield store
    store.close()


def test_cli_lists_shows_resends_and_purges(store: SqlStore) -> None:
    listed = run("dead-letters", "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == [
        "id",
        "queue",
        "type",
        "run",
        "bytes",
        "dead-lettered",
        "(UTC)",
        "reason",
    ]
    assert lines[2].split()[:4] == ["1", "dlshop.engine", "event", "r-1"]
    assert "2026-11-29 09:04:32  no run with id 'r-1' second line" in lines[2]
    assert lines[3].split()[:5] == ["2", "dlshop.engine", "-", "-", "10"]
    assert lines[-1] == "3 dead letters"
    report = json.loads(run("dead-letters", "list", "--json", "--limit", "2").output)
    assert report["total"] == 3 and [d["id"] for d in report["dead_letters"]] == ["1", "2"]
    assert report["dead_letters"][0]["message_id"] == "m-1"
    assert report["dead_letters"][0]["at"] == "2026-11-29T09:04:32+00:00"

    shown = run("dead-letters", "show", "1")
    assert shown.exit_code == 0, shown.output
    assert "queue          dlshop.engine" in shown.output and "run            r-1" in shown.output
    assert '"message_id": "m-1"' in shown.output, "the envelope, pretty"
    assert (
        json.loads(run("dead-letters", "show", "1", "--json").output)["envelope"]["run_id"] == "r-1"
    )
    assert "\\xff not json" in run("dead-letters", "show", "2").output
    missing = run("dead-letters", "show", "99")
    assert missing.exit_code == 1
    assert "Error: no dead letter with id '99'" in missing.output

    resent = run("dead-letters", "resend", "1")
    assert resent.exit_code == 0 and resent.output == "resent 1 to dlshop.engine\n"
    (row,) = store.claim(["dlshop.engine"], 10, datetime.now(UTC), timedelta(seconds=60))
    assert row.body == event("r-1", "m-1", 1) and row.trusted, "unchanged, as sagaloop's own"
    assert run("dead-letters", "resend", "1").exit_code == 1, "it is gone from the dead letters"

    assert run("dead-letters", "purge").exit_code == 2, "an ID or --all"
    assert run("dead-letters", "purge", "2", "--all").exit_code == 2
    declined = run("dead-letters", "purge", "--all", input="n\n")
    assert declined.exit_code == 1 and "Delete all 2 dead letters for good?" in declined.output
    assert store.count_dead_letters() == 2
    assert run("dead-letters", "purge", "2").output == "purged 2\n"
    assert run("dead-letters", "resend", "--all", input="y\n").output.endswith(
        "resent 1 dead letter (dlshop.engine: 1)\n"
    )
    assert run("dead-letters", "purge", "--all", "--yes").output == "no dead letters\n"
    assert run("dead-letters", "list").output == "no dead letters\n"


def test_cli_reports_an_unreachable_broker_in_one_line(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(self: Obj, store: SqlStore, *, connect_timeout: float | None = None) -> Any:
        raise BrokerError("cannot connect to RabbitMQ at amqp://u:***@10.0.0.1/: refused")

    monkeypatch.setattr(Obj, "broker", unreachable)
    result = run("dead-letters", "list")
    assert result.exit_code == 1
    assert result.output == (
        "Error: cannot connect to RabbitMQ at amqp://u:***@10.0.0.1/: refused\n"
    )


def test_health_counts_the_brokers_dead_letters_in_a_table(store: SqlStore) -> None:
    store.process_started("engine@h:1", "dlshop", "engine", datetime.now(UTC))
    report = json.loads(run("health", "--json").output)
    assert report["dead_letters"] == 3 and "outbox_dead_letters" not in report
    table = run("health")
    assert table.exit_code == 0, table.output
    assert "{" not in table.output and "[" not in table.output, "no Python repr"
    lines = table.output.splitlines()
    assert "dead_letters             3" in lines
    assert "runs                     none" in lines
    assert "healthy                  yes" in lines
    assert "  engine@h:1 (engine of app 'dlshop'): running" in lines
    Client(store, app).start(wait_for_go, None)
    assert "runs                     running 1" in run("health").output.splitlines()
