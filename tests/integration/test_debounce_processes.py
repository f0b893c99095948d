"""Debounce (issue 25, item 6) on real processes: two ``sagaloop dev`` processes on one
database (SQLite, and PostgreSQL) both look for due debounce windows on their timers'
threads; a burst of starts per key makes one run per key, with the key's last input, its step
run once; a start after the window ran opens the next window."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from sagaloop import Client
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually, services

pytestmark = pytest.mark.integration

APP = """
import os
from datetime import timedelta
from typing import Any
from sagaloop import App, Debounce, SagaContext, StepContext

app = App("bounceapp")

@app.step(local=True)
def record(ctx: StepContext, input: dict[str, Any]) -> dict[str, Any]:
    with open(os.environ["EFFECTS_PATH"], "a") as out:  # one line per execution of the body
        out.write(ctx.run_id + "\\n")
    return input

@app.saga(name="summarize", debounce=Debounce(timedelta(seconds=1.5), key=lambda i: i["user"]))
async def summarize(ctx: SagaContext, input: dict[str, Any]) -> dict[str, Any]:
    return await ctx.call(record, input)
"""
USERS = ("ann", "bob", "cy")


class Devs:
    def __init__(self, tmp: Path, url: str) -> None:
        (tmp / "bounceapp.py").write_text(APP)
        self.url = url
        self.effects = tmp / "effects.txt"
        self.effects.touch()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SAGALOOP_")} | {
            "SAGALOOP_DATABASE_URL": self.url,
            "SAGALOOP_RUN_DIR": str(tmp / "run"),
            "EFFECTS_PATH": str(self.effects),
            "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]),
        }
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        spec = importlib.util.spec_from_file_location("bounceapp", tmp / "bounceapp.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.app = module.app  # the clients need the saga's declaration: its debounce

    def start(self) -> None:
        log = open(self.tmp / f"dev-{len(self.procs)}.log", "wb")  # noqa: SIM115
        self.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sagaloop", "dev", "--app", "bounceapp"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def live(self, store: SqlStore) -> int:
        q = sa.select(t.processes.c.name).where(t.processes.c.stopped_at.is_(None))
        with store.engine.connect() as conn:
            return len(conn.execute(q).all())

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


@pytest.fixture(params=["sqlite", "postgres"])
def devs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Devs]:
    drop = None
    if request.param == "postgres":
        url, drop = services.fresh_database(request.getfixturevalue("postgres_url"))
    else:
        url = f"sqlite:///{tmp_path / 'sagaloop.db'}"
    d = Devs(tmp_path, url)
    try:
        yield d
    finally:
        d.close()
        if drop is not None:
            drop()


def test_two_dev_processes_start_one_run_per_window(devs: Devs) -> None:
    store = SqlStore(devs.url)
    store.upgrade()  # the schema first: the processes' rows are read from the start
    devs.start()
    devs.start()
    try:
        eventually(lambda: devs.live(store) >= 2, 60, f"both dev processes to run: {devs.logs()}")
        client = Client(store, devs.app)
        windows: dict[str, set[str]] = {user: set() for user in USERS}
        for n in range(5):  # a burst: each key's starts within the period of each other
            for user in USERS:
                windows[user].add(client.start("summarize", {"user": user, "n": n}))
        assert all(len(ids) == 1 for ids in windows.values()), windows
        run_of = {user: next(iter(ids)) for user, ids in windows.items()}
        assert len(set(run_of.values())) == len(USERS), "a window per key"
        pending = client.pending("summarize")
        assert sorted((w.key, w.starts) for w in pending) == [(u, 5) for u in USERS]

        def done() -> bool:
            runs = store.list_runs(saga="summarize", limit=100)
            return len(runs) >= len(USERS) and all(r.status == "completed" for r in runs)

        eventually(done, 60, f"one run per key to complete: {devs.logs()}")
        for user, run_id in run_of.items():
            assert client.result(run_id, timeout=10) == {"user": user, "n": 4}  # the last input
        # a period later (both engines looked again many times) still one run per window
        deadline = time.monotonic() + 2
        eventually(lambda: time.monotonic() > deadline, 10, "a period to pass", interval=0.2)
        assert sorted(r.run_id for r in store.list_runs(saga="summarize", limit=100)) == sorted(
            run_of.values()
        )
        assert client.pending() == []
        effects = devs.effects.read_text().split()
        assert sorted(effects) == sorted(run_of.values()), "each run's step ran once"

        again = client.start("summarize", {"user": "ann", "n": 5})  # the next window of ann
        assert again not in run_of.values()
        assert client.result(again, timeout=60) == {"user": "ann", "n": 5}
        assert len(store.list_runs(saga="summarize", limit=100)) == len(USERS) + 1
    finally:
        store.close()
