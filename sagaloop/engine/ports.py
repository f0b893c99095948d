"""What the engine needs from storage, brokers and time. Adapters implement these protocols;
the engine imports no driver or SQL dialect."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol, runtime_checkable

from sagaloop.engine.feature_stores import (  # the roles of saga features: re-exported
    ApprovalStore,
    ConcurrencySlots,
    DebounceStore,
    RateLimits,
    ScheduleStore,
    SubscriptionStore,
)
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.listing import RunOrder, RunWaits
from sagaloop.engine.messages import Envelope
from sagaloop.engine.records import (  # the records the ports take and return: re-exported
    ApprovalRow,
    Checkpoint,
    Debounced,
    HeldSlot,
    KeySlots,
    Outgoing,
    QueuedMessage,
    RunRecord,
    Schedule,
    Timer,
    Written,
)
from sagaloop.engine.transport import Broker, Delivery, Streams, Subscription  # re-exported

__all__ = [
    "ApprovalRow",
    "ApprovalStore",
    "Broker",
    "Checkpoint",
    "Clock",
    "ConcurrencySlots",
    "DebounceStore",
    "Debounced",
    "Delivery",
    "Handoff",
    "HeldSlot",
    "InboxStore",
    "KeySlots",
    "Maintenance",
    "OutboxQueue",
    "Outgoing",
    "ProcessRegistry",
    "QueuedMessage",
    "RateLimits",
    "RunQueries",
    "RunRecord",
    "RunStore",
    "Schedule",
    "ScheduleStore",
    "Store",
    "Streams",
    "Subscription",
    "SubscriptionStore",
    "SystemClock",
    "Timer",
    "TimerStore",
    "Transactions",
    "Tx",
    "Written",
]


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Tx(Protocol):
    """An open transaction of a store (opaque to the engine)."""


class Handoff(Protocol):
    """Takes the outbox rows a transaction wrote, in memory, right after it committed (the
    relay: it publishes them at once instead of finding them with a claim).

    The store writes such rows already claimed with ``token`` until ``now + lease_for(queue)``
    (rows whose ``lease_for`` is None are written unclaimed and not handed over): nobody else
    claims them while they are held in memory, and if the process dies before they were
    deleted, the lease runs out and any relay's sweep (or, for an in-process lane, any engine
    of the app) takes them."""

    token: str

    def lease_for(self, queue: str) -> timedelta | None: ...
    def take(self, rows: Sequence[QueuedMessage]) -> None: ...


# --- the store port, by role ----------------------------------------------------------------
# Each caller needs one or a few of these roles; ``Store`` is their union, implemented by
# ``sagaloop.store.sql.SqlStore`` (one mixin per role under ``sagaloop/store/``, each a subclass
# of the roles it plays, so that mypy checks it against them where it is written). What a method
# promises is said here (or in ``feature_stores.py``, for the roles of one saga feature each),
# once; an implementation's docstring says only how it keeps the promise.


@runtime_checkable
class Transactions(Protocol):
    """Opening a transaction of the store, or adopting the caller's."""

    def transaction(self, *, lone: bool = False) -> AbstractContextManager[Tx]:
        """A write transaction, committed when the block ends without an exception. Driver
        errors (raised by the store's methods inside the block, or by the commit) come out as
        StoreError, or TransientStoreError when running the block again may succeed.

        ``lone``: the block's last write is a ``write_checkpoint``. A store may then commit
        with that write (PostgreSQL: its one statement is the transaction, with no ``BEGIN``
        or ``COMMIT``, when it is also the first); a write after it raises RuntimeError."""
        ...

    def attach(self, conn: Any) -> Tx:
        """Use the caller's open transaction (``conn``, a connection of the store's driver) as
        one of the store's: the store's rows commit or roll back with the caller's writes."""
        ...


