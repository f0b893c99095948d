"""Overload ends well: the work of runs in flight goes before new runs, an engine takes up new
runs only within its start window, and ``Client.start`` refuses a run past the start backlog
limit (see ``sagaloop/runtime/admission.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop import App, Client, OverloadedError, SagaContext, StepContext, ValidationError
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, eventually

app = App("admit")
release = threading.Event()
held = threading.Event()
quick_bodies: list[str] = []
seen_at_second: list[int] = []


@app.step(queue="q")
def first(ctx: StepContext, name: str) -> str:
    if name == "A":
        held.set()
    if name == "A" or name.startswith("held"):  # running until released
        release.wait(60)
    return name


@app.step(queue="q")
def second(ctx: StepContext, name: str) -> str:
    seen_at_second.append(len(quick_bodies))  # how many new runs went before A's next step
    return name


@app.step(queue="q")
def quick(ctx: StepContext, n: int) -> int:
    quick_bodies.append(ctx.run_id)
    return n


@app.saga(name="pair")
async def pair(ctx: SagaContext, name: str) -> str:
    return await ctx.call(second, await ctx.call(first, name))


@app.saga(name="one")
async def one(ctx: SagaContext, n: int) -> int:
    return await ctx.call(quick, n)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    release.clear()
    held.clear()
    quick_bodies.clear()
    seen_at_second.clear()
    store = SqlStore(f"sqlite:///{tmp_path / 'admit.db'}")
    store.upgrade()
    yield store
    release.set()
    store.close()


def _runtime(store: SqlStore) -> Runtime:
    broker = DatabaseBroker(store, lease=timedelta(seconds=5), poll_interval=0.02)
    return Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()


def test_a_burst_of_starts_does_not_delay_the_runs_in_flight(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run A's step result arrives behind 300 queued starts: A goes on at once, and its next
    step runs behind at most the start window's new runs, not behind the whole burst."""
    monkeypatch.setenv("SAGALOOP_START_WINDOW", "8")
    client = Client(store, app, start_backlog=0)
    runtime = _runtime(store)
    try:
        a = client.start(pair, "A")
        assert held.wait(30), "run A's first step did not start"
        burst = [client.start(one, i) for i in range(300)]
        before = len(quick_bodies)
        release.set()
        assert client.result(a, timeout=60) == "A"
        ahead = seen_at_second[0] - before
        assert ahead < 40, f"{ahead} new runs ran a step between run A's two steps"
        for run_id in burst:
            assert client.result(run_id, timeout=120) is not None
    finally:
        runtime.stop()


def test_an_engine_takes_up_new_runs_within_its_start_window(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAGALOOP_START_WINDOW", "2")
    client = Client(store, app)
    runtime = _runtime(store)
    try:
        a = client.start(pair, "A")  # holds a running run until released
        assert held.wait(30)
        runs = [client.start(pair, f"held{i}") for i in range(4)]  # each runs until released

        def started() -> int:
            with store.engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text("SELECT count(*) FROM sagaloop_runs WHERE processed_seq > 0")
                    ).scalar_one()
                )

        eventually(lambda: started() == 2, 30, "the window to fill")
        assert client.get(runs[-1]).status == "running"
        assert started() == 2, "a run past the window was taken up"
        release.set()
        for run_id in [a, *runs]:
            assert client.result(run_id, timeout=60) == client.get(run_id).input
    finally:
        runtime.stop()


def test_start_refuses_a_run_past_the_start_backlog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGALOOP_START_BACKLOG", "3")
    env = Harness(app)
    started = [env.start(one, i, run_id=f"r{i}") for i in range(3)]
    with pytest.raises(OverloadedError, match=r"3 run.s. waiting .*SAGALOOP_START_BACKLOG=3"):
        env.start(one, 9, run_id="late")
    with pytest.raises(Exception, match="no run with id 'late'"):
        env.client.get("late")  # nothing was written
    assert env.start(one, 0, run_id="r0") == "r0"  # starting a run again stays idempotent
    env.run_until_idle()
    assert [env.client.get(r).status for r in started] == ["completed"] * 3
    assert env.start(one, 9, run_id="late") == "late"  # the engine took the backlog up


