"""A step's live items on RabbitMQ: the channel sends them from a thread of its own, so an
attempt that streamed waits for them at its end. Its reply is returned (to be stored, which
may finish the run) only once every item it streamed has gone: a reader that stops at the
run's end (``Client.stream``) still gets them all."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from sagaloop import App, StepContext
from sagaloop.brokers.streams import RabbitStreams
from sagaloop.engine.messages import Envelope
from sagaloop.runtime.steps import StepRunner

pytestmark = pytest.mark.integration

app = App("step-streams")
ITEMS = 200


@app.step()
def chatty(ctx: StepContext, n: int) -> int:
    for i in range(n):
        ctx.stream({"i": i})
    return n


def _task(step: str) -> Envelope:
    payload = {"step": step, "args": {"n": ITEMS}}
    return Envelope(type="step", run_id="r-1", position=1, attempt=1, payload=payload)


def test_an_attempt_returns_once_its_streamed_items_have_gone(rabbitmq_url: str) -> None:
    streams = RabbitStreams(rabbitmq_url, namespace=f"t{uuid.uuid4().hex[:8]}")
    reader = streams.subscribe("r-1")
    runner = StepRunner(app, threads=1, streams=streams)
    try:
        reply = runner.run(_task("chatty"), inline=True)
        assert streams.flush(0), "the reply came back before its items had gone"
        assert reply.result == ITEMS
        got: list[Any] = []
        deadline = time.monotonic() + 30
        while len(got) < ITEMS and time.monotonic() < deadline:
            got += reader.get(0.5)
        assert [item["data"]["i"] for item in got] == list(range(ITEMS))
    finally:
        runner.close()
        reader.close()
        streams.close()