@runtime_checkable
class Maintenance(Protocol):
    """The schema check, retention and shutting down."""

    def check_schema(self) -> None: ...
    def prune(self, *, before: datetime, batch: int = 1000) -> int:
        """Delete up to ``batch`` inbox rows older than ``before`` and up to ``batch`` finished
        runs last updated before it (with all that is kept for them); return how many."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RunStore(Protocol):
    """Runs and their histories, written and read by the engine."""

    def create_run(self, tx: Tx, run: RunRecord) -> bool:
        """Insert the run; False when a run with that id exists (even one that a concurrent
        transaction has not committed yet)."""
        ...

    def lock_run(self, tx: Tx, run_id: str) -> RunRecord | None:
        """The run, locked until ``tx`` ends (None: no such run)."""
        ...

    def get_run(self, run_id: str) -> RunRecord | None: ...
    def save_run(self, tx: Tx, run: RunRecord, *, if_last_seq: int | None = None) -> bool:
        """Update the run; with ``if_last_seq``, only if its ``last_seq`` is still that (two
        engines activating the run are serialized). False: not updated."""
        ...

    def load_history(self, tx: Tx | None, run_id: str, after_seq: int = 0) -> list[Event]: ...
    def delete_history(self, tx: Tx, run_id: str) -> None:
        """Delete the run's history (it continued as new: a fresh one starts at seq 1)."""
        ...

    def append_events(
        self, tx: Tx, run_id: str, after_seq: int, events: Sequence[NewEvent], at: datetime
    ) -> list[Event]:
        """Record the events as ``after_seq + 1, ...``; a seq already used fails the whole
        transaction (two activations raced)."""
        ...

    def write_checkpoint(self, tx: Tx, checkpoint: Checkpoint) -> Written:
        """In ``tx``: ``inbox_put``, ``save_run`` (``if_last_seq=base_seq``), ``append_events``
        and ``enqueue``, each only if the one before wrote (a store may fuse them)."""
        ...


@runtime_checkable
class RunQueries(Protocol):
    """The read models over runs: listings and counts (the client, admission, the CLI)."""

    def list_runs(
        self,
        *,
        status: str | None = None,
        saga: str | None = None,
        app: str | None = None,
        limit: int = 100,
        id_prefix: str | None = None,
        input_text: str | None = None,
        updated_since: datetime | None = None,
        order: RunOrder = RunOrder.UPDATED_DESC,
        after: str | None = None,
    ) -> list[RunRecord]:
        """Up to ``limit`` runs that match every filter given, in ``order``: of ``app``, of
        ``saga``, in ``status``, whose id starts with ``id_prefix``, whose stored input's JSON
        text contains ``input_text`` (case-insensitive; an input kept in the payload table, over
        the inline size, is not searched), updated at or after ``updated_since``; after the
        cursor ``after`` (:func:`~sagaloop.engine.listing.run_cursor` of the last run of the
        previous page, made for the same ``order``).

        Keyset paging: a page holds the runs strictly after the cursor's (time, run id) in the
        order, read when the page is asked, never skipping by an offset. Walking the pages of a
        ``created`` order, every run that exists throughout comes exactly once, whatever
        updates meanwhile. Walking most-recently-updated first (the default), every run that
        is not updated during the walk comes exactly once and no run comes twice: a run
        updated meanwhile moves ahead of the cursor, onto a fresh first page. Walking least
        recently updated first, a run updated meanwhile moves to the end and may come again
        there."""
        ...

    def last_run_update(self, *, app: str | None = None) -> datetime | None:
        """The newest ``updated_at`` of the runs of ``app`` (None: of every app); None when
        there is no run. One read of an index's end: what a live listing polls."""
        ...

    def run_waits(self, runs: Sequence[RunRecord]) -> dict[str, RunWaits]:
        """For each of ``runs`` (a page of them): its open approvals, its timers and the waits
        among its newest history events, read in a few indexed queries, with no history
        replayed."""
        ...

    def count_runs(self, *, saga: str | None = None, app: str | None = None) -> dict[str, int]: ...
    def count_running(self, app: str, *, started: bool, at_most: int) -> int:
        """Runs of ``app`` that are ``running``, counted up to ``at_most``: those an engine
        took up (``started``), or those whose start no engine took up yet."""
        ...


@runtime_checkable
class TimerStore(Protocol):
    def add_timer(self, tx: Tx, timer: Timer) -> None:
        """Set the timer, for the app of its run, replacing one with the same (run, pos,
        kind)."""
        ...

    def delete_timers(self, tx: Tx, run_id: str, *, pos: int | None = None) -> None:
        """Delete the run's timers (``pos``: only those of the command at that position)."""
        ...

    def take_due_timers(
        self, tx: Tx, now: datetime, limit: int, *, app: str | None = None
    ) -> list[Timer]:
        """Remove and return up to ``limit`` timers of ``app``'s runs (None: of every app) due
        at ``now``, earliest first; timers that a concurrent transaction is taking are not
        returned twice."""
        ...

    def next_timer_at(self, *, app: str | None = None) -> datetime | None: ...


