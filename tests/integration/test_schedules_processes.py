"""Schedules (issue 25) on real processes: ``sagaloop dev`` (SQLite) with a schedule every
second starts runs, and a second ``dev`` process on the same database does not double them:
one run per tick, each tick's step run once; ``sagaloop schedule pause`` stops them."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import App, SagaContext
from sagaloop.runtime.schedules import Scheduler
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually, services
from sagaloop.testing.harness import VirtualClock

pytestmark = pytest.mark.integration

APP = """
import os
from datetime import timedelta
from sagaloop import App, SagaContext, StepContext

app = App("tickapp")

@app.step(local=True)
def record(ctx: StepContext, tick: int) -> int:
    with open(os.environ["EFFECTS_PATH"], "a") as out:  # one line per execution of the body
        out.write(ctx.run_id + "\\n")
    return tick

@app.schedule(every=timedelta(seconds=1), input=1)
@app.saga(name="tick")
async def tick(ctx: SagaContext, n: int) -> int:
    return await ctx.call(record, n)
"""


class Devs:
    def __init__(self, tmp: Path) -> None:
        (tmp / "tickapp.py").write_text(APP)
        self.db = tmp / "sagaloop.db"
        self.effects = tmp / "effects.txt"
        self.effects.touch()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")} | {
            "SAGALOOP_DATABASE_URL": f"sqlite:///{self.db}",
            "SAGALOOP_RUN_DIR": str(tmp / "run"),
            "EFFECTS_PATH": str(self.effects),
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
        }
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        log = open(self.tmp / f"dev-{len(self.procs)}.log", "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "dev", "--app", "tickapp"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def sagaloop(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            timeout=60,
            check=True,
        )
        return out.stdout.decode()

    def runs(self) -> list[tuple[str, str]]:
        if not self.db.exists():
            return []
        with sqlite3.connect(self.db, timeout=30) as conn:
            try:
                q = "select run_id, status from sagaloop_runs where app = 'tickapp'"
                return sorted(conn.execute(q).fetchall())
            except sqlite3.OperationalError:  # the schema is not there yet
                return []

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-1500:] for p in self.tmp.glob("dev-*.log"))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def devs(tmp_path: Path) -> Iterator[Devs]:
    d = Devs(tmp_path)
    try:
        yield d
    finally:
        d.close()


def test_two_dev_processes_start_one_run_per_tick(devs: Devs) -> None:
    devs.start()
    eventually(lambda: len(devs.runs()) >= 2, 60, "the first dev process to start runs")
    devs.start()  # a second engine on the same database fires the same ticks
    eventually(lambda: len(devs.runs()) >= 2, 10, "runs")
    begun = time.monotonic()
    first = len(devs.runs())
    eventually(lambda: len(devs.runs()) >= first + 6, 60, f"6 more ticks: {devs.logs()}")
    elapsed = time.monotonic() - begun
    runs = devs.runs()
    ticks = [run_id.rsplit(":", 1)[1] for run_id, _ in runs]
    assert all(r.startswith("schedule:tickapp:tick:") for r, _ in runs), runs
    assert len(set(ticks)) == len(ticks)
    # one run per tick (a second), not two: at most one per elapsed second, and a tick a run
    assert len(runs) - first <= elapsed + 2, (len(runs), first, elapsed)

    devs.sagaloop("schedule", "pause", "tick")
    eventually(lambda: all(s == "completed" for _, s in devs.runs()), 60, "the runs to finish")
    paused = len(devs.runs())
    listed = devs.sagaloop("schedule", "list")
    assert "tick" in listed and "paused" in listed, listed
    done = devs.runs()
    effects = devs.effects.read_text().split()
    assert sorted(effects) == sorted(r for r, _ in done), "each run's step ran once"
    # nothing starts while paused: the next ticks pass (checked by the clock, not a sleep)
    deadline = time.monotonic() + 3
    eventually(lambda: time.monotonic() > deadline, 10, "three ticks to pass", interval=0.2)
    assert len(devs.runs()) == paused


def test_engines_on_postgres_start_one_run_per_tick_and_catch_up(postgres_url: str) -> None:
    """The schedules store on PostgreSQL: two schedulers on one database fire each tick into
    one run, concurrently, and catch up the latest tick after a downtime."""
    app = App("pgsched")

    @app.schedule(every=timedelta(minutes=1), input=None)
    @app.saga(name="tick")
    async def tick(ctx: SagaContext) -> None:
        return None

    url, drop = services.fresh_database(postgres_url)
    store = SqlStore(url)
    store.upgrade()
    clock = VirtualClock()
    engines = [Scheduler(app, store, clock) for _ in range(2)]
    try:
        for engine in engines:
            engine.sync()
        with ThreadPoolExecutor(2) as pool:
            for _ in range(5):
                clock.advance(timedelta(minutes=1))
                list(pool.map(lambda e: e.fire_due(), engines))
        runs = sorted(r.run_id for r in store.list_runs(app="pgsched", limit=100))
        assert runs == [f"schedule:pgsched:tick:20260101T00{m:02d}00Z" for m in range(1, 6)]
        clock.advance(timedelta(minutes=30, seconds=30))  # both engines were down
        assert sum(engine.fire_due() for engine in engines) == 1
        runs = sorted(r.run_id for r in store.list_runs(app="pgsched", limit=100))
        assert runs[5:] == ["schedule:pgsched:tick:20260101T003500Z"]
        (row,) = store.list_schedules("pgsched")
        assert row.next_tick == clock.now().replace(second=0) + timedelta(minutes=1)
    finally:
        store.close()
        drop()
