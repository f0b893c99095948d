"""What the parts of the store contract share: the virtual "now" ``T0`` of the tests, the
helpers that make runs and messages, and ``in_threads``, which starts racing threads together
on a barrier."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Outgoing, RunRecord, Store, Timer

T = TypeVar("T")

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
"""The virtual "now" of the tests (claims and timers take the time as an argument)."""
LEASE = timedelta(seconds=30)
FAR = T0 + timedelta(days=3650)


class Rollback(Exception):
    """Raised inside a store transaction to roll it back."""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def in_threads(fns: Sequence[Callable[[], T]], timeout: float) -> list[T]:
    """Run each function in its own thread, started together; their results in order. The
    first exception of any thread is raised here."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Callable[[], T]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), f"threads still running after {timeout} s"
    if errors:
        raise errors[0]
    return results


class ContractBase:
    """What every part of the contract shares: its settings and helpers."""

    hold: float = 0.3
    """Real seconds a transaction holds a lock while a concurrent one must wait."""
    thread_timeout: float = 30.0
    """Real seconds a concurrent test may take before it fails."""

    @staticmethod
    def new_run(
        store: Store,
        *,
        saga: str = "contract",
        status: str = "running",
        at: datetime = T0,
        run_id: str | None = None,
        app: str = "app",
    ) -> RunRecord:
        run = RunRecord(run_id or new_id("run"), app, saga, status, {"n": 1}, at, at)
        with store.transaction() as tx:
            assert store.create_run(tx, run), "create_run of a new id must return True"
        return run

    @staticmethod
    def message(queue: str, n: int = 0, available_at: datetime | None = None) -> Outgoing:
        env = Envelope(type="step", run_id=f"run-{n}", payload={"n": n, "text": "é✓"})
        return Outgoing(queue, env, available_at)

    def enqueue(self, store: Store, queue: str, n: int, at: datetime = T0) -> list[bytes]:
        """Put ``n`` messages on ``queue``; their bodies, in order."""
        messages = [self.message(queue, i) for i in range(n)]
        with store.transaction() as tx:
            store.enqueue(tx, messages, at)
        return [m.envelope.to_bytes() for m in messages]

    @staticmethod
    def drain_timers(store: Store, now: datetime = FAR) -> list[Timer]:
        with store.transaction() as tx:
            return store.take_due_timers(tx, now, 1000)
