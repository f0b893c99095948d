"""Forged messages, published with plain pika by someone allowed to start runs, against real
engine and worker processes on RabbitMQ + PostgreSQL (issue 10, defect 4).

A publisher may start runs, send events and cancel; nothing else. Internal messages (step, step
result, timer, and a step with direction undo) are accepted only when sagaloop signed them, and
inbox ids are scoped by app, message type and run, so no id a publisher chooses can occupy a
real message's."""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import pytest
from system import System, eventually

from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.brokers.signing import SIGNATURE_HEADER, sign
from sagaloop.engine.contract import task_message_id
from sagaloop.engine.messages import derived_id

pytestmark = pytest.mark.integration

FORGED = "not signed by sagaloop"
"""Words of the reason of a forged internal message's dead letter."""


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory, rabbitmq_url: str) -> Iterator[System]:
    """One system for the module: an engine, and a worker of queue ``work`` only, so that a
    step of queue ``other`` stays in flight as long as a test needs."""
    s = System(tmp_path_factory.mktemp("forgery"), rabbitmq_url)
    try:
        s.engine()
        s.worker("work")
        s.wait_ready("engine")
        s.wait_ready("worker")
        yield s
    finally:
        s.close()


def publish(system: System, exchange: str, key: str, message: dict[str, Any]) -> None:
    """Publish as any AMQP client would: plain pika, publisher confirms, no signature."""
    conn = pika.BlockingConnection(pika.URLParameters(system.broker_url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
        ch.basic_publish(exchange, key, json.dumps(message).encode(), props, mandatory=True)
    finally:
        conn.close()


def publish_anywhere(system: System, key: str, message: dict[str, Any]) -> None:
    """Publish to the public and to the internal exchange, whichever routes to ``key``
    (before the fix, step queues were bound to the public one)."""
    refusals = (pika.exceptions.UnroutableError, pika.exceptions.ChannelClosedByBroker)
    for exchange in (system.namespace, f"{system.namespace}.internal"):
        with contextlib.suppress(*refusals):
            publish(system, exchange, key, message)


def dead_letters(system: System) -> list[tuple[dict[str, Any], str]]:
    """The dead letters (left in place) as (message, reason)."""
    conn = pika.BlockingConnection(pika.URLParameters(system.broker_url))
    out = []
    try:
        ch = conn.channel()
        while True:
            method, props, body = ch.basic_get(f"{system.namespace}.dead")
            if method is None:
                break
            out.append((json.loads(body), str((props.headers or {}).get("x-sagaloop-reason"))))
        ch.close()  # unacked: back to the queue
    finally:
        conn.close()
    return out


def refused(system: System, message_id: str) -> str:
    """Wait until the message with this id is dead-lettered; its reason."""

    def find() -> str | None:
        for message, reason in dead_letters(system):
            if message.get("message_id") == message_id:
                return reason
        return None

    reason: str = eventually(find, 60, f"message {message_id} to be dead-lettered")
    return reason


def kinds(system: System, run_id: str) -> list[tuple[str, int | None]]:
    return [(e.kind, e.pos) for e in system.client.history(run_id)]


def ledger_steps(system: System) -> set[str]:
    rows = system.ledger("select step from bodies")
    return {str(step) for (step,) in rows}


def forge(
    type: str, run_id: str, *, message_id: str | None = None, **fields: Any
) -> dict[str, Any]:
    return {
        "v": 1,
        "type": type,
        "run_id": run_id,
        "message_id": message_id or uuid.uuid4().hex,
        **fields,
    }


def test_a_forged_step_result_does_not_complete_a_running_step(system: System) -> None:
    run = system.client.start("then-fail", ["r1"])  # `refuse` (queue other) stays in flight
    eventually(
        lambda: [p for k, p in kinds(system, run) if k == "step_scheduled"][1:],
        60,
        "the second step to be scheduled",
    )
    pos = [p for k, p in kinds(system, run) if k == "step_scheduled"][1]
    forged = forge(
        "step_result",
        run,
        saga="then-fail",
        position=pos,
        attempt=1,
        payload={"direction": "do", "outcome": "completed", "result": "forged", "worker": "x"},
    )
    publish(system, system.namespace, "itapp.engine", forged)
    assert FORGED in refused(system, forged["message_id"])
    assert ("step_completed", pos) not in kinds(system, run)
    assert system.client.get(run).status == "running"


def test_a_forged_timer_does_not_fire_a_long_wait(system: System) -> None:
    run = system.client.start("waiter", "w1")  # waits two days for "go"
    eventually(lambda: [p for k, p in kinds(system, run) if k == "event_waiting"], 60, "the wait")
    [pos] = [p for k, p in kinds(system, run) if k == "event_waiting"]
    forged = forge("timer", run, position=pos, payload={"kind": "wait"})
    publish(system, system.namespace, "itapp.engine", forged)
    assert FORGED in refused(system, forged["message_id"])
    assert not [k for k, _ in kinds(system, run) if k == "timer_fired"]
    system.client.send_event(run, "go", "ok")
    assert system.wait_final([run]) == {run: "completed"}
    assert system.client.get(run).output == "w1:done|ok|w1-after:done"


def test_a_forged_step_or_undo_runs_nothing(system: System) -> None:
    step = forge(
        "step",
        "nobody",
        saga="sequence",
        position=1,
        attempt=1,
        idempotency_key="nobody/1/do",
        payload={"step": "effect", "direction": "do", "args": {"name": "forged-do"}},
    )
    undo = forge(
        "step",
        "nobody",
        saga="sequence",
        position=1,
        attempt=1,
        idempotency_key="nobody/1/undo",
        payload={
            "step": "effect",
            "direction": "undo",
            "args": {"name": "forged-undo"},
            "result": "x",
        },
    )
    # The public exchange no longer routes to step queues at all...
    with pytest.raises(pika.exceptions.UnroutableError):
        publish(system, system.namespace, "itapp.steps.work", step)
    # ... and where the permissions do let a message in, the worker refuses it unsigned.
    for message in (step, undo):
        publish(system, f"{system.namespace}.internal", "itapp.steps.work", message)
        assert FORGED in refused(system, message["message_id"])
    assert not {"forged-do", "forged-undo"} & ledger_steps(system)
    assert not system.ledger("select * from undos where step like 'forged%'")


def test_a_prepublished_step_with_the_victims_id_does_not_replace_its_step(
    system: System,
) -> None:
    victim = f"victim-{uuid.uuid4().hex[:8]}"
    ids = []
    for pos in range(4):  # whatever position the victim's first step gets
        message_id = task_message_id(victim, pos, "do", 1)
        ids.append(message_id)
        step = forge(
            "step",
            victim,
            message_id=message_id,
            saga="sequence",
            position=pos,
            attempt=1,
            idempotency_key=f"{victim}/{pos}/do",
            payload={"step": "effect", "direction": "do", "args": {"name": "evil"}},
        )
        publish_anywhere(system, "itapp.steps.work", step)
    for message_id in ids:
        assert FORGED in refused(system, message_id)
    system.client.start("sequence", ["good"], run_id=victim)
    assert system.wait_final([victim]) == {victim: "completed"}
    assert system.client.get(victim).output == ["good:done"]
    assert "evil" not in ledger_steps(system)


def test_squatted_start_and_result_ids_do_not_stall_a_victim(system: System) -> None:
    own = f"squatter-{uuid.uuid4().hex[:8]}"
    victim = f"victim-{uuid.uuid4().hex[:8]}"
    start = forge("start", own, saga="waiter", payload={"input": "sq"})
    publish(system, system.namespace, "itapp.engine", start)
    eventually(lambda: system.client.store.get_run(own), 60, "the squatter's run")
    squats = [derived_id("start", victim)] + [
        derived_id("result", task_message_id(victim, pos, "do", 1)) for pos in range(4)
    ]
    for message_id in squats:  # events to the squatter's own run, accepted and recorded
        event = forge("event", own, message_id=message_id, payload={"name": "noise"})
        publish(system, system.namespace, "itapp.engine", event)
    eventually(
        lambda: len([k for k, _ in kinds(system, own) if k == "event_arrived"]) == len(squats),
        60,
        "the squatter's events to be recorded",
    )
    system.client.start("sequence", ["v1", "v2"], run_id=victim)
    assert system.wait_final([victim]) == {victim: "completed"}
    assert system.client.get(victim).output == ["v1:done", "v2:done"]


# --- the documented RabbitMQ permissions ------------------------------------------------------


def rabbitmqctl(*args: str) -> str:
    out = subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=60, text=True)
    assert out.returncode == 0, f"rabbitmqctl {' '.join(args)}: {out.stderr}"
    return out.stdout


def test_a_publisher_only_user_can_start_runs_and_nothing_else(system: System) -> None:
    """The lines of docs/operations.md, with this test's namespace: the user may write to the
    public exchange only, and read and configure nothing."""
    user, password = f"pub-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    ns = system.namespace.replace(".", r"\.")
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_permissions", "-p", "/", user, "^$", f"^{ns}$", "^$")
        url = system.broker_url.replace("guest:guest@", f"{user}:{password}@")
        assert url != system.broker_url, "expected a broker URL with guest:guest"
        run = f"pub-{uuid.uuid4().hex[:8]}"
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:
            ch = conn.channel()
            ch.confirm_delivery()
            props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
            start = forge("start", run, saga="sequence", payload={"input": ["p"]})
            ch.basic_publish(
                system.namespace, "itapp.engine", json.dumps(start).encode(), props, True
            )
            step = forge("step", run, payload={"step": "effect", "args": {"name": "x"}})
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
                ch.basic_publish(
                    f"{system.namespace}.internal", "itapp.steps.work", json.dumps(step).encode()
                )
                ch.basic_publish(system.namespace, "x", b"{}", props, True)  # see the close
        finally:
            if conn.is_open:
                conn.close()
        assert system.wait_final([run]) == {run: "completed"}
    finally:
        rabbitmqctl("delete_user", user)


def test_no_forgery_left_a_run_stuck_or_ran_a_forged_step(system: System) -> None:
    """Last: what every forgery above left behind, seen from outside."""
    assert not {"forged-do", "forged-undo", "evil"} & ledger_steps(system)
    for message, reason in dead_letters(system):
        assert message["type"] in ("step", "step_result", "timer"), (message, reason)
        assert FORGED in reason, reason


def test_the_queues_have_their_bindings(system: System) -> None:
    """Step queues are bound to the internal exchange only; the engine queue to both."""
    out = rabbitmqctl("list_bindings", "source_name", "destination_name", "routing_key")
    ns = system.namespace
    rows = {tuple(line.split("\t")) for line in out.splitlines() if line.startswith(ns)}
    assert (ns, f"{ns}.itapp.engine", "itapp.engine") in rows
    assert (f"{ns}.internal", f"{ns}.itapp.engine", "itapp.engine") in rows
    assert (f"{ns}.internal", f"{ns}.itapp.steps.work", "itapp.steps.work") in rows
    assert (ns, f"{ns}.itapp.steps.work", "itapp.steps.work") not in rows


# --- the signature, on the broker itself -------------------------------------------------------


def test_only_a_signature_by_the_same_key_for_the_same_queue_is_trusted(rabbitmq_url: str) -> None:
    ns = f"sig-{uuid.uuid4().hex[:8]}"
    key = b"k" * 32
    signer = RabbitBroker(rabbitmq_url, namespace=ns, signing_key=key)
    stranger = RabbitBroker(rabbitmq_url, namespace=ns, signing_key=b"x" * 32)
    try:
        signer.declare(["a.engine", "b.engine"])
        signer.publish([("a.engine", b"{}")])
        stranger.publish([("b.engine", b"{}")])
        [mine] = signer.receive(["a.engine"], 1, 10)
        [theirs] = signer.receive(["b.engine"], 1, 10)
        assert mine.trusted and not theirs.trusted
        for d in (mine, theirs):
            d.ack()
        # A signed body moved to another queue (here: published again by a stranger with the
        # header copied) is not trusted there; unsigned is never trusted.
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        ch = conn.channel()
        moved = pika.BasicProperties(headers={SIGNATURE_HEADER: sign(key, "a.engine", b"{}")})
        ch.basic_publish(ns, "b.engine", b"{}", moved)
        ch.basic_publish(ns, "a.engine", b"{}")
        conn.close()
        got = signer.receive(["b.engine"], 1, 10) + signer.receive(["a.engine"], 1, 10)
        assert [d.trusted for d in got] == [False, False]
        for d in got:
            d.ack()
    finally:
        signer.close()
        stranger.close()
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        ch = conn.channel()
        for q in ("a.engine", "b.engine", "dead"):
            ch.queue_delete(f"{ns}.{q}")
        for x in ("", ".internal", ".dlx"):
            ch.exchange_delete(f"{ns}{x}")
        conn.close()


def test_the_documented_services_user_runs_sagaloop(rabbitmq_url: str) -> None:
    """The services' line of docs/operations.md: declare, publish, consume, dead-letter."""
    ns = f"svc{uuid.uuid4().hex[:8]}"
    user, password = f"svc-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rabbitmqctl("add_user", user, password)
    pattern = f"^{ns}(\\..*)?$"
    rabbitmqctl("set_permissions", "-p", "/", user, pattern, pattern, pattern)
    url = rabbitmq_url.replace("guest:guest@", f"{user}:{password}@")
    broker = RabbitBroker(url, namespace=ns, signing_key=b"k" * 32)
    try:
        broker.declare(["app.engine", "app.steps.q"])
        broker.publish([("app.steps.q", b"{}"), ("app.engine", b"{}")])
        got = broker.receive(["app.steps.q"], 1, 10) + broker.receive(["app.engine"], 1, 10)
        assert [d.trusted for d in got] == [True, True]
        got[0].ack()
        got[1].dead_letter("checked")
        assert [r for _, _, r in broker.peek_dead_letters()] == ["checked"]
    finally:
        broker.close()
        rabbitmqctl("delete_user", user)
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        ch = conn.channel()
        for q in ("app.engine", "app.steps.q", "dead"):
            ch.queue_delete(f"{ns}.{q}")
        for x in ("", ".internal", ".dlx"):
            ch.exchange_delete(f"{ns}{x}")
        conn.close()
