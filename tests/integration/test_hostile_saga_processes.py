"""Hostile saga code against real processes: a saga that loops without awaiting, and one that
raises KeyboardInterrupt, on the embedded default (`sagaloop dev` on SQLite) and on RabbitMQ +
PostgreSQL. The run is parked (or fails and compensates), the engine goes on with other runs,
and the embedded database stays usable for `start`, `list` and `health` meanwhile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from system import HERE, ROOT, System, eventually

pytestmark = pytest.mark.integration


class Dev:
    """A real `sagaloop dev` process on a SQLite file."""

    def __init__(self, tmp: Path, app: str = "sagaapp", **settings: str) -> None:
        self.ledger = tmp / "ledger.db"
        self.env = {
            **os.environ,
            **settings,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "LEDGER_PATH": str(self.ledger),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
        }
        self.log = tmp / "dev.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", app, "--poll", "0.05"],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
        )

    def cli(self, *args: str, timeout: float = 15) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
        )
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode().strip()

    def status(self, run_id: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.cli("status", run_id, "--json"))
        return data

    def effects(self) -> list[str]:
        import sqlite3

        if not self.ledger.exists():
            return []
        with sqlite3.connect(self.ledger, timeout=60) as conn:
            return [r[0] for r in conn.execute("select step from effects")]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_embedded_a_saga_that_never_yields_parks_and_the_database_stays_usable(
    tmp_path: Path,
) -> None:
    dev = Dev(tmp_path)
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        stuck = dev.cli("start", "spin", "--input", '"spinner"', "--app", "sagaapp")
        eventually(lambda: "spinner" in dev.effects(), what="the step before the loop")
        # While the saga code spins (and after), the embedded database answers at once.
        began = time.monotonic()
        other = dev.cli("start", "greet", "--input", '"neighbour"', "--app", "sagaapp")
        dev.cli("list")
        subprocess.run(
            [sys.executable, "-m", "sagaloop", "health"], env=dev.env, timeout=15, check=False
        )
        assert time.monotonic() - began < 10, "the CLI waited for the spinning saga"
        eventually(lambda: dev.status(other)["status"] == "completed", what="the other run")
        eventually(
            lambda: dev.status(stuck)["status"] == "needs_attention", what="the spinner parked"
        )
        assert "without yielding" in json.dumps(dev.status(stuck))
        assert dev.proc.poll() is None, dev.log.read_text()
        assert sorted(dev.effects()) == ["neighbour", "spinner"]
    finally:
        dev.close()


def test_embedded_keyboard_interrupt_in_saga_code_fails_the_run_not_the_engine(
    tmp_path: Path,
) -> None:
    dev = Dev(tmp_path)
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        bad = dev.cli("start", "interrupt", "--input", '"x"', "--app", "sagaapp")
        eventually(lambda: dev.status(bad)["status"] == "compensated", what="the run to fail")
        other = dev.cli("start", "greet", "--input", '"after"', "--app", "sagaapp")
        eventually(lambda: dev.status(other)["status"] == "completed", what="the next run")
        assert dev.proc.poll() is None, dev.log.read_text()
        assert sorted(dev.effects()) == ["after", "undo x", "x"]
    finally:
        dev.close()


def test_embedded_saga_code_stuck_in_a_c_call_makes_health_fail_naming_it(
    tmp_path: Path,
) -> None:
    """A `time.sleep` in saga code cannot be interrupted: the process reports the stalled
    activation, and `sagaloop health` fails naming it, until the call returns."""
    dev = Dev(tmp_path, SAGALOOP_ACTIVATION_DEADLINE="0.2")  # stalled after 15 x 0.2 s
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        stuck = dev.cli("start", "stuck", "--input", "12", "--app", "sagaapp")

        def health() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(
                [sys.executable, "-m", "sagaloop", "health"],
                env=dev.env,
                capture_output=True,
                timeout=30,
            )

        report = eventually(
            lambda: (out := health()).returncode == 1 and b"without yielding" in out.stdout and out,
            timeout=25,
            what="health to report the stalled activation",
        )
        assert b"stuck" in report.stdout, report.stdout.decode()
        eventually(lambda: dev.status(stuck)["status"] == "completed", timeout=30, what="it")
        eventually(lambda: health().returncode == 0, timeout=20, what="health again")
    finally:
        dev.close()


@pytest.fixture
def sagas(tmp_path: Path, rabbitmq_url: str) -> Any:
    s = System(tmp_path, rabbitmq_url, app="sagaapp")
    try:
        yield s
    finally:
        s.close()


def test_rabbitmq_hostile_saga_code_is_parked_or_failed_and_the_engine_goes_on(
    sagas: System,
) -> None:
    sagas.engine()
    sagas.worker(queues="work")
    sagas.wait_ready()
    stuck = sagas.client.start("spin", "spinner")
    bad = sagas.client.start("interrupt", "x")
    ok = [sagas.client.start("greet", f"n{i}") for i in range(5)]
    assert sagas.wait_final([bad, *ok]) == {bad: "compensated", **dict.fromkeys(ok, "completed")}
    eventually(
        lambda: sagas.store.get_run(stuck).status == "needs_attention",  # type: ignore[union-attr]
        what="the spinner parked",
    )
    run = sagas.store.get_run(stuck)
    assert run is not None and run.reason and "without yielding" in run.reason
    assert all(p.poll() is None for p in sagas.procs), sagas.logs()
    counts = {r[0]: r[1] for r in sagas.ledger("select step, count(*) from effects group by step")}
    assert counts == {"spinner": 1, "x": 1, "undo x": 1, **{f"n{i}": 1 for i in range(5)}}
