"""The RabbitMQ broker on a real server: the broker contract, poison input from a plain AMQP
client, the delivery limit, pipelined publisher confirms, and a restart of a private node."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pika
import pytest
from private_rabbit import PrivateRabbit, private_rabbit  # noqa: F401  (a fixture)

from sagaloop.brokers._amqp import (
    Confirms,
    PublishRequest,
    dead_letter_origin,
    delivery_count,
    mask_url,
)
from sagaloop.brokers.rabbitmq import RabbitBroker
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Broker, Delivery
from sagaloop.errors import BrokerError
from sagaloop.runtime.consumers import decode
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, eventually
from sagaloop.testing.contracts import BrokerContract, BrokerUnderTest, receive_exactly

pytestmark = pytest.mark.integration

LEASE = timedelta(seconds=30)
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture(scope="module")
def url() -> str:
    url = os.environ.get("SAGALOOP_TEST_BROKER_URL", DEFAULT_URL)
    parts = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 2).close()
    except OSError:
        pytest.fail(
            f"RabbitMQ does not answer at {parts.hostname}:{parts.port or 5672}: start it "
            "(`rabbitmq-server -detached`, or `bash .ci/run`) or set SAGALOOP_TEST_BROKER_URL"
        )
    return url


def delete_namespace(url: str, namespace: str, queues: set[str]) -> None:
    """Delete what a broker of ``namespace`` declared, with a plain client."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for q in sorted(queues):
            channel.queue_delete(f"{namespace}.{q}")
        channel.queue_delete(f"{namespace}.dead")
        channel.exchange_delete(namespace)
        channel.exchange_delete(f"{namespace}.dlx")
    finally:
        connection.close()


