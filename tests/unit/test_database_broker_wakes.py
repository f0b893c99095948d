"""Issue 27: the database broker's consumers on the embedded default (``sagaloop dev``'s
assembly: SQLite, the database broker, one process) claim only when a commit queued a row for
them, one consumer per row, instead of every consumer on every commit of the process.

A claim is counted where SQLite sees it: the claim's SELECT of whole outbox rows (a look that
is only a read, the probe, selects the id alone and is not counted)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop import App, Client, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.runtime.connect import open_broker, open_store
from sagaloop.store.sql import SqlStore

app = App("wakes")
STEPS = 10
CLAIMS_PER_STEP = 3
"""At most (2.1 measured): the worker's claim of the step, the engine's of its result, and a
stale wake now and then. When every commit woke every consumer, 9.1 were measured."""


@app.step(queue="q")
def hop(ctx: StepContext, i: int) -> int:
    return i + 1


@app.saga(name="hops")
async def hops(ctx: SagaContext, n: int) -> int:
    i = 0
    for _ in range(n):
        i = await ctx.call(hop, i)
    return i


class ClaimCounter:
    """Counts the claims (not the probes) that the store's engine runs."""

    def __init__(self, store: SqlStore) -> None:
        self.count = 0
        self._lock = threading.Lock()
        sa.event.listen(store.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        head = " ".join(statement.split())[:200].lower()
        if head.startswith("select sagaloop_outbox.id, sagaloop_outbox.queue"):
            with self._lock:
                self.count += 1


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[Client, ClaimCounter]]:
    url = f"sqlite:///{tmp_path / 'dev.db'}"
    store = open_store(url, upgrade=True)
    broker = open_broker("database", store)
    counter = ClaimCounter(store)
    tuning = Tuning(concurrency=4, poll=0.1)  # sagaloop dev's
    service = Service(app, store, broker, roles=Roles(), tuning=tuning).start()
    try:
        yield Client(store, app), counter
    finally:
        service.stop()
        store.close()


def test_a_run_claims_a_few_times_per_step(embedded: tuple[Client, ClaimCounter]) -> None:
    client, counter = embedded
    client.result(client.start(hops, 1), timeout=60)
    before = counter.count
    assert client.result(client.start(hops, STEPS), timeout=60) == STEPS
    claims = counter.count - before
    assert claims <= CLAIMS_PER_STEP * STEPS, f"{claims / STEPS:.1f} claims per step"
