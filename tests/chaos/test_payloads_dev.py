"""Large payloads on a real `sagaloop dev` process (the embedded default: SQLite, the outbox
table as the queue): a 3 MiB step result and a 2 MiB step argument used to be dead-lettered by
the engine's consumer (over the 1 MiB message limit) and the run waited for ever. The process
is killed while the run waits, so the result comes back from the history on disk."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from sagaloop.sagas.convert import MAX_VALUE_BYTES
from sagaloop.store.payloads import OFFLOAD_BYTES
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

APPS = Path(__file__).parents[1] / "integration"  # payloadapp.py
MiB = 1024 * 1024
pytestmark = pytest.mark.chaos


def test_large_payloads_on_sagaloop_dev_across_a_kill(tmp_path: Path) -> None:
    db = tmp_path / "sagaloop.db"
    env = {
        **os.environ,
        "SAGALOOP_DATABASE_URL": f"sqlite:///{db}",
        "SAGALOOP_LEASE": "2",
        "PYTHONPATH": str(APPS),
    }

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "sagaloop", *args], env=env, capture_output=True, timeout=60
        )
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode().strip()

    procs: list[subprocess.Popen[bytes]] = []

    def dev() -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "sagaloop", "dev", "--app", "payloadapp", "--poll", "0.05"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
        return procs[-1]

    def status(run_id: str) -> str:
        found = store.get_run(run_id)
        return found.status if found else "absent"

    cli("db", "upgrade")
    store = SqlStore(f"sqlite:///{db}")
    finished = ("completed", "failed", "compensated")
    try:
        first = dev()
        run = cli("start", "agent", "--input", str(3 * MiB), "--app", "payloadapp")
        over = cli("start", "overflow", "--input", str(MAX_VALUE_BYTES + 1), "--app", "payloadapp")
        eventually(lambda: status(run) == "waiting", 60, "the transcript")
        first.send_signal(signal.SIGKILL)  # the result comes back from the history on disk
        first.wait(timeout=30)
        cli("send-event", run, "go")
        second = dev()
        eventually(lambda: status(run) in finished, 60, "the run to finish")
        eventually(lambda: status(over) in finished, 60, "the overflowing run to finish")
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0, "dev must stop cleanly on SIGTERM"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    done = store.get_run(run)
    assert done is not None and (done.status, done.output) == ("completed", [3 * MiB, 2 * MiB])
    failed = store.get_run(over)
    assert failed is not None and failed.status in ("failed", "compensated")
    assert str(MAX_VALUE_BYTES) in str(failed.error)
    store.close()

    with sqlite3.connect(db) as conn:

        def largest(table: str, column: str) -> int:
            sql = f"select coalesce(max(length({column})), 0) from sagaloop_{table}"
            return int(conn.execute(sql).fetchone()[0])

        assert conn.execute("select count(*) from sagaloop_dead_letters").fetchone() == (0,)
        for table, column in [("history", "data"), ("runs", "input"), ("runs", "output")]:
            assert largest(table, column) < OFFLOAD_BYTES, f"{table}.{column}"
        assert largest("inbox", "result") < OFFLOAD_BYTES
        assert conn.execute("select max(size) from sagaloop_payloads").fetchone()[0] >= 3 * MiB