class Namespace:
    """Brokers on one fresh namespace (``test-<uuid>``), all closed and deleted afterwards."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = f"test-{uuid.uuid4().hex[:12]}"
        self.brokers: list[RabbitBroker] = []

    def broker(self, **options: Any) -> RabbitBroker:
        broker = RabbitBroker(self.url, namespace=self.name, **options)
        self.brokers.append(broker)
        return broker

    def cleanup(self) -> None:
        for b in self.brokers:
            b.close()
        declared = {q for b in self.brokers for q in b.declared}
        delete_namespace(self.url, self.name, declared)


@pytest.fixture
def namespace(url: str) -> Iterator[Namespace]:
    ns = Namespace(url)
    try:
        yield ns
    finally:
        ns.cleanup()


def receive(broker: Broker, queue: str, n: int, timeout: float = 10.0) -> list[Delivery]:
    return receive_exactly(broker, [queue], n, timeout)


# --- (a) the contract ------------------------------------------------------------------------


class TestRabbitBroker(BrokerContract):
    quiet_timeout = 0.2

    @pytest.fixture
    def harness(self, namespace: Namespace, tmp_path: Path) -> Iterator[BrokerUnderTest]:
        clock = VirtualClock()
        store = SqlStore("sqlite:///" + str(tmp_path / "settle.sqlite"))
        store.upgrade()

        def reopen() -> Broker:
            return namespace.broker(clock=clock, lease=LEASE)

        broker = namespace.broker(clock=clock, lease=LEASE)
        yield BrokerUnderTest(
            broker=broker,
            clock=clock,
            lease=LEASE,
            store=store,
            dead_letters=broker.peek_dead_letters,
            reopen=reopen,
        )
        store.close()


# --- (b) poison input from a plain client ----------------------------------------------------


def test_poison_from_a_plain_client_is_dead_lettered_and_the_consumer_goes_on(
    namespace: Namespace,
) -> None:
    broker = namespace.broker()
    queue = "refunds.engine"
    broker.declare([queue])
    valid = Envelope(type="start", run_id="r-1", saga="refund", payload={"input": 1}).to_bytes()
    pickled = pickle.dumps({"rm -rf": "/"})
    connection = pika.BlockingConnection(pika.URLParameters(namespace.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, content_type in [
            (b"{not json", "application/json"),
            (pickled, "application/x-python-pickle"),
            (valid, "application/json"),
        ]:
            props = pika.BasicProperties(content_type=content_type, delivery_mode=2)
            channel.basic_publish(namespace.name, queue, body, props, mandatory=True)
    finally:
        connection.close()

    bad_json, pickle_delivery, good = receive(broker, queue, 3)
    assert pickle_delivery.content_type == "application/x-python-pickle"
    assert decode(bad_json) is None
    assert decode(pickle_delivery) is None  # dead-lettered on its content type, never unpickled
    envelope = decode(good)
    assert envelope is not None and envelope.run_id == "r-1"
    good.ack()

    dead = broker.peek_dead_letters()
    assert [(q, body) for q, body, _ in dead] == [(queue, b"{not json"), (queue, pickled)]
    assert "not JSON" in dead[0][2]
    assert "application/x-python-pickle" in dead[1][2]
    assert broker.peek_dead_letters() == dead, "peeking must leave the dead letters in place"

    # The reason is in the headers, for any AMQP client to read.
    connection = pika.BlockingConnection(pika.URLParameters(namespace.url))
    try:
        channel = connection.channel()
        method, props, body = channel.basic_get(f"{namespace.name}.dead", auto_ack=False)
        assert method is not None and body == b"{not json"
        assert props.headers["x-sagaloop-queue"] == queue
        assert "not JSON" in props.headers["x-sagaloop-reason"]
    finally:
        connection.close()  # unacked: back in the dead-letter queue
    assert broker.receive([queue], 10, 0.2) == [], "only the three messages were published"


# --- (c) the delivery limit ------------------------------------------------------------------


def test_a_message_redelivered_past_the_delivery_limit_is_dead_lettered(
    namespace: Namespace,
) -> None:
    clock = VirtualClock()
    broker = namespace.broker(delivery_limit=2, clock=clock, lease=LEASE)
    queue = "refunds.steps.payments"
    broker.declare([queue])
    broker.publish([(queue, b'{"hangs": "the worker"}')])
    counts = []
    for _ in range(3):  # a worker that never acks: each lease expiry nacks with requeue
        (d,) = receive(broker, queue, 1)
        counts.append(d.deliveries)
        clock.advance(LEASE + timedelta(seconds=1))
    assert counts == [1, 2, 3], "each lease expiry is a delivery for RabbitMQ"
    eventually(
        lambda: bool(broker.peek_dead_letters()), what="the message reaches the dead letters"
    )
    ((q, body, reason),) = broker.peek_dead_letters()
    assert (q, body) == (queue, b'{"hangs": "the worker"}')
    assert "delivery limit" in reason
    assert broker.receive([queue], 10, 0.2) == []


# --- (d) pipelined publisher confirms --------------------------------------------------------


def test_publisher_confirms_are_pipelined(namespace: Namespace) -> None:
    broker = namespace.broker()
    queue = "bench.engine"
    broker.declare([queue])
    start = time.monotonic()
    for i in range(20):  # one confirm round trip each
        broker.publish([(queue, b'{"i": %d}' % i)])
    round_trip = (time.monotonic() - start) / 20

    batch = [(queue, b'{"n": %d}' % i) for i in range(2000)]
    start = time.monotonic()
    broker.publish(batch)
    elapsed = time.monotonic() - start
    print(
        f"\npublished 2000 confirmed messages in {elapsed:.3f} s ({2000 / elapsed:,.0f} msg/s); "
        f"one confirmed publish takes {round_trip * 1000:.2f} ms, so 2000 sequential ones "
        f"would take about {2000 * round_trip:.1f} s"
    )
    assert elapsed < 5.0

    connection = pika.BlockingConnection(pika.URLParameters(namespace.url))
    try:
        declared = connection.channel().queue_declare(broker.queue_name(queue), passive=True)
        assert declared.method.message_count == 2020, "a confirmed message is in the queue"
    finally:
        connection.close()


def test_retry_later_does_not_count_towards_the_delivery_limit(namespace: Namespace) -> None:
    clock = VirtualClock()
    broker = namespace.broker(delivery_limit=1, clock=clock, lease=LEASE)
    queue = "refunds.engine"
    broker.declare([queue])
    broker.publish([(queue, b"{}")])
    for attempt in range(1, 5):  # the database is down, say: the consumer retries later
        (d,) = receive(broker, queue, 1)
        assert d.deliveries == attempt
        d.retry_later(timedelta(seconds=1))
        clock.advance(timedelta(seconds=2))
    (d,) = receive(broker, queue, 1)
    d.ack()
    assert broker.peek_dead_letters() == []


def test_a_message_over_the_size_limit_is_refused(namespace: Namespace) -> None:
    broker = namespace.broker(max_message_bytes=1000)
    broker.declare(["app.engine"])
    with pytest.raises(BrokerError, match="exceeds max_message_bytes"):
        broker.publish([("app.engine", b"x" * 1001)])
    with pytest.raises(BrokerError, match="unroutable"):
        broker.publish([("app.not-declared", b"{}")])


def test_publish_later_tells_the_confirm_on_the_io_thread(namespace: Namespace) -> None:
    """What the relay's committing threads use: the publish returns at once; ``then`` is told,
    on the broker's I/O thread, None once confirmed, else the error ``publish`` would raise."""
    import threading

    broker = namespace.broker(max_message_bytes=1000)
    broker.declare(["app.engine"])
    told: list[tuple[str, BaseException | None]] = []
    done = threading.Event()

    def then(error: BaseException | None) -> None:
        told.append((threading.current_thread().name, error))
        if len(told) == 2:
            done.set()

    broker.publish_later([("app.engine", b'{"a": 1}'), ("app.engine", b'{"a": 2}')], then)
    broker.publish_later([("app.not-declared", b"{}")], then)
    assert done.wait(10), told
    assert {name for name, _ in told} == {f"amqp-{namespace.name}"}
    # in either order: RabbitMQ confirms an unroutable message at once, a routed one once its
    # quorum queue has it
    ok, bad = sorted((error for _, error in told), key=lambda e: e is not None)
    assert ok is None
    assert isinstance(bad, BrokerError) and "unroutable" in str(bad)
    assert len(receive(broker, "app.engine", 2)) == 2
    with pytest.raises(BrokerError, match="exceeds max_message_bytes"):
        broker.publish_later([("app.engine", b"x" * 1001)], then)