def test_the_limits_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    env = Harness(app)
    monkeypatch.setenv("SAGALOOP_START_BACKLOG", "many")
    with pytest.raises(ValidationError, match="SAGALOOP_START_BACKLOG must be a whole number"):
        Client(env.store, app)
    with pytest.raises(ValidationError, match=r"must be 0 \(no limit\) or more, not -1"):
        Client(env.store, app, start_backlog=-1)
    monkeypatch.setenv("SAGALOOP_START_BACKLOG", "0")
    client = Client(env.store, app)
    for i in range(5):  # no limit
        client.start(one, i)


def test_a_database_upgraded_to_v5_indexes_the_start_backlog(tmp_path: Path) -> None:
    from sagaloop.store import migrations

    store = SqlStore(f"sqlite:///{tmp_path / 'v4.db'}")
    store.upgrade()
    indexes = ("sagaloop_runs_app",)
    with store.engine.begin() as conn:  # as version 4 left it
        for index in indexes:
            conn.execute(sa.text(f"DROP INDEX {index}"))
        conn.execute(sa.text("UPDATE sagaloop_schema SET version = 4"))
    assert store.upgrade() == (4, migrations.LATEST)
    names = {i["name"] for i in sa.inspect(store.engine).get_indexes("sagaloop_runs")}
    assert set(indexes) <= names
    store.close()


def test_the_cli_refuses_a_start_past_the_backlog_and_health_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from click.testing import CliRunner

    from sagaloop.cli.main import cli

    (tmp_path / "admitapp.py").write_text(
        "from sagaloop import App, SagaContext\n"
        "app = App('admitapp')\n"
        "@app.saga(name='noop')\n"
        "async def noop(ctx: SagaContext) -> None:\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", f"sqlite:///{tmp_path / 'a.db'}")
    monkeypatch.setenv("SAGALOOP_START_BACKLOG", "1")

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, list(args), catch_exceptions=False)

    run("db", "upgrade")
    assert run("start", "noop", "--run-id", "r-1", "--app", "admitapp").exit_code == 0
    refused = run("start", "noop", "--run-id", "r-2", "--app", "admitapp")
    assert refused.exit_code == 1
    assert "1 run(s) waiting for an engine" in refused.output
    assert "Traceback" not in refused.output
    health = run("health", "--json")
    checks = json.loads(health.output)
    assert health.exit_code == 1
    assert checks["start_backlog"] == {"admitapp": 1} and checks["start_backlog_limit"] == 1
    assert "'admitapp' at the start backlog limit (1)" in checks["admission"]


def test_an_idle_engine_counts_its_running_runs_once_per_recount(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: while no new run is taken up, a count holds for RECOUNT seconds (the start
    queue is looked at every --poll); a batch taken up makes the next turn count again, and
    so does a window without room for two batches at the last count."""
    from sagaloop.runtime import admission

    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    counts: list[int] = []
    running = [3]

    def count_running(app: str, *, started: bool, at_most: int) -> int:
        counts.append(1)
        return running[0]

    monkeypatch.setattr(store, "count_running", count_running)
    gate = admission.StartGate(store, app.name, window=16)
    for _ in range(10):
        assert gate.wait_turn(0, 4) == 4
        gate.taken(0)
    assert len(counts) == 1, "idle: one count"
    now[0] += admission.RECOUNT
    assert gate.wait_turn(0, 4) == 4 and len(counts) == 2, "counted again after RECOUNT"
    gate.taken(4)
    running[0] = 9
    assert gate.wait_turn(0, 4) == 4 and len(counts) == 3, "runs were taken up: counted"
    gate.taken(0)
    assert gate.wait_turn(0, 4) == 4 and len(counts) == 4, "no room for two batches: counted"
