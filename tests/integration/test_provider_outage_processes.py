"""A model provider's outage and a revoked key (issue 23) against separate `sagaloop engine`
and `sagaloop worker` processes on RabbitMQ and PostgreSQL: what
tests/chaos/test_provider_outage_dev.py checks of `sagaloop dev`, with the same app
(tests/chaos/provider_app.py) and the same OpenAI-compatible server. The outage (503) is ridden
out with the booking kept; the revoked key (401) parks the run with nothing undone, and
`sagaloop retry` asks the request that failed again, not the agent's loop from its start.
Counted outside the engine too: the ledger the tool and its compensation write, and the
requests the server answered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from system import System

from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.testing import eventually
from tests.chaos.provider_checks import APP, Provider

pytestmark = pytest.mark.integration
MODEL = "agent__travel__model_request"
BOOK = "agent__travel__tool__book"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[Provider]:
    p = Provider(tmp_path)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str, provider: Provider) -> Iterator[System]:
    s = System(tmp_path, rabbitmq_url, app=APP)
    try:
        s.env["MODEL_URL"] = provider.url
        yield s
    finally:
        s.close()


def status_of(client: Client, run_id: str) -> str:
    run = client.store.get_run(run_id)
    return run.status if run is not None else "absent"


def steps(client: Client, run_id: str, name: str) -> list[tuple[str, int | None]]:
    """The history's events of the step ``name``: (kind, command position), in order."""
    return [(e.kind, e.pos) for e in client.history(run_id) if e.name == name]


def scheduled(events: list[tuple[str, int | None]]) -> list[int | None]:
    return [pos for kind, pos in events if kind == h.STEP_SCHEDULED]


def compensations(client: Client, run_id: str) -> list[str]:
    return [e.kind for e in client.history(run_id) if "compensat" in e.kind]


def test_an_outage_is_ridden_out_and_a_revoked_key_parks_until_retry(
    system: System, provider: Provider
) -> None:
    system.engine()
    system.worker(queues="model,tools")  # every queue of the agent: its model and its tool
    system.wait_ready()
    system.wait_ready("worker")
    client = Client(system.store, "provider")

    def booked() -> list[str]:
        return [line for (line,) in system.ledger("select line from ledger")]

    # an outage of the second request: 503s, then answers again
    provider.fail(1, 503)
    first = client.start("trip", "lisbon")
    eventually(lambda: provider.failed(1) >= 3, 60, f"three failed requests\n{system.logs()}")
    assert status_of(client, first) == "running"
    # the status says why while the step waits for its next attempt (not while one runs)
    eventually(
        lambda: (
            "failing: ModelProviderUnavailable: provider 503" in system.sagaloop("status", first)
        ),
        90,
        "the status to say why the step fails",
    )
    provider.fail(1, None)
    system.wait_final([first], timeout=60)
    assert status_of(client, first) == "completed", system.logs()
    assert compensations(client, first) == [] and booked() == ["booked lisbon"]
    model = steps(client, first, MODEL)
    assert scheduled(model) == [0, 3], model  # two requests, the second after the tool (2)
    assert model.index((h.STEP_RETRYING, 3)) < model.index((h.STEP_COMPLETED, 3)), model
    assert provider.answered("book lisbon") == [0, 1], "each turn answered once"

    # a revoked key: the run parks, nothing undone; fixed, then retried
    provider.fail(1, 401)
    second = client.start("trip", "porto")
    eventually(
        lambda: status_of(client, second) == "needs_attention",
        60,
        f"the run to park\n{system.logs()}",
    )
    both = ["booked lisbon", "booked lisbon"]  # the script books lisbon on every run
    assert booked() == both and compensations(client, second) == []
    parked = client.store.get_run(second)
    assert parked is not None and parked.reason is not None, parked
    assert "provider 401" in parked.reason and "AuthenticationError" in parked.reason, parked
    shown = system.sagaloop("status", second)
    assert "needs a person" in shown and "provider 401" in shown, shown
    assert provider.answered("book porto") == [0]
    before = steps(client, second, MODEL)
    assert before[-2:] == [(h.STEP_HALTED, 3), (h.RUN_PARKED, 3)], before

    provider.fail(1, None)  # the key is fixed
    system.sagaloop("retry", second)
    system.wait_final([second], timeout=60)
    assert status_of(client, second) == "completed", system.logs()
    assert booked() == both and compensations(client, second) == [], "nothing undone or twice"
    # the request that failed is asked again at its position, nothing before it
    after = steps(client, second, MODEL)
    assert after[: len(before)] == before and scheduled(after) == [0, 3], after
    assert after[len(before) :] == [(h.STEP_DISPATCHED, 3), (h.STEP_COMPLETED, 3)], after
    assert scheduled(steps(client, second, BOOK)) == [2], "the tool not called again"
    assert provider.answered("book porto") == [0, 1], "turn 0 not asked again"
