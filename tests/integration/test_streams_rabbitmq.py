"""The per-run live channel on RabbitMQ: a reader gets its run's items, in order, and only
its run's; an item for a run nobody follows is dropped (nothing is kept)."""

from __future__ import annotations

import uuid

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
