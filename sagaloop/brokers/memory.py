"""An in-memory broker for unit tests. It passes the same contract suite as the real ones:
at-least-once delivery, manual acks, a lease after which an unacked message is redelivered,
and a dead-letter list with reasons.

Trust: it lives in one process, so what :meth:`MemoryBroker.publish` sends (the relay, the
Broker protocol) is trusted; what a test injects with :meth:`MemoryBroker.publish_raw` is not,
unless it says ``trusted=True``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

from sagaloop.brokers.dead_letters import DeadLetter
from sagaloop.engine.messages import CONTENT_TYPE
from sagaloop.engine.ports import Clock, Delivery, SystemClock, Tx


@dataclasses.dataclass
class _Message:
    id: int
    queue: str
    body: bytes
    content_type: str | None
    trusted: bool = False
    deliveries: int = 0
    not_before: float = 0.0


class MemoryDelivery:
    def __init__(self, broker: MemoryBroker, message: _Message, lease_until: float) -> None:
        self._broker = broker
        self._message = message
        self.lease_until = lease_until
        self.body = message.body
        self.content_type = message.content_type
        self.deliveries = message.deliveries
        self.trusted = message.trusted

    def settle(self, tx: Tx) -> None:
        pass  # memory queues take no part in database transactions

    def ack(self) -> None:
        self._broker._finish(self)

    def extend(self) -> bool:
        with self._broker._cond:
            if self._broker._unacked.get(self._message.id) is not self:
                return False
            self.lease_until = self._broker._now() + self._broker.lease.total_seconds()
            return True

    def retry_later(self, delay: timedelta) -> None:
        if self._broker._finish(self):
            self._message.not_before = self._broker._now() + delay.total_seconds()
            self._broker._put(self._message)

    def dead_letter(self, reason: str) -> None:
        if self._broker._finish(self):
            self._broker._bury(self._message, reason)


class MemoryBroker:
    uses_outbox = False

    def __init__(self, *, lease: timedelta = timedelta(seconds=60), clock: Clock | None = None):
        self.lease = lease
        self.clock = clock or SystemClock()
        self._queues: dict[str, collections.deque[_Message]] = collections.defaultdict(
            collections.deque
        )
        self._unacked: dict[int, MemoryDelivery] = {}
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._dead: list[tuple[DeadLetter, bool]] = []  # and whether it was trusted
        self._dead_ids = itertools.count(1)

    @property
    def dead(self) -> list[tuple[str, bytes, str]]:
        """The dead letters so far as ``(queue, body, reason)``, oldest first."""
        with self._cond:
            return [(d.queue, d.body, d.reason) for d, _ in self._dead]

    def _now(self) -> float:
        return self.clock.now().timestamp()

    def declare(self, queues: Sequence[str]) -> None:
        with self._cond:
            for q in queues:
                self._queues.setdefault(q, collections.deque())

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        for queue, body in batch:
            self.publish_raw(queue, body, trusted=True)

    def publish_raw(
        self,
        queue: str,
        body: bytes,
        content_type: str | None = CONTENT_TYPE,
        *,
        trusted: bool = False,
    ) -> None:
        """Put a message on ``queue`` as any publisher would (not trusted, by default)."""
        self._put(_Message(next(self._ids), queue, body, content_type, trusted))

    def _put(self, message: _Message) -> None:
        with self._cond:
            self._queues[message.queue].append(message)
            self._cond.notify_all()

    def _finish(self, delivery: MemoryDelivery) -> bool:
        """Forget an unacked delivery; False if its lease had already expired."""
        with self._cond:
            current = self._unacked.get(delivery._message.id)
            if current is not delivery:
                return False
            del self._unacked[delivery._message.id]
            return True

    def _expire_leases(self, now: float) -> None:
        for key, d in list(self._unacked.items()):
            if d.lease_until <= now:
                del self._unacked[key]
                self._queues[d._message.queue].appendleft(d._message)

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                now = self._now()
                self._expire_leases(now)
                out: list[Delivery] = []
                for q in queues:
                    pending = self._queues[q]
                    for message in list(pending):
                        if len(out) >= max_messages:
                            break
                        if message.not_before > now:
                            continue
                        pending.remove(message)
                        message.deliveries += 1
                        d = MemoryDelivery(self, message, now + self.lease.total_seconds())
                        self._unacked[message.id] = d
                        out.append(d)
                if out:
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(min(remaining, 0.05))

    # --- dead letters (sagaloop.brokers.dead_letters.DeadLetters) ----------------------------
    # Ids count from 1 in this broker; a dead letter keeps its content type and trust.

    def _bury(self, message: _Message, reason: str) -> None:
        with self._cond:
            letter = DeadLetter(
                str(next(self._dead_ids)),
                message.queue,
                reason,
                self.clock.now(),
                message.body,
                message.content_type,
            )
            self._dead.append((letter, message.trusted))

    def _take_dead(self, ids: Sequence[str] | None) -> list[tuple[DeadLetter, bool]]:
        wanted = None if ids is None else set(ids)
        taken: list[tuple[DeadLetter, bool]] = []
        kept: list[tuple[DeadLetter, bool]] = []
        with self._cond:
            for entry in self._dead:
                (taken if wanted is None or entry[0].id in wanted else kept).append(entry)
            self._dead = kept
        return taken

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        with self._cond:
            return [d for d, _ in self._dead[:limit]]

    def find_dead_letter(self, id: str) -> DeadLetter | None:
        with self._cond:
            return next((d for d, _ in self._dead if d.id == id), None)

    def count_dead_letters(self) -> int:
        with self._cond:
            return len(self._dead)

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        taken = self._take_dead(ids)
        for d, trusted in taken:
            self.publish_raw(d.queue, d.body, d.content_type, trusted=trusted)
        return [d for d, _ in taken]

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        return len(self._take_dead(ids))

    def close(self) -> None:
        with self._cond:
            for d in list(self._unacked.values()):
                self._queues[d._message.queue].appendleft(d._message)
            self._unacked.clear()
            self._cond.notify_all()
