"""SIGKILL a real `sagaloop dev` process while step two executes, start it again, and check from
the ledger outside the engine that every effect happened exactly once."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaloop.testing import eventually

HERE = Path(__file__).parent
pytestmark = pytest.mark.chaos


class Env:
    def __init__(self, tmp: Path, hang_at: str) -> None:
        self.ledger = tmp / "ledger.db"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "SAGALOOP_LEASE": "2",
            "LEDGER_PATH": str(self.ledger),
            "HANG_AT": hang_at,
            "PYTHONPATH": str(HERE),
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            check=True,
            timeout=60,
        )
        return out.stdout.decode().strip()

    def dev(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", "killapp", "--poll", "0.05"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def status(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.cli("status", run_id, "--json"))
        return data

    def rows(self, sql: str) -> list[tuple[object, ...]]:
        if not self.ledger.exists():
            return []
        with sqlite3.connect(self.ledger, timeout=30) as conn:
            try:
                return list(conn.execute(sql))
            except sqlite3.OperationalError:
                return []  # tables not created yet


@pytest.fixture
def make_env(tmp_path: Path) -> Iterator[Callable[[str], Env]]:
    envs: list[Env] = []

    def make(hang_at: str) -> Env:
        envs.append(Env(tmp_path, hang_at))
        return envs[-1]

    yield make
    for env in envs:
        for proc in env.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.parametrize("hang_at", ["two-before-effect", "two-after-effect"])
def test_sigkill_while_step_two_runs(make_env: Callable[[str], Env], hang_at: str) -> None:
    env = make_env(hang_at)
    env.cli("db", "upgrade")
    run_id = env.cli("start", "three-steps", "--input", '"order-7"', "--app", "killapp")
    first = env.dev()
    marker = "two" if hang_at == "two-before-effect" else None
    eventually(
        lambda: (
            bool(env.rows("select 1 from runs_of_body where step = 'two'"))
            and (marker is not None or bool(env.rows("select 1 from effects where step = 'two'")))
        ),
        what="step two to be executing",
    )
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert env.rows("select count(*) from runs_of_body where step = 'three'") == [(0,)]

    second = env.dev()
    eventually(lambda: env.status(run_id)["status"] == "completed", what="completion")
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, "dev must stop cleanly on SIGTERM"

    effects = env.rows("select step, count(*) from effects group by step order by step")
    assert effects == [("one", 1), ("three", 1), ("two", 1)]
    bodies = env.rows("select step, key, attempt, in_doubt from runs_of_body order by rowid")
    assert [b[0] for b in bodies if b[0] == "one"] == ["one"], "step one ran again"
    two = [b for b in bodies if b[0] == "two"]
    keys = {b[1] for b in two}
    assert keys == {f"{run_id}/1/do"}, "step two must keep its idempotency key"
    states = [s["state"] for s in env.status(run_id)["steps"]]
    if hang_at == "two-after-effect":
        # The effect happened before the kill: the in-doubt redelivery is reconciled, the body
        # does not run a second time.
        assert len(two) == 1
        assert states == ["completed", "reconciled", "completed"]
    else:
        # Killed before the effect: the redelivered attempt is in doubt, reconcile finds
        # nothing, and the step runs again with the same key.
        assert len(two) == 2 and two[1][3] == 1
        assert states == ["completed", "completed", "completed"]
