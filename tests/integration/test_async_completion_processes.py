"""A step completed from outside, in real processes (PostgreSQL + RabbitMQ): the step's body
hands its attempt off (``ctx.complete_async()``), the engine and the worker are SIGKILLed and
started again, then ``sagaloop complete-step`` completes the attempt by its task token, read
from ``sagaloop status``, and the run finishes once, the body having run once."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from system import System, eventually

from sagaloop.engine import history as h

pytestmark = pytest.mark.integration


@pytest.fixture
def handoff_system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, lease=2.0, app="handoffapp")
    try:
        yield s
    finally:
        s.close()


def test_a_step_handed_off_is_completed_from_outside_after_a_crash(
    handoff_system: System,
) -> None:
    s = handoff_system
    engine, worker = s.engine(), s.worker("work")
    s.wait_ready()
    s.wait_ready("worker")
    run_id = s.client.start("handoff", "refund 7")

    def handed_off() -> str | None:
        events = s.client.history(run_id)
        return next((str(e.data["token"]) for e in events if e.kind == h.STEP_HANDED_OFF), None)

    token = eventually(handed_off, 60, "the step to be handed off")
    shown = s.sagaloop("status", run_id)
    assert f"to be completed from outside (task token {token})" in shown, shown

    s.kill(engine)
    s.kill(worker)
    s.engine(), s.worker("work")
    s.wait_ready()
    assert s.client.get(run_id).status == "running"

    assert "completed" in s.sagaloop("complete-step", token, "--result", '"approved"')
    assert s.wait_final([run_id]) == {run_id: "completed"}
    assert s.client.result(run_id) == "refund 7: approved"
    assert len(s.ledger("select 1 from bodies where step = 'ask_outside'")) == 1
    kinds = [e.kind for e in s.client.history(run_id)]
    assert kinds.count(h.STEP_COMPLETED) == 1 and kinds.count(h.STEP_HANDED_OFF) == 1, kinds

    again = subprocess.run(
        [sys.executable, "-m", "sagaloop", "complete-step", token, "--result", '"twice"'],
        env=s.env,
        capture_output=True,
        timeout=60,
    )
    assert again.returncode != 0
    assert "no longer waits to be completed from outside" in again.stderr.decode()
