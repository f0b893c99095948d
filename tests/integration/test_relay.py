"""The relay on a real RabbitMQ: a row that can never be delivered does not block the others."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest
from system import System

from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Outgoing
from sagaloop.runtime.relay import Relay
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration


def test_an_unroutable_row_is_dead_lettered_and_the_rest_published(system: System) -> None:
    broker = RabbitBroker(system.broker_url, namespace=system.namespace)
    try:
        broker.declare(["itapp.engine"])
        now = datetime.now(UTC)
        messages = [
            Outgoing(q, Envelope(type="event", run_id=f"r-{uuid.uuid4().hex[:6]}"))
            for q in ["itapp.engine", "nobody.listens", "itapp.engine"]
        ]
        with system.store.transaction() as tx:
            system.store.enqueue(tx, messages, now)
        relay = Relay(system.store, broker)
        assert relay.relay_once() == 3
        assert relay.relay_once() == 0, "nothing is left to retry"
        dead = system.store.dead_letters()
        assert [q for q, _, _ in dead] == ["nobody.listens"]
        assert "unroutable" in dead[0][2]
        received = broker.receive(["itapp.engine"], 10, 5.0)
        # The good rows of the failed batch went out with it and again on their own: a
        # duplicate publish, which consumers deduplicate by message_id; none was lost.
        ids = {Envelope.from_bytes(d.body).message_id for d in received}
        assert ids == {messages[0].envelope.message_id, messages[2].envelope.message_id}
        for d in received:
            d.ack()
    finally:
        broker.close()


def test_a_start_from_another_process_wakes_the_relay_at_once(system: System) -> None:
    """On PostgreSQL a transaction that writes unclaimed outbox rows (a client's start, written
    by another process) notifies the relays (``NOTIFY sagaloop_outbox``), which sweep at once:
    with sweeps 10 s apart (the most `--poll` allows), the run starts at once."""
    slow = ["--poll", "10"]
    system._spawn("engine", ["engine", *slow], {})
    system._spawn("worker", ["worker", "--queue", "work,other", *slow], {})
    system.wait_ready("engine")
    system.wait_ready("worker")
    # each process swept once when it started: the next sweeps are up to 10 s away
    run_id = system.client.start("sequence", ["a"])

    def first_step_scheduled() -> bool:
        return any(e.kind == "step_scheduled" for e in system.client.history(run_id))

    began = time.monotonic()
    eventually(first_step_scheduled, 30, f"the run to start: {system.logs()}")
    assert time.monotonic() - began < 5, "the start waited for a sweep"
