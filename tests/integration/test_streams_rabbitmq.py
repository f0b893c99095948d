"""The per-run live channel on RabbitMQ: a reader gets its run's items, in order, and only
its run's; an item for a run nobody follows is dropped (nothing is kept)."""

from __future__ import annotations

import queue
import statistics
import threading
import time
import uuid

import pika
import pytest

from sagaloop.brokers.streams import RabbitStreams

pytestmark = pytest.mark.integration


def test_a_reader_gets_its_runs_items_only(rabbitmq_url: str) -> None:
    streams = RabbitStreams(rabbitmq_url, namespace=f"t{uuid.uuid4().hex[:8]}")
    try:
        streams.publish("r-1", {"n": -1})  # nobody listens yet: dropped
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
