"""In-process steps (``local=True``) with real ``sagaloop engine`` processes on RabbitMQ +
PostgreSQL: the engine running a step's body is SIGKILLed while the body hangs after its
effect, and *another* engine, which never saw the run, takes the step once its claim ran out
and reconciles it instead of charging again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from system import System, eventually

pytestmark = pytest.mark.integration

LEASE = 2.0


@pytest.fixture
def local_system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, lease=LEASE, app="localapp")
    try:
        yield s
    finally:
        s.close()


def test_another_engine_reconciles_the_step_of_an_engine_killed_mid_body(
    local_system: System,
) -> None:
    s = local_system
    doomed = s.engine(HANG_ON="b")
    run = s.client.start("pay", ["a", "b", "c"])
    eventually(lambda: s.ledger("select 1 from bodies where step = 'b'") != [], what="b's body")
    s.kill(doomed)  # b's effect happened; its result is not committed
    killed_at = time.monotonic()
    s.engine()  # a new engine: nothing of the run in memory, no worker anywhere
    assert s.wait_final([run]) == {run: "completed"}
    took = time.monotonic() - killed_at
    assert s.client.get(run).output == ["a:charged", "b:found", "c:charged"]
    effects = dict(s.ledger("select step, count(*) from effects group by step"))
    bodies = dict(s.ledger("select step, count(*) from bodies group by step"))
    assert effects == {"a": 1, "b": 1, "c": 1} and bodies == {"a": 1, "b": 1, "c": 1}
    status = json.loads(s.sagaloop("status", run, "--json"))
    assert [x["state"] for x in status["steps"]] == ["completed", "reconciled", "completed"]
    assert took < LEASE + 15, f"the step was taken again after {took:.1f} s"
    s.assert_histories_sound([run])
    assert s.dead_letter_count() == 0