@runtime_checkable
class InboxStore(Protocol):
    def inbox_get(self, tx: Tx | None, consumer: str, message_id: str) -> tuple[bool, Any]:
        """Whether the message was processed, and the result stored with it (``tx`` None:
        a read of committed state, outside any transaction)."""
        ...

    def inbox_put(self, tx: Tx, consumer: str, message_id: str, result: Any, at: datetime) -> bool:
        """Insert the row; False when it already existed (the message was processed)."""
        ...


@runtime_checkable
class OutboxQueue(Protocol):
    """The outbox (and, for the database broker, the queue itself)."""

    def enqueue(self, tx: Tx, messages: Sequence[Outgoing], now: datetime) -> None:
        """Queue the messages; their large payload values go by reference (see resolve)."""
        ...

    def resolve(self, tx: Tx | None, env: Envelope) -> Envelope:
        """``env`` as it was enqueued: the large values that :meth:`enqueue` replaced by
        references loaded back (``env`` itself when it holds none). MessageError when a
        reference does not resolve."""
        ...

    def hand_over_to(self, handoff: Handoff | None) -> None:
        """From now on, give the rows that this process's transactions enqueue to ``handoff``
        after each commit (None: stop). Rows written in an attached transaction are not
        handed over: their commit is the caller's."""
        ...

    def claim(
        self,
        queues: Sequence[str] | None,
        limit: int,
        now: datetime,
        lease: timedelta,
        *,
        probe: bool = False,
    ) -> list[QueuedMessage]:
        """Claim up to ``limit`` available rows (oldest first) until ``now + lease``, with a
        fresh claim token. ``probe``: a poll that likely finds nothing: look first, without a
        transaction."""
        ...

    def delete_claimed(self, tx: Tx | None, ids: Sequence[int], claim_token: str) -> int:
        """Delete the rows still claimed with ``claim_token`` (without ``tx``: in a transaction
        of its own); return how many."""
        ...

    def settle_claimed(self, tx: Tx, ids: Sequence[int], claim_token: str, lost: Exception) -> None:
        """Delete these rows, still claimed with ``claim_token``, in ``tx`` (at the latest
        before its commit: with its next ``write_checkpoint``, say), else raise ``lost``."""
        ...

    def delete_later(self, ids: Sequence[int], claim_token: str) -> None:
        """Delete these rows, if still claimed with ``claim_token``, with the next
        :meth:`claim` (the relay's sweep) or :meth:`delete_published`: published rows need no
        transaction of their own, on anyone's critical path. Until then a crash leaves them to
        be published again, which consumers deduplicate."""
        ...

    def delete_published(self) -> None:
        """Commit the deletions :meth:`delete_later` left pending, now."""
        ...

    def release(self, ids: Sequence[int], claim_token: str, available_at: datetime) -> None: ...
    def extend_claim(self, id: int, claim_token: str, until: datetime) -> bool: ...
    def dead_letter(self, id: int, claim_token: str, reason: str, now: datetime) -> None:
        """Move the row to the dead letters, unless its lease was lost (whoever holds it now
        decides)."""
        ...

    def dead_letters(self) -> list[tuple[str, bytes, str]]: ...
    def oldest_outbox_message(self) -> datetime | None:
        """Since when the longest-waiting row to publish has been available (None when empty),
        but for the in-process lanes' rows, never published (one stays while its step runs)."""
        ...


@runtime_checkable
class ProcessRegistry(Protocol):
    """What the process registry tells about live processes (see ``store/processes.py``)."""

    def abandoned_attempts(self, run_id: str, *, seen_after: datetime) -> list[dict[str, Any]]:
        """The attempts of ``run_id`` that live processes (seen after ``seen_after``) abandoned
        past their timeouts and whose threads still run: ``step``, ``position``,
        ``attempt``, ``since`` and the ``process``."""
        ...

    def live_queues(self, *, seen_after: datetime) -> list[tuple[str, list[str], list[str]]]:
        """Of each process seen after ``seen_after`` and not stopped: its app, the queues it
        consumes and the step queues its app declares (empty without a registry)."""
        ...


class Store(
    Transactions,
    Maintenance,
    RunStore,
    RunQueries,
    TimerStore,
    InboxStore,
    OutboxQueue,
    RateLimits,
    ApprovalStore,
    ProcessRegistry,
    ConcurrencySlots,
    Protocol,
):
    """Every role of the store: what the engine's composition root passes around. A caller
    that needs less takes the role it uses (``RunStore``, ``OutboxQueue``...)."""


STORE_ROLES: tuple[type, ...] = tuple(b for b in Store.__bases__ if b is not Protocol)
"""The roles of the store port, in the order ``Store`` unites them."""
