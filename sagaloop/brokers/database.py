"""The database broker: the outbox table is the queue. No server needed.

A consumer claims rows with a lease and a claim token; it deletes the row in the same
transaction that records the processing, so a message is gone exactly when its effects are
committed. A consumer killed mid-message leaves its lease to expire, and the row becomes
visible again with a higher delivery count. Durable across SIGKILL.

The hand-over: while a consumer of a queue waits in :meth:`DatabaseBroker.receive`, a row that
a transaction of this process writes there is written already claimed by this process (see
``Handoff``, ``sagaloop.runtime.lane.Handoffs``) and given to that consumer in memory after the
commit, without the claim transaction. The row is still deleted by the transaction that records
its processing (``settle``, by its claim token). A row held in memory is the process's: at a
clean stop it is given back (:meth:`DatabaseBroker.release_handed`); after a crash, the claim of
a process proven dead is released by the takeover (``sagaloop.runtime.takeover``) of the next
process that starts or beats, else it runs out with the lease.

The queues of ``hold`` have their rows held whether or not a consumer waits: the in-process
lane (``sagaloop.runtime.lane.LocalLane``), which no broker serves, is this hand-over applied to
its one queue; there is no second mechanism.

Only rows that sagaloop's store wrote (``Store.enqueue``) are trusted deliveries; bodies put
with :meth:`DatabaseBroker.publish` are not.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from sagaloop.brokers.dead_letters import DeadLetter, resend_trusted
from sagaloop.engine.messages import CONTENT_TYPE
from sagaloop.engine.ports import Clock, Delivery, QueuedMessage, SystemClock, Tx
from sagaloop.errors import BrokerError
from sagaloop.store.queue import DeadLetterRow
from sagaloop.store.sql import SqlStore

logger = logging.getLogger(__name__)


class LeaseLostError(BrokerError):
    """The message's lease expired and another consumer claimed it: this work is discarded."""


class DatabaseDelivery:
    content_type: str | None = CONTENT_TYPE

    def __init__(self, broker: DatabaseBroker, row: QueuedMessage) -> None:
        self._broker = broker
        self._row = row
        self.body = row.body
        self.deliveries = row.deliveries
        self.queue = row.queue
        self.trusted = row.trusted

    def settle(self, tx: Tx) -> None:
        """The row's delete, by its claim token, in ``tx``; LeaseLostError if the lease was
        lost (``tx`` must not commit). The store may make it later in ``tx``, with its next
        checkpoint, and raise there: settle before writing the checkpoint saves a statement."""
        row = self._row
        lost = LeaseLostError(
            f"lease of message {row.id} on {row.queue!r} expired: the message "
            "was claimed again, so this attempt's result is discarded"
        )
        self._broker.store.settle_claimed(tx, [row.id], row.claim_token, lost)

    def ack(self) -> None:
        pass  # settled in the processing transaction

    def extend(self) -> bool:
        until = self._broker.clock.now() + self._broker.lease
        return self._broker.store.extend_claim(self._row.id, self._row.claim_token, until)

    def retry_later(self, delay: timedelta) -> None:
        now = self._broker.clock.now()
        self._broker.store.release([self._row.id], self._row.claim_token, now + delay)

    def dead_letter(self, reason: str) -> None:
        logger.warning("dead-lettering message %s from %s: %s", self._row.id, self.queue, reason)
        self._broker.store.dead_letter(
            self._row.id, self._row.claim_token, reason, self._broker.clock.now()
        )