# --- (e) a restart of a private node ---------------------------------------------------------


@pytest.mark.long  # make chaos: the suite's time budget
def test_a_node_restart_loses_nothing_and_the_broker_reconnects(
    private_rabbit: PrivateRabbit,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="sagaloop.brokers.rabbitmq")
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    broker = RabbitBroker(private_rabbit.url, namespace=namespace)
    try:
        queue = "refunds.engine"
        broker.declare([queue])
        bodies = [b'{"n": %d}' % i for i in range(50)]
        broker.publish([(queue, b) for b in bodies])
        first = []
        for _ in range(10):
            (d,) = receive(broker, queue, 1)
            d.ack()
            first.append(d.body)
        assert first == bodies[:10]

        private_rabbit.stop()
        with pytest.raises(BrokerError):
            broker.publish([(queue, b'{"while": "down"}')])
        assert broker.receive([queue], 10, 0.2) == []
        private_rabbit.start()  # restart() is these two steps

        rest: list[bytes] = []
        deadline = time.monotonic() + 25
        while len(rest) < 40 and time.monotonic() < deadline:
            for d in broker.receive([queue], 10, 0.5):
                d.ack()
                rest.append(d.body)
        assert sorted(rest) == sorted(bodies[10:]), "the durable quorum queue kept the 40"
        broker.publish([(queue, b'{"after": "restart"}')])
        (d,) = receive(broker, queue, 1)
        assert d.body == b'{"after": "restart"}'
        d.ack()
    finally:
        broker.close()

    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost the connection" in m for m in messages) == 1, messages
    assert sum("reconnected" in m for m in messages) == 1, messages
    assert all("guest:guest" not in m for m in messages), "a password was logged"
    # the URL is quoted masked (here the user name too: it is the password's very text)
    assert any(":***@" in m for m in messages)


def test_helpers_need_no_server() -> None:
    assert (
        mask_url("amqp://app:s3cret@mq.internal:5671/prod")
        == "amqp://app:***@mq.internal:5671/prod"
    )
    assert mask_url("amqp://localhost/") == "amqp://localhost/"
    assert delivery_count({"x-delivery-count": 2}, True) == 3
    assert delivery_count(None, True) == 2
    assert delivery_count({}, False) == 1
    death = {"x-first-death-queue": "ns.a.engine", "x-first-death-reason": "delivery_limit"}
    assert dead_letter_origin(death, "ns")[0] == "a.engine"
    confirms, first, second = Confirms(), PublishRequest(2), PublishRequest(1)
    for request, key in [(first, "a"), (first, "b"), (second, "b")]:
        confirms.published(request, key)
    confirms.returned("b")  # charged to the oldest unconfirmed message to "b"
    confirms.confirmed(3, multiple=True, ack=True)
    assert first.done and first.problems and not second.problems
