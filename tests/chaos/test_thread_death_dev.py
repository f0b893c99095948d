"""A thread of a real `sagaloop dev` process (the embedded default) dies of a BaseException that
no handler absorbs: the process must stop consuming and exit non-zero saying which thread died
and why, `sagaloop health` must fail naming it, and a restart must complete the run with every
effect applied once (counted by the ledger outside the engine).

The death is injected with a crash point armed with ``:raise`` (it raises a BaseException in the
thread that passes there), so the test holds whatever user code's BaseExceptions become."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaloop.testing import eventually

HERE = Path(__file__).parent
pytestmark = pytest.mark.chaos
EXIT_THREAD_DIED = 70  # documented in docs/operations.md (EX_SOFTWARE)


class Dev:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ledger = tmp / "ledger.db"
        self.env = {
            **os.environ,
            "SAGALOOP_DATABASE_URL": f"sqlite:///{tmp / 'sagaloop.db'}",
            "SAGALOOP_LEASE": "2",
            "LEDGER_PATH": str(self.ledger),
            "PYTHONPATH": str(HERE),
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "sagaloop", *args],
            env=self.env,
            capture_output=True,
            check=check,
            timeout=60,
        )

    def start(self, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"dev-{len(self.procs)}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", "dev", "--app", "killapp", "--poll", "0.05"],
            env={**self.env, **env},
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
        )
        self.procs.append(proc)
        return proc, log

    def health(self) -> tuple[int, dict[str, Any]]:
        out = self.cli("health", "--json", check=False)
        return out.returncode, json.loads(out.stdout or b"{}")

    def status(self, run_id: str) -> str:
        return str(json.loads(self.cli("status", run_id, "--json").stdout)["status"])

    def effects(self) -> list[tuple[object, ...]]:
        with sqlite3.connect(self.ledger, timeout=30) as conn:
            return list(conn.execute("select step, count(*) from effects group by step"))


@pytest.fixture
def dev(tmp_path: Path) -> Iterator[Dev]:
    d = Dev(tmp_path)
    yield d
    for proc in d.procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("point", "thread"),
    [("engine.after_commit:2:raise", "engine"), ("worker.before_commit:2:raise", "worker-")],
)
def test_a_dead_thread_stops_dev_and_health_names_it(dev: Dev, point: str, thread: str) -> None:
    dev.cli("db", "upgrade")
    run_id = dev.cli("start", "three-steps", "--input", '"order-7"', "--app", "killapp")
    run_id = run_id.stdout.decode().strip()
    doomed, log = dev.start(SAGALOOP_CRASH_AT=point)
    try:
        code = doomed.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dev still runs after its thread died:\n{log.read_text()[-3000:]}")
    stderr = log.read_text()
    assert code == EXIT_THREAD_DIED, stderr[-3000:]
    assert f"thread '{thread}" in stderr and "CrashPointRaised" in stderr, stderr[-3000:]
    assert "Traceback" in stderr, "the death is logged with its traceback"

    name = f"dev@{socket.gethostname()}:{doomed.pid}"
    code, report = dev.health()
    assert code == 1 and report["healthy"] is False, report
    assert name in report["services"] and f"thread '{thread}" in report["services"], report
    [row] = [p for p in report["processes"] if p["name"] == name]
    assert row["role"] == "dev" and row["app"] == "killapp" and "CrashPointRaised" in row["problem"]

    second, _ = dev.start()
    eventually(lambda: dev.status(run_id) == "completed", what="completion after a restart")
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=30) == 0, "a clean SIGTERM still exits 0"
    assert sorted(dev.effects()) == [("one", 1), ("three", 1), ("two", 1)]
