"""Updates (``Client.update``, ``ctx.on_update``) on real processes: a `sagaloop engine` and a
`sagaloop worker` on RabbitMQ + PostgreSQL. The engine is SIGKILLed between an update's
acceptance and its answer (its handler awaits a step that is held meanwhile): a new engine
answers it once, the sender's ``Client.update`` returns that answer, and a retry with the same
``update_id`` gets the same answer without applying it again. A validator's refusal reaches
the sender and records nothing but the refusal."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from system import System

from sagaloop import UpdateRefusedError
from sagaloop.engine import history as h
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    system = System(tmp_path, rabbitmq_url, app="updates_app")
    try:
        yield system
    finally:
        system.close()


def _kinds(system: System, run_id: str) -> list[str]:
    return [e.kind for e in system.client.history(run_id) if e.kind.startswith("update_")]


def _marks(system: System) -> list[str]:
    return [str(w) for (w,) in system.ledger("select what from marks order by rowid")]


def test_an_update_accepted_before_the_engine_is_killed_is_answered_once(
    system: System, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    engine = system.engine()
    system.worker(queues="work")
    system.wait_ready("engine")
    system.wait_ready("worker")
    client = system.client
    run_id = client.start("account", str(gate))
    with pytest.raises(UpdateRefusedError, match="a deposit is positive, not -5") as refused:
        client.update(run_id, "deposit", {"id": "d0", "amount": -5}, timeout=60)
    assert refused.value.error.type == "ValueError"
    assert _kinds(system, run_id) == [h.UPDATE_REFUSED]

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            client.update, run_id, "deposit", {"id": "d1", "amount": 7}, update_id="u1", timeout=120
        )
        eventually(lambda: "d1 booking" in _marks(system), 60, "the booking to start")
        assert _kinds(system, run_id) == [h.UPDATE_REFUSED, h.UPDATE_ACCEPTED]
        System.kill(engine)  # accepted, not answered
        gate.touch()  # the step ends; its result waits for an engine
        assert not sent.done()
        system.engine()
        assert sent.result(timeout=120) == 7, system.logs()

    assert client.update(run_id, "deposit", {"id": "d1", "amount": 7}, update_id="u1") == 7
    assert _kinds(system, run_id) == [h.UPDATE_REFUSED, h.UPDATE_ACCEPTED, h.UPDATE_COMPLETED]
    assert system.ledger("select count(*) from effects where step = 'd1'") == [(1,)]
    assert client.update(run_id, "close", timeout=60) == 7
    assert system.wait_final([run_id]) == {run_id: "completed"}
    assert client.get(run_id).output == 7
    system.assert_histories_sound([run_id])
