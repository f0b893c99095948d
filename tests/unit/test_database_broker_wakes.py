"""Issue 27: the database broker's consumers on the embedded default (``sagaloop dev``'s
assembly: SQLite, the database broker, one process) claim only when a commit queued a row for
them, one consumer per row, instead of every consumer on every commit of the process.

Idle consumers of the same queues take turns to look for other processes' rows: one look per
poll interval between them, not one each.

Claims and looks are counted where SQLite sees them: a claim's SELECT of whole outbox rows, a
look's (the probe, a read) of the id alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop import App, Client, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.runtime.connect import open_broker, open_store
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

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


class StatementCounter:
    """Counts the statements of the store's engine that start with ``head``."""

    def __init__(self, store: SqlStore, head: str) -> None:
        self.count = 0
        self.head = head
        self._lock = threading.Lock()
        sa.event.listen(store.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if " ".join(statement.split())[:200].lower().startswith(self.head):
            with self._lock:
                self.count += 1

    def wait_for(self, n: int, timeout: float = 60) -> None:
        eventually(lambda: self.count >= n, timeout, f"{n} of {self.head!r} (seen {self.count})")


def claims_of(store: SqlStore) -> StatementCounter:
    """Counts the claims (not the probes) that the store's engine runs."""
    return StatementCounter(store, "select sagaloop_outbox.id, sagaloop_outbox.queue")


def looks_of(store: SqlStore) -> StatementCounter:
    """Counts the looks of idle consumers (the probe: a SELECT of the id alone)."""
    return StatementCounter(store, "select sagaloop_outbox.id from")


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[Client, StatementCounter]]:
    url = f"sqlite:///{tmp_path / 'dev.db'}"
    store = open_store(url, upgrade=True)
    broker = open_broker("database", store)
    counter = claims_of(store)
    tuning = Tuning(concurrency=4, poll=0.1)  # sagaloop dev's
    service = Service(app, store, broker, roles=Roles(), tuning=tuning).start()
    try:
        yield Client(store, app), counter
    finally:
        service.stop()
        store.close()


def test_idle_consumers_look_without_claiming(tmp_path: Path) -> None:
    """Idle, the consumers only read: 30 looks and not one claim (a SQLite write
    transaction) among them. Each consumer's first look of each ``receive`` was a claim."""
    store = open_store(f"sqlite:///{tmp_path / 'idle.db'}", upgrade=True)
    claims, looks = claims_of(store), looks_of(store)
    tuning = Tuning(concurrency=4, poll=0.1)  # sagaloop dev's
    service = Service(app, store, open_broker("database", store), roles=Roles(), tuning=tuning)
    service.start()
    try:
        looks.wait_for(10)  # started: every consumer looked once
        before = claims.count
        looks.wait_for(looks.count + 30)
        assert claims.count == before, f"{claims.count - before} claims while idle"
    finally:
        service.stop()
        store.close()


def test_a_run_claims_a_few_times_per_step(embedded: tuple[Client, StatementCounter]) -> None:
    client, counter = embedded
    client.result(client.start(hops, 1), timeout=60)
    before = counter.count
    assert client.result(client.start(hops, STEPS), timeout=60) == STEPS
    claims = counter.count - before
    assert claims <= CLAIMS_PER_STEP * STEPS, f"{claims / STEPS:.1f} claims per step"


def test_idle_consumers_take_turns_and_find_other_processes_rows(tmp_path: Path) -> None:
    """Four idle consumers of one queue look once per poll interval between them (not four
    times), and still find a row that another process (another store) queued."""
    url = f"sqlite:///{tmp_path / 'turns.db'}"
    store, other = open_store(url, upgrade=True), open_store(url)
    broker = DatabaseBroker(store, poll_interval=0.05)
    looks = looks_of(store)
    got: list[bytes] = []
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            for d in broker.receive(["q"], 1, 0.2):
                got.append(d.body)
                d.settle(None)  # the row is gone: processed

    threads = [threading.Thread(target=consume, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        looks.wait_for(8)  # every thread looked once, then they take turns
        started, first = time.monotonic(), looks.count
        looks.wait_for(first + 10)
        elapsed = time.monotonic() - started
        assert elapsed >= 9 * 0.05 * 0.9, f"10 idle looks in {elapsed * 1000:.0f} ms"
        DatabaseBroker(other).publish([("q", b"from another process")])
        eventually(lambda: got, 60, "the other process's row to be found")
        assert got == [b"from another process"]
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        store.close()
        other.close()


def test_a_commit_wakes_only_the_waiters_of_its_queues(tmp_path: Path) -> None:
    """The in-process lane's threads wait on the same store as the broker's consumers: a row
    of one queue does not wake the waiters of other queues (each would look for its wake and
    wait again, a thread switch per waiter per commit); it wakes one of its own. (The old
    shared condition's spurious wakes coalesce when commits come fast, so this pins the
    behaviour more than it catches its loss.)"""
    store = SqlStore(f"sqlite:///{tmp_path / 'wakes.db'}")
    checks: list[bool] = []  # each time the waiter of "b" looked for a wake
    take_ticket = store._take_ticket

    def counted(queues: Any) -> bool:
        woken = take_ticket(queues)
        if queues == ["b"]:
            checks.append(woken)
        return woken

    store._take_ticket = counted  # type: ignore[method-assign]
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(store.wait_for_writes(60, ["b"])))
    waiter.start()
    eventually(lambda: checks == [False], 10, "the waiter of b to wait")
    for _ in range(200):
        store.nudge(["a"])
        store.nudge(["a", "c"])
    store.nudge(["b"])
    waiter.join(10)
    assert woken == [True]
    assert checks == [False, True], "woken once, by the row of its queue"
    store.close()


def test_each_row_wakes_a_waiter_of_its_queue(tmp_path: Path) -> None:
    """A commit wakes one waiter per row of its queue (not all of them): three rows, three
    waiters woken, in one commit or in several, whatever the waiters' sets of queues."""
    store = SqlStore(f"sqlite:///{tmp_path / 'wakes.db'}")
    woken: list[bool] = []
    sets = [["q"], ["q"], ["p", "q"], ["q"], ["q", "r"], ["q"]]
    waiters = [
        threading.Thread(target=lambda qs=qs: woken.append(store.wait_for_writes(60, qs)))
        for qs in sets
    ]
    for waiter in waiters:
        waiter.start()
    waiting = store._waits.values()  # each condition's waiters (CPython's Condition)
    eventually(lambda: sum(len(w._waiters) for w in waiting) == 6, 10, "the six to wait")  # type: ignore[attr-defined]
    store.nudge(["q", "q", "q"])
    eventually(lambda: len(woken) == 3, 10, "a waiter per row of one commit")
    for _ in range(3):
        store.nudge(["q"])
    eventually(lambda: len(woken) == 6, 10, "a waiter per row of three commits")
    for waiter in waiters:
        waiter.join(10)
    assert woken == [True] * 6
    store.close()