class DatabaseBroker:
    uses_outbox = True

    def __init__(
        self,
        store: SqlStore,
        *,
        lease: timedelta = timedelta(seconds=60),
        clock: Clock | None = None,
        poll_interval: float = 0.05,
        hold: Collection[str] = (),
    ) -> None:
        self.store = store
        self.lease = lease
        self.clock = clock or SystemClock()
        self.poll_interval = poll_interval
        self.hold = frozenset(hold)
        """Queues whose rows this process writes are always written claimed by it and held
        for its consumers here, waiting or not (see :meth:`lease_for`)."""
        self._looks_due: dict[tuple[str, ...], float] = {}
        """Per set of queues consumed, when its idle consumers look next (see ``receive``)."""
        self._looks_lock = threading.Lock()
        self._thread = threading.local()
        """``busy``: whether this thread's last look found rows (then it looks at once)."""
        self._hand_lock = threading.Lock()
        self._held: dict[str, collections.deque[tuple[datetime, QueuedMessage]]] = {}
        """Per queue, the rows handed over after their commit (and when, on ``clock``: the
        clock of their claim's deadline), not taken yet."""
        self._waiting: collections.Counter[str] = collections.Counter()
        """Per queue, this process's consumers waiting for rows now."""
        self._promised: collections.Counter[str] = collections.Counter()
        """Per queue, rows written claimed (``lease_for``) whose commit did not hand them yet."""

    # --- the hand-over (``Handoff``, through ``sagaloop.runtime.lane.Handoffs``) -------------

    def lease_for(self, queue: str) -> timedelta | None:
        """The lease of a row written now to ``queue`` by this process, to hand it over after
        the commit; None (written unclaimed, for any consumer of any process) unless a consumer
        of ``queue`` waits here with no row handed or promised to it: rows are never held for
        a busy process while another process's consumers could take them.

        A queue of ``hold`` always has the lease: its rows are served by this process first
        (the in-process lane: another engine takes them only once this one gave them back,
        died, or held them past their claim), so nothing is gained by leaving them unclaimed
        and a claim transaction per row is saved."""
        if queue in self.hold:
            return self.lease
        with self._hand_lock:
            held = len(self._held.get(queue, ())) + self._promised[queue]
            if self._waiting[queue] <= held:
                return None
            self._promised[queue] += 1
            return self.lease

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        """Called by the store after a commit (any thread): rows written claimed for this
        process's consumers. Each wakes one waiting consumer of its queue (a ticket of
        ``SqlCore.nudge``), which takes it without a claim."""
        now = self.clock.now()
        with self._hand_lock:
            for row in rows:
                self._held.setdefault(row.queue, collections.deque()).append((now, row))
                self._promised[row.queue] = max(self._promised[row.queue] - 1, 0)
        self.store.nudge([row.queue for row in rows])

    def release_handed(self) -> None:
        """Give back the rows handed over and not taken (at a clean stop): claimable at once
        by any consumer."""
        with self._hand_lock:
            held = [row for rows in self._held.values() for _, row in rows]
            self._held.clear()
        for row in held:
            try:
                self.store.release([row.id], row.claim_token, self.clock.now())
            except Exception as e:  # their claim runs out anyway
                logger.warning("could not give back message %s on %s: %s", row.id, row.queue, e)

    def _pop_handed(self, queues: Sequence[str], limit: int) -> list[QueuedMessage]:
        """Up to ``limit`` rows handed over for ``queues``. One held longer than half its
        lease (its consumers were busy) has its claim extended first, and is dropped if the
        claim was lost meanwhile (a takeover released it: it is in the database again).

        Extended, not dropped while its claim holds: a dropped row would wait out its claim
        before anyone (this process included) could claim it, a step of the lane delayed by up
        to its lease for nothing. Its age is read on ``clock``, the clock of its claim's
        deadline (a virtual clock in tests), not ``time.monotonic()``."""
        fresh_after = self.clock.now() - self.lease / 2
        rows: list[QueuedMessage] = []
        stale: list[QueuedMessage] = []
        with self._hand_lock:
            for queue in queues:
                held = self._held.get(queue)
                while held and len(rows) + len(stale) < limit:
                    since, row = held.popleft()
                    (rows if since >= fresh_after else stale).append(row)
        until = self.clock.now() + self.lease
        rows += [r for r in stale if self.store.extend_claim(r.id, r.claim_token, until)]
        return rows

    def declare(self, queues: Sequence[str]) -> None:
        pass  # rows name their queue; nothing to declare

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """Put raw bodies on the queues. Nothing of sagaloop's own goes this way (its rows are
        written by the store in the transaction that decided them), so their deliveries are
        not trusted: a step, step result or timer put here is refused."""
        self.store.enqueue_raw(batch, self.clock.now())

    def publish_raw(self, queue: str, body: bytes, *, trusted: bool = False) -> None:
        """Put one raw body on ``queue`` (for tests); ``trusted`` makes it pass for a message
        sagaloop wrote, as anyone with write access to the database can."""
        self.store.enqueue_raw([(queue, body)], self.clock.now(), trusted=trusted)

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        """Claim up to ``max_messages`` rows of ``queues``.

        - A consumer waiting for rows is woken at once by a commit of this process that queued
          one there (one consumer per row: see ``SqlCore.wait_for_writes``) and claims.
        - Rows that other processes queued (and rows that became available later) are found by
          looking: the idle consumers of the same ``queues`` take turns, so that one of them
          looks every ``poll_interval`` seconds (the most a row of another process waits for
          an idle consumer); a consumer back from work looks at once, and one whose look
          found a full batch wakes another to look too. A look without a wake is a read first
          (a claim only if a row is there): idle consumers do not write (on SQLite, a claim
          takes the database's write lock). So is a look after a wake when every queue is
          one of ``hold``: their rows come handed over, so such a wake is a row given back or
          released (``SqlCore.nudge`` of rows of any queue) or one another consumer took.
        """
        deadline = time.monotonic() + timeout
        key = tuple(queues)
        woken = False
        look = timeout <= 0 or getattr(self._thread, "busy", True)
        while True:
            if look and not woken:  # a wake left for this queue while its consumers worked
                woken = self.store.wait_for_writes(0, queues)
            handed = self._pop_handed(queues, max_messages) if self._held else []
            if handed:  # each was counted a wake: drop those of the rows beyond this wake's
                # Not a look: rows of this process's commits left unclaimed have their wakes,
                # those of others wait for a turn to look (no probe read after each row).
                self._thread.busy = False
                self.store.drop_wakes([r.queue for r in handed[1 if woken else 0 :]])
                return [DatabaseDelivery(self, r) for r in handed]
            turn = not (woken or look) and self._turn_to_look(key)
            if woken or look or turn:
                now = self.clock.now()
                probe = not woken or self.hold.issuperset(queues)
                rows = self.store.claim(queues, max_messages, now, self.lease, probe=probe)
                self._thread.busy = bool(rows)
                if rows:
                    # Rows of this process's commits taken without their wake: drop the
                    # wakes (else idle consumers would claim for them in vain).
                    self.store.drop_wakes([r.queue for r in rows[1 if woken else 0 :]])
                    if turn and len(rows) == max_messages:
                        self.store.nudge([rows[-1].queue])  # maybe more there: another looks
                    return [DatabaseDelivery(self, r) for r in rows]
            look = False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            wait = min(remaining, self._until_look(key))
            woken = self._wait(wait, queues)

    def _wait(self, timeout: float, queues: Sequence[str]) -> bool:
        """``wait_for_writes``, counted as a consumer of ``queues`` waiting (``lease_for``)."""
        with self._hand_lock:
            self._waiting.update(queues)
        try:
            woken = self.store.wait_for_writes(timeout, queues)
        finally:
            with self._hand_lock:
                self._waiting.subtract(queues)
                if not woken:  # a whole wait without a commit here: forget the promises
                    for queue in queues:  # (of transactions that rolled back; at worst, of
                        self._promised[queue] = 0  # one committing now: one row more handed)
        return woken

    def _turn_to_look(self, key: tuple[str, ...]) -> bool:
        """Whether this consumer of ``key`` looks now (one per ``poll_interval`` seconds)."""
        now = time.monotonic()
        with self._looks_lock:
            if now < self._looks_due.get(key, 0.0):
                return False
            self._looks_due[key] = now + self.poll_interval
            return True

    def _until_look(self, key: tuple[str, ...]) -> float:
        with self._looks_lock:
            due = self._looks_due.get(key, 0.0)
        return max(due - time.monotonic(), 0.001)

    def close(self) -> None:
        pass

    # --- dead letters (sagaloop.brokers.dead_letters.DeadLetters) ----------------------------
    # Rows of sagaloop_dead_letters; a dead letter's id is its row's id. Their trust was not
    # recorded: see ``resend_trusted``.

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        return [_letter(r) for r in self.store.dead_letter_rows(limit=limit)]

    def find_dead_letter(self, id: str) -> DeadLetter | None:
        rows = self.store.dead_letter_rows(ids=_row_ids([id]))
        return _letter(rows[0]) if rows else None

    def count_dead_letters(self) -> int:
        return self.store.count_dead_letters()

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        """Back to their queues in one transaction (so, all or none)."""
        rows = self.store.requeue_dead_letters(
            _row_ids(ids), self.clock.now(), trusted=resend_trusted
        )
        return [_letter(r) for r in rows]

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        return self.store.delete_dead_letters(_row_ids(ids))


def _row_ids(ids: Sequence[str] | None) -> list[int] | None:
    """The row ids among ``ids`` (what is not one names no dead letter)."""
    if ids is None:
        return None
    return [int(i) for i in ids if i.isascii() and i.isdigit() and len(i) < 19]


def _letter(row: DeadLetterRow) -> DeadLetter:
    return DeadLetter(str(row.id), row.queue, row.reason, row.at, row.body, CONTENT_TYPE)
