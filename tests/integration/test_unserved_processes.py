"""Issue 23, item 2: nothing waits invisibly. Against real ``engine`` and ``worker`` processes
on RabbitMQ and PostgreSQL: a step on a queue that no live process consumes (a forgotten
``--queue``, a dead worker) is named in ``status``, ``status --json``, the console and
``health``; ``health`` fails while an app has runs in flight and no live engine."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from system import System, eventually

from sagaloop.ui.views import run_view

pytestmark = pytest.mark.integration


def health(system: System) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", "health", "--json"],
        env=system.env,
        capture_output=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout or b"{}")


def status(system: System, run_id: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(system.sagaloop("status", run_id, "--json"))
    return data


def test_a_step_on_a_queue_nobody_consumes_is_named_everywhere(system: System) -> None:
    system.engine()
    worker = system.worker(queues="other")  # `work` forgotten
    system.wait_ready()
    system.wait_ready("worker")
    run_id = system.client.start("sequence", ["a"])

    found = eventually(
        lambda: (s := status(system, run_id))["unserved"] and s, what="status to name the queue"
    )
    assert found["unserved"] == ["work"]
    line = next(w for w in found["waiting_for"] if "step 'effect'" in w)
    assert "queued on work" in line and "no live process consumes queue 'work'" in line, line
    assert "queued or running" not in line
    assert "no live process consumes queue 'work'" in system.sagaloop("status", run_id)
    console = run_view(system.client, run_id).why
    assert any("no live process consumes queue 'work'" in w for w in console), console

    code, report = health(system)
    assert code == 1 and report["healthy"] is False, report
    assert report["unserved_queues"] == {"itapp": "itapp.steps.work"}, report
    assert "no live process consumes queue(s) itapp.steps.work" in report["services"], report

    # A worker of `work` that dies leaves it unserved again: seen once its row goes stale.
    system.kill(worker)
    late = system.worker(queues="work,other")
    system.wait_final([run_id])
    assert status(system, run_id)["status"] == "completed"
    eventually(lambda: health(system)[0] == 0, timeout=60, what="health once all is served")
    second = system.client.start("sequence", ["b"])
    system.wait_final([second])
    system.kill(late)
    third = system.client.start("sequence", ["c"])
    eventually(
        lambda: status(system, third)["unserved"] == ["work"],
        timeout=60,
        what="the dead worker's queue to be named",
    )


def test_health_fails_while_runs_are_in_flight_and_no_engine_lives(system: System) -> None:
    engine = system.engine()
    system.worker()
    system.wait_ready()
    run_id = system.client.start("waiter", "w")
    eventually(lambda: status(system, run_id)["waits"], what="the run to wait for its event")
    code, report = health(system)
    assert code == 0, report

    system.kill(engine)
    code, report = eventually(
        lambda: (r := health(system))[0] == 1 and r, timeout=60, what="health to fail"
    )
    assert "has 1 run(s) in flight and no live engine" in report["services"], report
    found = status(system, run_id)
    assert found["no_live_engine"] is True
    assert found["waiting_for"][0].startswith("no live engine of app 'itapp'"), found
