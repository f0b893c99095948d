"""Issue 23, item 3 on PostgreSQL: a ``worker`` on the database broker SIGKILLed mid-step is
taken over by the worker started after it at once (same host, pid gone), not after the 60 s
lease; the log says what it took over. A worker stopped (not killed) past its lease commits
nothing of its step when it wakes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from system import System, eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def pg_system(tmp_path):  # type: ignore[no-untyped-def]
    s = System(tmp_path, "database", lease=60.0)
    try:
        yield s
    finally:
        s.close()


def test_a_restarted_worker_takes_over_the_killed_ones_step(pg_system: System) -> None:
    system = pg_system
    system.engine()
    first = system.worker(STEP_DELAY="3600")  # the test kills it while the step sleeps
    system.wait_ready()
    run_id = system.client.start("sequence", ["a"])
    eventually(lambda: system.ledger("select 1 from bodies"), what="the step to run")
    system.kill(first)

    restarted = time.monotonic()
    system.worker()
    # Its effect was recorded before the kill: the redelivered attempt is in doubt and
    # reconciled, and the run completes.
    assert system.wait_final([run_id])[run_id] == "completed"
    resumed = time.monotonic() - restarted
    print(f"run completed {resumed:.2f} s after the worker's restart")
    assert resumed < 15, f"the killed worker's step waited {resumed:.1f} s: its lease"
    assert "took over the work of process worker@" in system.logs()
    assert f":{first.pid} (worker of app 'itapp'), dead: its pid {first.pid} is gone" in (
        system.logs()
    )


def test_a_worker_stopped_past_its_lease_commits_nothing_when_it_wakes(tmp_path: Path) -> None:
    """A worker SIGSTOPped inside a step past its lease: another worker takes the step (its
    reconcile finds the effect) and the run completes. Woken, the first one stores its reply
    with the one statement that settles its message and is its own commit (a lone
    transaction); the message was claimed again, so the statement aborts itself, writes
    nothing, and its usual transaction finds the lease lost: the effect is applied once and
    the step's completion recorded once."""
    system = System(tmp_path, "database", lease=2.0)
    try:
        system.engine()
        first = system.worker(STEP_DELAY="1")
        system.wait_ready("worker")
        run_id = system.client.start("sequence", ["a"])
        eventually(lambda: system.ledger("select 1 from bodies"), what="the step to run")
        first.send_signal(signal.SIGSTOP)  # inside the step's 1 s sleep, its reply not stored
        try:
            system.worker()
            assert system.wait_final([run_id])[run_id] == "completed"
        finally:
            first.send_signal(signal.SIGCONT)
        eventually(
            lambda: "was claimed again, so this attempt's result is discarded" in system.logs(),
            what="the woken worker to find its lease lost",
        )
        assert first.poll() is None, "it goes on"
        assert system.ledger("select step from effects") == [("a",)]
        assert system.ledger("select count(*) from bodies") == [(1,)], "the other reconciled it"
        history = system.store.load_history(None, run_id)
        assert len([e for e in history if e.kind == "step_completed"]) == 1, history
    finally:
        system.close()
