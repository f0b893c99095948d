"""The process registry behind `sagaloop health`, and the Runtime's guard of its threads: a thread
that dies stops the runtime and is reported, in the process and in the registry.

``RegistryContract`` runs here on SQLite and in tests/integration/test_processes_postgres.py on
PostgreSQL."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from sagaloop import App, Client, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.cli.main import cli
from sagaloop.runtime import crashpoints
from sagaloop.runtime import registry as p
from sagaloop.runtime.service import Runtime
from sagaloop.store.processes import ProcessRecord
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, eventually

T0 = datetime(2001, 2, 3, 4, 5, 6, tzinfo=UTC)  # long ago: pruning it touches no live row


class RegistryContract:
    """What every database must do for the registry (``store`` is given by a subclass)."""

    @pytest.fixture
    def name(self) -> str:
        return f"engine@host-{uuid.uuid4().hex[:8]}:1"

    def row(self, store: SqlStore, name: str) -> ProcessRecord:
        [row] = [r for r in store.processes() if r.name == name]
        return row

    def test_started_seen_and_stopped(self, store: SqlStore, name: str) -> None:
        store.process_started(name, "shop", "engine", T0)
        assert self.row(store, name) == ProcessRecord(name, "shop", "engine", T0, T0, None, None)
        assert store.process_seen(name, T0 + timedelta(seconds=5), "stalled")
        row = self.row(store, name)
        assert (row.seen_at, row.problem) == (T0 + timedelta(seconds=5), "stalled")
        assert store.process_seen(name, T0 + timedelta(seconds=10), None), "a problem can clear"
        store.process_stopped(name, T0 + timedelta(seconds=11), "thread 'engine' died: X")
        row = self.row(store, name)
        assert row.stopped_at == row.seen_at == T0 + timedelta(seconds=11)
        assert row.problem == "thread 'engine' died: X"

    def test_a_name_started_again_replaces_its_row(self, store: SqlStore, name: str) -> None:
        store.process_started(name, "shop", "engine", T0)
        store.process_stopped(name, T0, "died")
        later = T0 + timedelta(minutes=1)
        store.process_started(name, "shop", "engine", later)
        assert self.row(store, name) == ProcessRecord(
            name, "shop", "engine", later, later, None, None
        )

    def test_seen_without_a_row_says_so(self, store: SqlStore, name: str) -> None:
        assert store.process_seen(name, T0, None) is False
        assert not [r for r in store.processes() if r.name == name]

    def test_rows_not_seen_since_are_pruned(self, store: SqlStore, name: str) -> None:
        old, fresh = f"{name}-old", f"{name}-fresh"
        store.process_started(old, "shop", "worker", T0 - timedelta(days=2))
        store.process_started(fresh, "shop", "worker", T0 - timedelta(hours=1))
        assert store.prune_processes(T0 - timedelta(days=1)) == 1
        names = {r.name for r in store.processes()}
        assert fresh in names and old not in names

    def test_a_registration_stores_any_problem_text(self, store: SqlStore, name: str) -> None:
        clock = VirtualClock(T0)
        reg = p.Registration(store, name, "shop", "engine", clock)
        reg.beat(["cut mid-emoji \ud83d", "nul \x00 byte", "x" * 5000])  # registers on the way
        problem = self.row(store, name).problem
        assert problem is not None and len(problem) == p.MAX_PROBLEM
        assert problem.startswith("cut mid-emoji \\ud83d; nul \\x00 byte; xxx")
        store.prune_processes(T0 + timedelta(days=1))  # as if pruned while this one was stuck
        clock.advance(timedelta(seconds=5))
        reg.beat([])
        row = self.row(store, name)
        assert (row.seen_at, row.problem) == (T0 + timedelta(seconds=5), None)
        reg.stopped(["thread 'relay' died: SystemExit: 3"])
        assert self.row(store, name).problem == "thread 'relay' died: SystemExit: 3"


class TestRegistryOnSqlite(RegistryContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[SqlStore]:
        store = SqlStore(f"sqlite:///{tmp_path / 'p.db'}")
        store.upgrade()
        yield store
        store.close()


# --- what health makes of the rows ------------------------------------------------------------


def record(
    name: str, *, seen: float, stopped: float | None = None, problem: str | None = None
) -> ProcessRecord:
    now = T0 + timedelta(hours=1)
    stopped_at = None if stopped is None else now - timedelta(seconds=stopped)
    seen_at = now - timedelta(seconds=seen)
    return ProcessRecord(name, "shop", name.partition("@")[0], T0, seen_at, problem, stopped_at)


def test_assess_fails_only_for_recent_problems() -> None:
    rows = [
        record("engine@a:1", seen=1),
        record("engine@a:2", seen=2, problem="activation of run r stalled for 9 s"),
        record("worker@b:3", seen=30, problem="thread 'worker-0' died: X"),  # recent, stuck
        record("worker@b:4", seen=600),  # SIGKILLed: no stopped_at, never failed for
        record("dev@a:5", seen=20, stopped=20, problem="thread 'engine' died: Y"),
        record("dev@a:6", seen=120, stopped=120, problem="thread 'engine' died: Z"),  # too old
        record("worker@b:7", seen=3, stopped=3),  # stopped cleanly
    ]
    listed, problems = p.assess(rows, T0 + timedelta(hours=1))
    states = {e["name"]: e["state"] for e in listed}
    assert states == {
        "engine@a:1": "running",
        "engine@a:2": "running",
        "worker@b:3": "not seen for 30 s",
        "worker@b:4": "not seen for 600 s",
        "dev@a:5": "exited 20 s ago because of a problem",
        "dev@a:6": "exited 120 s ago because of a problem",
        "worker@b:7": "stopped 3 s ago",
    }
    assert problems == [
        "engine@a:2 (engine of app shop): activation of run r stalled for 9 s",
        "worker@b:3 (worker of app shop): thread 'worker-0' died: X",
        "dev@a:5 (dev of app shop) exited 20 s ago: thread 'engine' died: Y",
    ]
    listed, problems = p.assess(rows, T0 + timedelta(hours=1), host="a")
    assert {e["name"] for e in listed} == {"engine@a:1", "engine@a:2", "dev@a:5", "dev@a:6"}
    assert len(problems) == 2


def test_health_lists_a_killed_process_without_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'h.db'}"
    monkeypatch.setenv("SAGALOOP_DATABASE_URL", url)
    store = SqlStore(url)
    store.upgrade()
    now = datetime.now(UTC)
    store.process_started("worker@gone:9", "shop", "worker", now - timedelta(minutes=5))
    store.process_seen("worker@gone:9", now - timedelta(minutes=4), None)
    result = CliRunner().invoke(cli, ["health", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["services"] == "ok", result.output
    assert report["processes"][0]["state"].startswith("not seen for 2")
    store.process_seen("worker@gone:9", now, "activation of run r stalled")
    result = CliRunner().invoke(cli, ["health"])
    assert result.exit_code == 1
    assert "worker@gone:9 (worker of app shop): activation of run r stalled" in result.output
    assert "worker@gone:9 (worker of app 'shop'): running" in result.output
    store.close()


# --- the Runtime's guard ----------------------------------------------------------------------

app = App("guarded")


@app.step(queue="q")
def echo(ctx: StepContext, n: int) -> int:
    return n


@app.saga(name="one-step")
async def one_step(ctx: SagaContext, n: int) -> int:
    return await ctx.call(echo, n)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'rt.db'}")
    store.upgrade()
    yield store
    crashpoints.disarm()
    store.close()


def test_a_thread_that_dies_stops_the_runtime_and_is_reported(store: SqlStore) -> None:
    broker = DatabaseBroker(store, lease=timedelta(milliseconds=500), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, concurrency=2, name="dev@here:1")
    died = threading.Event()
    crashpoints.arm("worker.before_commit:raise")
    runtime.start(registry=store, role="dev", on_death=died.set)
    client = Client(store, app)
    run_id = client.start(one_step, 1)
    eventually(died.is_set, 20, "a worker thread to die")
    assert runtime.stopping.is_set(), "a death stops the whole runtime"
    [(thread, why)] = runtime.deaths.items()
    assert thread.startswith("worker-") and why.startswith("CrashPointRaised: crash point")
    [row] = store.processes()
    assert row.problem == f"thread {thread!r} died: {why}" and row.stopped_at is None
    runtime.stop(timeout=10)
    assert not [t for t in runtime.threads if t.is_alive()], "every thread ends"
    [row] = store.processes()
    assert row.stopped_at is not None and row.problem == f"thread {thread!r} died: {why}"
    assert client.get(run_id).status == "running", "the message is left to be redelivered"

    again = Runtime(app, store, broker, poll=0.02, concurrency=2, name="dev@here:2")
    again.start(registry=store, role="dev")
    assert client.result(run_id, timeout=20) == 1
    again.stop()
    assert not again.deaths
    assert {r.name: r.problem for r in store.processes()}["dev@here:2"] is None


def test_problems_collects_the_engine_problems(store: SqlStore) -> None:
    runtime = Runtime(app, store, DatabaseBroker(store), engine=False, queues=[], timers=False)

    def broken() -> list[str]:
        raise RuntimeError("watchdog gone")

    runtime.engine_problems.append(lambda: ["activation of run r stalled for 3 s"])
    runtime.engine_problems.append(broken)
    runtime.deaths["relay"] = "SystemExit: 2"
    assert runtime.problems() == [
        "thread 'relay' died: SystemExit: 2",
        "activation of run r stalled for 3 s",
        "could not check test_problems_collects_the_engine_problems.<locals>.broken: "
        "RuntimeError('watchdog gone')",
    ]


def test_a_loop_that_returns_while_running_is_a_death(store: SqlStore) -> None:
    runtime = Runtime(app, store, DatabaseBroker(store), engine=False, queues=[], timers=False)
    runtime._spawn("quitter", lambda: None)
    died = threading.Event()
    runtime.start(on_death=died.set)
    eventually(died.is_set, 10, "the death")
    assert runtime.deaths == {"quitter": "its loop returned while the process was running"}
    runtime.stop()


def test_a_crash_point_armed_to_raise_raises_once_in_the_thread() -> None:
    with pytest.raises(ValueError, match="NAME:N:raise"):
        crashpoints.arm("engine.after_commit:raise:2")
    crashpoints.arm("engine.after_commit:2:raise")
    try:
        crashpoints.crash_point("engine.after_commit")
        with pytest.raises(crashpoints.CrashPointRaised):
            crashpoints.crash_point("engine.after_commit")
        crashpoints.crash_point("engine.after_commit")  # once: the others finish their work
    finally:
        crashpoints.disarm()


def test_a_death_is_described_even_when_its_message_is_hostile() -> None:
    class Unprintable(BaseException):
        def __str__(self) -> str:
            raise ValueError("no")

    assert p.describe(SystemExit("cut \ud83d")) == "SystemExit: cut \\ud83d"
    assert p.describe(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert p.describe(Unprintable()) == "Unprintable: <str() of the exception failed>"


def test_an_outage_of_a_background_write_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    from sagaloop.runtime.registry import Outage

    outage, down = Outage(), [True]

    def write() -> None:
        if down[0]:
            raise OSError("disk full")

    with caplog.at_level("WARNING", logger="sagaloop.runtime.registry"):
        for _ in range(3):
            outage.attempt(write, "could not write %s (%s)", "x")
        assert [r.getMessage() for r in caplog.records] == ["could not write x (disk full)"]
        down[0] = False
        outage.attempt(write, "could not write %s (%s)", "x")
        assert not outage.failing
        down[0] = True
        outage.attempt(write, "could not write %s (%s)", "x")
    assert len(caplog.records) == 2, "a new outage is said again"
