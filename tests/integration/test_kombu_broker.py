"""The kombu broker on a real Redis: the broker contract, consumers that die holding messages,
messages from plain kombu and Redis clients, and engine and worker processes on Redis and
PostgreSQL with the worker SIGKILLed mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import kombu
import pytest
import redis
from kombu_redis import Namespace, held_messages, make_system, redis_url
from system import HERE, ROOT

from sagaloop.brokers.kombu import KombuBroker
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Broker, Delivery
from sagaloop.errors import BrokerError
from sagaloop.runtime.consumers import decode
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, eventually
from sagaloop.testing.contracts import BrokerContract, BrokerUnderTest, receive_exactly

pytestmark = pytest.mark.integration

LEASE = timedelta(seconds=30)
KEY = b"k" * 32


@pytest.fixture(scope="module")
def url() -> str:
    found = redis_url()
    if found is None:
        pytest.fail(
            "Redis does not answer on 127.0.0.1:6379: start it (`redis-server --daemonize yes`, "
            "or `bash .ci/run`) or set SAGALOOP_TEST_REDIS_URL"
        )
    return found


@pytest.fixture
def namespace(url: str) -> Iterator[Namespace]:
    ns = Namespace(url)
    try:
        yield ns
    finally:
        ns.cleanup()


def receive(broker: Broker, queue: str, n: int, timeout: float = 5.0) -> list[Delivery]:
    return receive_exactly(broker, [queue], n, timeout)


# --- the contract ----------------------------------------------------------------------------


class TestKombuBroker(BrokerContract):
    quiet_timeout = 0.1

    @pytest.fixture
    def harness(self, namespace: Namespace, tmp_path: Path) -> Iterator[BrokerUnderTest]:
        clock = VirtualClock()
        store = SqlStore("sqlite:///" + str(tmp_path / "settle.sqlite"))
        store.upgrade()

        def reopen() -> Broker:
            return namespace.broker(clock=clock, lease=LEASE, signing_key=KEY)

        broker = namespace.broker(clock=clock, lease=LEASE, signing_key=KEY)
        yield BrokerUnderTest(
            broker=broker,
            clock=clock,
            lease=LEASE,
            store=store,
            dead_letters=lambda: [(d.queue, d.body, d.reason) for d in broker.list_dead_letters()],
            reopen=reopen,
        )
        store.close()


# --- consumers that die ----------------------------------------------------------------------


def holder(url: str, namespace: str, queue: str, n: int, lease: float, then: str) -> Any:
    """A process that claims ``n`` messages (see ``kombu_redis.hold``), once it holds them."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "kombu_redis.py"),
            url,
            namespace,
            queue,
            f"{n}",
            f"{lease}",
            then,
        ],
        stdout=subprocess.PIPE,
        env={"PYTHONPATH": f"{HERE}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_messages_of_a_sigkilled_consumer_come_back_after_its_lease(namespace: Namespace) -> None:
    broker = namespace.broker(lease=timedelta(seconds=5))
    queue = "app.steps.work"
    bodies = [b'{"n": %d}' % i for i in range(4)]
    broker.publish([(queue, b) for b in bodies])
    proc = holder(namespace.url, namespace.name, queue, 3, 1.5, "wait")
    killed_at = time.monotonic()
    proc.kill()
    proc.wait()
    assert held_messages(namespace.url, namespace.name, queue) == 3, "the dead process holds 3"
    (free,) = receive(broker, queue, 1)
    assert (free.body, free.deliveries) == (bodies[3], 1), "the one it did not claim, at once"
    free.ack()
    if time.monotonic() - killed_at < 1.0:  # its 1.5 s lease began before the kill
        assert broker.receive([queue], 10, 0.2) == [], "back before the lease ran out"
    back = receive(broker, queue, 3, timeout=10)
    assert sorted(d.body for d in back) == bodies[:3], "every message it held, once"
    assert {d.deliveries for d in back} == {2}, "counted as redeliveries"
    for d in back:
        d.ack()
    assert held_messages(namespace.url, namespace.name, queue) == 0
    assert broker.receive([queue], 10, 0.2) == []


def test_a_consumer_that_closes_gives_back_what_it_holds_at_once(namespace: Namespace) -> None:
    broker = namespace.broker()
    queue = "app.engine"
    broker.publish([(queue, b"a"), (queue, b"b")])
    proc = holder(namespace.url, namespace.name, queue, 2, 60, "close")
    assert proc.wait(timeout=10) == 0
    back = receive(broker, queue, 2, timeout=2)  # long before the 60 s lease
    assert sorted((d.body, d.deliveries) for d in back) == [(b"a", 2), (b"b", 2)]
    for d in back:
        d.ack()


# --- what other clients put on the queues ----------------------------------------------------


def test_plain_kombu_and_redis_clients(namespace: Namespace) -> None:
    broker = namespace.broker(signing_key=KEY)
    queue = "shop.engine"
    start = Envelope(type="start", run_id="r-1", saga="refund", payload={"input": 1})
    step = Envelope(type="step", run_id="r-1", saga="refund", payload={})
    with kombu.Connection(namespace.url) as conn:
        producer = conn.Producer()
        key = broker.queue_key(queue)
        producer.publish(start.to_bytes(), routing_key=key, content_type="application/json")
        producer.publish({"rm -rf": "/"}, routing_key=key, serializer="pickle", priority=5)
        producer.publish(step.to_bytes(), routing_key=key, content_type="application/json")
    client = redis.Redis.from_url(namespace.url)
    client.lpush(broker.queue_key(queue), b"\xffnot kombu's")
    client.close()

    got = receive(broker, queue, 4)
    by_body = {d.body: d for d in got}
    assert not any(d.trusted for d in got), "nothing sagaloop signed"
    envelope = decode(by_body[start.to_bytes()])
    assert envelope is not None and envelope.run_id == "r-1", "a plain kombu client starts runs"
    assert decode(by_body[step.to_bytes()]) is None, "an unsigned step is refused"
    pickled = next(d for d in got if d.content_type == "application/x-python-serialize")
    assert decode(pickled) is None, "dead-lettered on its content type, never unpickled"
    bare = by_body[b"\xffnot kombu's"]
    assert bare.content_type is None and decode(bare) is None
    by_body[start.to_bytes()].ack()

    reasons = {d.body: d.reason for d in broker.list_dead_letters()}
    assert "not signed by sagaloop" in reasons[step.to_bytes()]
    assert "content type" in reasons[pickled.body]
    assert "JSON" in reasons[b"\xffnot kombu's"]
    assert broker.receive([queue], 10, 0.2) == [], "every message was settled"


def test_signatures_verify_only_with_the_key_and_the_queue(namespace: Namespace) -> None:
    signer = namespace.broker(signing_key=KEY)
    signer.publish([("a.engine", b"{}")])
    signer.publish_raw("a.engine", b"[]")  # as any client: unsigned
    (signed, unsigned) = receive(signer, "a.engine", 2)
    assert (signed.trusted, unsigned.trusted) == (True, False)
    signed.retry_later(timedelta(0))
    unsigned.ack()
    (again,) = receive(namespace.broker(signing_key=b"other" * 8), "a.engine", 1)
    assert not again.trusted, "another key verifies nothing"
    again.ack()


def test_the_trace_headers_are_the_publishing_span_of_the_messages_trace(
    namespace: Namespace,
) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from sagaloop import tracing

    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    body = json.dumps(
        {"type": "start", "run_id": "r", "payload": {}, "trace": {"traceparent": parent}},
        separators=(",", ":"),
    ).encode()
    broker = namespace.broker()
    broker.publish([("a.engine", body)])  # no span: the message's own context
    broker.publish_raw("a.engine", body)  # as any kombu client: no header
    provider = TracerProvider()
    before = tracing.use_tracer_provider(provider)
    try:
        with tracing.publish([body]):  # the relay's span, a child of the message's context
            here = tracing.current()
            broker.publish([("a.engine", body)])
    finally:
        tracing.use_tracer_provider(before)
        provider.shutdown()
    assert (
        here is not None
        and here["traceparent"][3:35] == parent[3:35]
        and here != {"traceparent": parent}
    )
    own, raw, relayed = receive(broker, "a.engine", 3)
    assert (own.trace, raw.trace, relayed.trace) == ({"traceparent": parent}, None, here)
    for delivery in (own, raw, relayed):
        delivery.ack()


def test_errors_say_what_failed(url: str) -> None:
    with pytest.raises(BrokerError, match="connecting: Redis at"):
        KombuBroker("redis://127.0.0.1:1/0", connect_timeout=timedelta(seconds=1))
    with pytest.raises(BrokerError, match="database number does not exist"):
        KombuBroker(url.rsplit("/", 1)[0] + "/999")
    with pytest.raises(BrokerError, match="Redis transport only"):
        KombuBroker("memory://")


# --- engine and worker processes on Redis and PostgreSQL -------------------------------------


def test_engine_and_worker_on_redis_with_the_worker_sigkilled_mid_run(
    url: str, tmp_path: Path
) -> None:
    system = make_system(tmp_path, url)
    try:
        system.engine()
        worker = system.worker(STEP_DELAY="0.3")
        names = [[f"r{i}-{s}" for s in "abc"] for i in range(6)]
        runs = [system.client.start("sequence", n) for n in names]
        queue = "itapp.steps.work"
        eventually(
            lambda: held_messages(url, system.namespace, queue) >= 2,
            what="the worker holding step messages",
            interval=0.01,
        )
        system.kill(worker)
        in_hand = held_messages(url, system.namespace, queue)
        assert in_hand >= 1, "the worker died holding step messages"
        system.worker()
        assert set(system.wait_final(runs, timeout=60).values()) == {"completed"}

        effects = dict(system.ledger("select key, count(*) from effects group by key"))
        assert len(effects) == 18 and set(effects.values()) == {1}, "every effect once"
        (bodies,) = system.ledger("select count(*) from bodies")[0]
        assert 18 <= bodies <= 18 + in_hand, "only the steps in hand at the kill ran again"
        system.assert_histories_sound(runs)
        assert held_messages(url, system.namespace, queue) == 0, "what it held came back"
        assert system.dead_letter_count() == 0

        health = subprocess.run(
            [sys.executable, "-m", "sagaloop", "health", "--json"],
            env=system.env,
            capture_output=True,
            timeout=60,
        )
        checks = json.loads(health.stdout)
        assert (checks["broker"], checks["dead_letters"]) == ("ok", 0), health.stderr.decode()
    finally:
        system.close()
