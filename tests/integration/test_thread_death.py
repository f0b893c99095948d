"""A consumer thread of a real `sagaloop engine` or `sagaloop worker` (PostgreSQL + RabbitMQ) dies
of a BaseException no handler absorbs. It used to die silently while its process went on holding
deliveries nobody processed (with a second, healthy engine running, 7 of 10 runs stayed
`running`) and `health` said healthy. Now the process stops consuming, closes its connection (the
deliveries go back to the queue) and exits non-zero, and `health` fails naming it.

The death is injected with a crash point armed with ``:raise`` (a BaseException raised in the
thread), so these tests hold whatever user code's BaseExceptions become."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import pytest
from system import System

from sagaloop.testing import eventually

pytestmark = pytest.mark.integration
EXIT_THREAD_DIED = 70  # documented in docs/operations.md (EX_SOFTWARE)


def health(system: System) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", "health", "--json"],
        env=system.env,
        capture_output=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout or b"{}")


def wait_died(
    system: System, proc: subprocess.Popen[bytes], role: str, thread: str, *others: str
) -> None:
    """``proc`` exits with EXIT_THREAD_DIED saying which thread died (``thread``, or one of
    ``others``: names start so); health then fails."""
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {role} still runs after its thread died\n{system.logs()}")
    assert code == EXIT_THREAD_DIED, system.logs()
    logs = system.logs()
    [died] = [t for t in (thread, *others) if f"thread '{t}" in logs] or [thread]
    assert f"thread '{died}" in logs and "CrashPointRaised" in logs, logs
    name = f"{role}@{socket.gethostname()}:{proc.pid}"
    code, report = health(system)
    assert code == 1 and report["healthy"] is False, report
    assert name in report["services"] and f"thread '{died}" in report["services"], report


def effects(system: System) -> dict[str, int]:
    return dict(system.ledger("select step, count(*) from effects group by step"))


def test_a_dead_engine_thread_leaves_its_runs_to_the_healthy_engine(system: System) -> None:
    doomed = system.engine(SAGALOOP_CRASH_AT="engine.after_commit:3:raise")
    system.engine()
    system.worker()
    system.wait_ready(count=2)  # the doomed one too: else the other may finish every run first
    runs = [system.client.start("sequence", [f"r{i}a", f"r{i}b"]) for i in range(10)]
    wait_died(system, doomed, "engine", "engine", "starts")  # either commits activations
    assert system.wait_final(runs, timeout=60) == dict.fromkeys(runs, "completed")
    assert effects(system) == {f"r{i}{s}": 1 for i in range(10) for s in "ab"}
    system.assert_histories_sound(runs)
    assert system.dead_letter_count() == 0


def test_a_dead_worker_thread_exits_and_a_restart_completes(system: System) -> None:
    system.engine()
    doomed = system.worker(SAGALOOP_CRASH_AT="worker.before_commit:2:raise")
    run = system.client.start("sequence", ["a", "b", "c"])
    wait_died(system, doomed, "worker", "worker-")
    system.worker()
    assert system.wait_final([run]) == {run: "completed"}
    assert effects(system) == {"a": 1, "b": 1, "c": 1}
    states = [s["state"] for s in json.loads(system.sagaloop("status", run, "--json"))["steps"]]
    assert states == ["completed", "reconciled", "completed"], "b's effect happened once"


def test_health_lists_the_running_processes(system: System) -> None:
    engine = system.engine()
    worker = system.worker()
    system.wait_ready()
    host = socket.gethostname()
    names = {f"engine@{host}:{engine.pid}", f"worker@{host}:{worker.pid}"}

    def listed() -> dict[str, dict[str, Any]]:
        code, report = health(system)
        assert code == 0, report
        rows = {str(p["name"]): p for p in report["processes"]}
        return rows if names <= set(rows) else {}

    rows = eventually(listed, what="both processes in the registry")
    assert {rows[n]["state"] for n in names} == {"running"}
    assert {rows[n]["role"] for n in names} == {"engine", "worker"}
    worker.terminate()
    assert worker.wait(timeout=30) == 0
    code, report = health(system)
    assert code == 0, "a clean stop is not a problem"
    [row] = [p for p in report["processes"] if p["name"] == f"worker@{host}:{worker.pid}"]
    assert row["state"].startswith("stopped")
