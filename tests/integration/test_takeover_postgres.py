"""Issue 23, item 3 on PostgreSQL: a ``worker`` on the database broker SIGKILLed mid-step is
taken over by the worker started after it at once (same host, pid gone), not after the 60 s
lease; the log says what it took over."""

from __future__ import annotations

import time

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
