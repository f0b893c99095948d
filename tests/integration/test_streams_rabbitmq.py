"""The per-run live channel on RabbitMQ: a reader gets its run's items, in order, and only
its run's; an item for a run nobody follows is dropped (nothing is kept); publishing never
waits for RabbitMQ."""

from __future__ import annotations

import contextlib
import queue
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Iterator

import pika
import pytest

from sagaloop.brokers.streams import RabbitStreams

pytestmark = pytest.mark.integration


def test_a_reader_gets_its_runs_items_only(rabbitmq_url: str) -> None:
    streams = RabbitStreams(rabbitmq_url, namespace=f"t{uuid.uuid4().hex[:8]}")
    try:
        streams.publish("r-1", {"n": -1})  # nobody listens yet: dropped
        assert streams.flush(10.0), "sent before anyone subscribed"
        mine, other = streams.subscribe("r-1"), streams.subscribe("r-2")
        for n in range(3):
            streams.publish("r-1", {"n": n})
        streams.publish("r-2", {"n": 99})
        got: list[dict[str, int]] = []
        for _ in range(20):
            got += mine.get(0.5)
            if len(got) >= 3:
                break
        assert got == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert other.get(2.0) == [{"n": 99}]
        mine.close()
        other.close()
    finally:
        streams.close()


def test_an_item_reaches_a_waiting_reader_at_once(rabbitmq_url: str) -> None:
    """The reader is pushed its items: one published while ``get`` waits comes back within a
    few milliseconds, not at the next poll. The old reader slept 50 ms whenever its queue was
    empty; here the item is published only once the reader is inside ``get`` (its first look
    found nothing), so each latency under polling is most of those 50 ms and the median of 20
    is far above 25 ms. Under push, the median is a socket round trip (about 1 ms); 25 ms
    leaves a busy 2-core box room for a scheduling hiccup on most of the 20 items."""
    streams = RabbitStreams(rabbitmq_url, namespace=f"t{uuid.uuid4().hex[:8]}")
    reader = streams.subscribe("r-1")
    latencies: list[float] = []
    waiting, got, failed = threading.Event(), queue.Queue[float](), []

    def read() -> None:
        try:
            for _ in range(20):
                waiting.set()
                items = reader.get(5.0)
                got.put(time.monotonic() if items == [{"n": 1}] else -1.0)
        except Exception as e:  # surfaced by the assertion below
            failed.append(e)
            got.put(-1.0)

    thread = threading.Thread(target=read, daemon=True)
    try:
        streams.publish("r-0", {"warm": True})  # the publisher's connection is open
        thread.start()
        for _ in range(20):
            assert waiting.wait(10.0)
            waiting.clear()
            sent = time.monotonic()
            streams.publish("r-1", {"n": 1})
            arrived = got.get(timeout=10.0)
            assert arrived > 0, failed
            latencies.append(arrived - sent)
        assert statistics.median(latencies) < 0.025, sorted(latencies)
    finally:
        thread.join(10.0)
        reader.close()
        streams.close()


def test_an_item_that_is_not_json_is_dropped_and_the_next_arrives(
    rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone allowed to publish to the exchange can send bytes that are not JSON: the reader
    drops them with a warning and goes on with the items after them."""
    namespace = f"t{uuid.uuid4().hex[:8]}"
    streams = RabbitStreams(rabbitmq_url, namespace=namespace)
    reader = streams.subscribe("r-1")
    raw = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        raw.channel().basic_publish(f"{namespace}.stream", "r-1", b"not json {")
        streams.publish("r-1", {"n": 1})
        got: list[object] = []
        deadline = time.monotonic() + 10.0
        # two connections: the server may deliver the two in either order
        while (not got or "not JSON" not in caplog.text) and time.monotonic() < deadline:
            got += reader.get(0.5)
        assert got == [{"n": 1}]
        assert "not JSON" in caplog.text
    finally:
        raw.close()
        reader.close()
        streams.close()


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """An AMQP URL whose server accepts connections and never answers (RabbitMQ hung, or a
    network that drops the replies)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"amqp://guest:guest@127.0.0.1:{server.getsockname()[1]}/?socket_timeout=30"
    stop.set()
    thread.join(5.0)
    for conn in held:
        conn.close()
    server.close()


def test_publishing_does_not_wait_for_rabbitmq(
    silent_broker: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A step that streams goes on while RabbitMQ does not answer: the items wait for the
    channel's own thread. (A blocking publish held the step for pika's handshake timeout, 15 s,
    then raised pika's AMQPConnectorStackTimeout, which is no AMQPError, into the step: its
    attempt failed.) Past ``max_pending`` items are dropped, with one warning; ``flush`` and
    ``close`` give up after their timeout, with a warning."""
    streams = RabbitStreams(silent_broker, namespace="silent")
    began = time.monotonic()
    streams.publish("r-1", {"n": 0})
    assert time.monotonic() - began < 5.0, "publish waited for the broker"
    assert not streams.flush(0.2), "nothing could be sent"
    streams.close(timeout=0.2)
    assert "stream items not sent to RabbitMQ" in caplog.text
    full = RabbitStreams(silent_broker, namespace="silent", max_pending=3)
    for n in range(6):
        full.publish("r-1", {"n": n})
    # three wait (the thread may hold one more, connecting): the others found no room
    assert caplog.text.count("stream items dropped: 3 wait for RabbitMQ") == 1, caplog.text
    full.close(timeout=0.2)
