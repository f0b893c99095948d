"""A timeout stops the work, in real processes (PostgreSQL + RabbitMQ; issue 22, section 3).

- With ``--concurrency 1``, two in-process attempts that hang past their timeout of 1 s used to
  hold both of the engine's step threads for ever: a canary step's body never ran, its queued
  attempts were failed as timed out (in doubt) though they never started, and ``health`` said
  healthy. Now the hung threads are abandoned, replaced and reported; health fails only once
  every thread the process may have is held by one, and an attempt queued then is never
  counted as timed out: it runs after a restart.
- SIGTERM did not stop a process with a hung step (still running 40 s later). Now ``engine``,
  ``worker`` and ``dev`` exit within their grace (``SAGALOOP_GRACE``, ``--grace``), and the
  attempt that was running is in doubt exactly as after a crash: reconciled on redelivery."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from system import System, eventually

from sagaloop.engine import history as h

pytestmark = pytest.mark.integration

LEASE = 2.0
GRACE = 3.0
EXIT_MARGIN = 10.0
"""Seconds past the grace a stopping process may take (start-up of the interpreter aside, it
needs none: the margin is for a machine three times as busy)."""


@contextlib.contextmanager
def make_system(tmp_path: Path, rabbitmq_url: str, app: str) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, lease=LEASE, app=app)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def hang_system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    with make_system(tmp_path, rabbitmq_url, "hangapp") as s:
        yield s


def health(s: System) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "sagaloop", "health", "--json"],
        env=s.env,
        capture_output=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout or b"{}")


def bodies(s: System, step: str) -> int:
    return len(s.ledger("select 1 from bodies where step = ?", step))


def sigterm(s: System, proc: subprocess.Popen[bytes], role: str) -> float:
    """SIGTERM ``proc``; it must exit (status 0) within the grace; returns how long it took."""
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        code = proc.wait(timeout=GRACE + EXIT_MARGIN)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {role} still runs {GRACE + EXIT_MARGIN} s after SIGTERM\n{s.logs()}")
    took = time.monotonic() - sent
    assert code == 0, s.logs()
    return took


def test_hung_in_process_steps_do_not_starve_the_others_and_health_tells(
    hang_system: System,
) -> None:
    s = hang_system
    engine = s._spawn(
        "engine",
        ["engine", "--concurrency", "1", "--poll", "0.05"],
        {"SAGALOOP_GRACE": str(GRACE)},
    )
    s.wait_ready()
    # two attempts hang past their timeout: both threads of --concurrency 1 abandoned
    hung = [s.client.start("hang", f"h{i}") for i in range(2)]
    assert s.wait_final(hung) == dict.fromkeys(hung, "failed")
    canary = s.client.start("canary", "c1")
    assert s.wait_final([canary]) == {canary: "completed"}, "starved by the hung attempts"
    assert bodies(s, "canary-c1") == 1

    def noted() -> dict[str, Any] | None:
        code, report = health(s)
        notes = [p.get("notes") or "" for p in report.get("processes", [])]
        return report if code == 0 and any("2 abandoned threads" in n for n in notes) else None

    report = eventually(noted, 30, "health to note the abandoned threads")
    [row] = report["processes"]
    assert "step 'hang', run " in row["notes"] and report["healthy"] is True, report
    table = subprocess.run(
        [sys.executable, "-m", "sagaloop", "health"], env=s.env, capture_output=True, timeout=60
    )
    assert "2 abandoned threads (step 'hang', run " in table.stdout.decode(), table.stdout
    # status shows each run's own, with the process that still runs it
    [attempt] = s.client.status(hung[0]).abandoned
    assert attempt["step"] == "hang" and attempt["process"].startswith("engine@"), attempt
    shown = subprocess.run(
        [sys.executable, "-m", "sagaloop", "status", hung[0]],
        env=s.env,
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    assert "still running past its timeout" in shown and "step 'hang'" in shown, shown

    # two more: every thread the process may have (2 + 2 spare) is held past its timeout
    hung += [s.client.start("hang", f"h{i}") for i in range(2, 4)]
    assert s.wait_final(hung) == dict.fromkeys(hung, "failed")

    def unhealthy() -> dict[str, Any] | None:
        code, report = health(s)
        return report if code == 1 else None

    report = eventually(unhealthy, 30, "health to fail")
    assert "all 4 step threads are held by attempts past their timeouts" in report["services"]
    waiting = s.client.start("canary", "c2")
    since = time.monotonic()
    # its timeout is 2 s: wait past it, and see it was not counted as timed out
    eventually(lambda: time.monotonic() - since > 5, 10, "5 s")
    run = s.client.get(waiting)
    assert run is not None and run.status == "running" and bodies(s, "canary-c2") == 0
    kinds = [e.kind for e in s.client.history(waiting)]
    assert h.STEP_RETRYING not in kinds and h.STEP_FAILED not in kinds, kinds

    # SIGTERM: the queued attempt is given back; the engine exits although 4 threads hang
    took = sigterm(s, engine, "engine")
    assert took < GRACE + EXIT_MARGIN
    s.engine()
    assert s.wait_final([waiting]) == {waiting: "completed"}
    kinds = [e.kind for e in s.client.history(waiting)]
    assert h.STEP_RETRYING not in kinds and h.STEP_FAILED not in kinds, kinds
    assert bodies(s, "canary-c2") == 1
    s.assert_histories_sound([*hung, canary, waiting])


@pytest.mark.parametrize("role", ["engine", "dev"])
def test_sigterm_stops_a_process_whose_in_process_step_hangs(
    tmp_path: Path, rabbitmq_url: str, role: str
) -> None:
    with make_system(tmp_path, rabbitmq_url, "localapp") as s:
        env = {"HANG_ON": "b", "SAGALOOP_GRACE": str(GRACE)}
        doomed = s._spawn(role, [role, "--poll", "0.05"], env)
        s.wait_ready(role)
        run = s.client.start("pay", ["a", "b", "c"])
        eventually(lambda: bodies(s, "b") == 1, 60, "b's body to hang")
        sigterm(s, doomed, role)
        assert f"{role}: still running after the grace of 3 s: thread(s) local-" in s.logs()
        s.engine()  # b was running: in doubt, as after a crash, so it is reconciled
        assert s.wait_final([run]) == {run: "completed"}
        assert s.client.get(run).output == ["a:charged", "b:found", "c:charged"]
        effects = dict(s.ledger("select step, count(*) from effects group by step"))
        assert effects == {"a": 1, "b": 1, "c": 1}


def test_sigterm_stops_a_worker_whose_step_hangs(tmp_path: Path, rabbitmq_url: str) -> None:
    with make_system(tmp_path, rabbitmq_url, "itapp") as s:
        s.engine()
        doomed = s.worker(STEP_DELAY="600", SAGALOOP_GRACE=str(GRACE))
        s.wait_ready("worker")
        run = s.client.start("sequence", ["a", "b"])
        eventually(lambda: bodies(s, "a") == 1, 60, "a's body to hang")
        sigterm(s, doomed, "worker")
        assert "worker: still running after the grace of 3 s: thread(s) worker-" in s.logs()
        s.worker()
        assert s.wait_final([run]) == {run: "completed"}
        steps = json.loads(s.sagaloop("status", run, "--json"))["steps"]
        assert [x["state"] for x in steps] == ["reconciled", "completed"]
        assert dict(s.ledger("select step, count(*) from effects group by step")) == {
            "a": 1,
            "b": 1,
        }
