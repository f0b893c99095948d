"""Hostile outcomes against real processes: a step whose result cannot be stored or sent (a
lone surrogate, ``10**5000``) or that raises ``KeyboardInterrupt`` runs exactly as often as its
retry policy allows (two attempts), its run compensates with an error naming the step, and the
worker goes on serving runs. On the embedded default (one ``sagaloop dev`` process on SQLite)
and on RabbitMQ + PostgreSQL (engine and worker processes); bodies are counted in a ledger
outside the engine."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from system import HERE, ROOT, System

from sagaloop.client import Client
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration

HOSTILE = ["lone_surrogate", "huge_int", "keyboard_interrupt"]
ENDED = {"completed", "failed", "compensated", "cancelled", "needs_attention"}
ERROR_TYPES = {
    "lone_surrogate": "UnencodableResult",
    "huge_int": "UnencodableResult",
    "keyboard_interrupt": "KeyboardInterrupt",
}


def bodies(ledger: Path) -> dict[tuple[str, str], int]:
    if not ledger.exists():
        return {}
    with sqlite3.connect(ledger, timeout=60) as conn:
        try:
            rows = conn.execute("select step, what, count(*) from bodies group by step, what")
        except sqlite3.OperationalError:
            return {}
        return {(str(s), str(w)): int(n) for s, w, n in rows}


def check(client: Client, ledger: Path, runs: dict[str, str], final: Any) -> None:
    """Every hostile run compensated after two attempts; a good run then completes, and the
    hostile bodies did not run once more in the meantime."""
    statuses = eventually(final, 120, "the hostile runs to finish")
    assert statuses == {r: "compensated" for r in runs}
    counts = bodies(ledger)
    for run_id, what in runs.items():
        assert counts[("produce", what)] == 2, f"{what}: the body ran as often as max_attempts"
        assert counts[("unbook", what)] == 1
        failures = [
            e.data["error"]
            for e in client.history(run_id)
            if e.kind in ("step_retrying", "step_failed")
        ]
        assert [f["type"] for f in failures] == [ERROR_TYPES[what]] * 2
        run = client.get(run_id)
        assert "step 'produce' failed" in str(run.error)
    good = client.start("produce", "fine")
    eventually(lambda: client.get(good).status == "completed", 60, "a good run to complete")
    assert client.get(good).output == "fine"
    later = bodies(ledger)
    assert {k: v for k, v in later.items() if k[1] in runs.values()} == {
        k: v for k, v in counts.items() if k[1] in runs.values()
    }, "no hostile body ran again"


# --- the embedded default: one `sagaloop dev` process ---------------------------------------


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[tuple[Client, Path]]:
    database = f"sqlite:///{tmp_path / 'sagaloop.db'}"
    ledger = tmp_path / "ledger.db"
    env = {
        **os.environ,
        "SAGALOOP_DATABASE_URL": database,
        "LEDGER_PATH": str(ledger),
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)]),
    }
    subprocess.run(
        [sys.executable, "-m", "sagaloop", "db", "upgrade"], env=env, check=True, timeout=60
    )
    log = (tmp_path / "dev.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sagaloop", "dev", "--app", "hostileapp", "--poll", "0.05"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    store = SqlStore(database)
    try:
        yield Client(store, "hostileapp"), ledger
        assert proc.poll() is None, "dev died: " + (tmp_path / "dev.log").read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        store.close()
        log.close()


def test_hostile_outcomes_on_the_embedded_default(dev: tuple[Client, Path]) -> None:
    client, ledger = dev
    runs = {client.start("produce", what): what for what in HOSTILE}

    def final() -> dict[str, str] | None:
        statuses = {r: client.get(r).status for r in runs}
        return statuses if set(statuses.values()) <= ENDED else None

    check(client, ledger, runs, final)


# --- RabbitMQ + PostgreSQL: engine and worker processes -------------------------------------


@pytest.fixture
def hostile_system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, app="hostileapp")
    try:
        yield s
    finally:
        s.close()


def test_hostile_outcomes_on_rabbitmq_and_postgres(hostile_system: System) -> None:
    system = hostile_system
    system.engine()
    worker = system.worker(queues="work")
    system.wait_ready("engine")
    system.wait_ready("worker")
    runs = {system.client.start("produce", what): what for what in HOSTILE}

    def final() -> dict[str, str] | None:
        statuses = {r: system.client.get(r).status for r in runs}
        return statuses if set(statuses.values()) <= ENDED else None

    check(system.client, system.ledger_path, runs, final)
    assert worker.poll() is None, "the worker process must still run"
    assert system.dead_letter_count() == 0
