"""Helpers of the RabbitMQ broker: URL lists and their masking, the topology (names, arguments,
and the declarations that run on a channel of the I/O thread), delivery counts, dead-letter
origins, and the bookkeeping of publisher confirms."""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from sagaloop._secrets import mask_url as mask_url  # the one masking function, re-exported
from sagaloop._secrets import split_urls
from sagaloop.errors import ValidationError

REASON_HEADER = "x-sagaloop-reason"
QUEUE_HEADER = "x-sagaloop-queue"


NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,100}")
"""What a namespace may be: no ``.``, so that a namespace's permission pattern of
docs/operations.md, ``^<namespace>(\\..*)?$``, matches its own exchanges and queues (``x``,
``x.<anything>``) and never another namespace's (``x.eu``, ``x.eu.<app>.engine``); nor a
character a permission pattern reads as a regular expression."""


def check_namespace(namespace: str) -> str:
    """``namespace``, or ValidationError (one line, what to do) when its exchanges and queues
    could not be fenced by the documented permissions, or RabbitMQ reserves their names."""
    if not isinstance(namespace, str) or not NAMESPACE.fullmatch(namespace):
        raise ValidationError(
            f"the namespace {namespace!r:.120} cannot be used with RabbitMQ: use 1 to 100 "
            "letters, digits, '-' and '_' (no '.': the permissions of namespace 'x' would match "
            "the exchanges and queues of 'x.eu'); set SAGALOOP_NAMESPACE"
        )
    if namespace.lower() == "amq":
        raise ValidationError(
            "the namespace 'amq' cannot be used with RabbitMQ: names that start with 'amq.' "
            "are reserved; set SAGALOOP_NAMESPACE to another"
        )
    return namespace


def broker_urls(url: str) -> list[str]:
    """The hosts of a broker URL, in order: ``amqp://u:p@h1:5672/vh,amqp://u:p@h2:5672/vh``
    (commas or semicolons between whole URLs) is two; a single URL is one. Raises ValueError
    when none is given."""
    urls = split_urls(url)
    if not urls:
        raise ValueError("no RabbitMQ URL given: use amqp://user:password@host:port/vhost")
    return urls


def queue_arguments(
    queue_type: str, delivery_limit: int, dead_letter_exchange: str
) -> dict[str, Any]:
    """``x-`` arguments of a work queue. Classic queues have no delivery limit (RabbitMQ 3.x
    counts deliveries only in quorum queues); the dead-letter exchange still receives what
    sagaloop dead-letters explicitly."""
    args: dict[str, Any] = {
        "x-queue-type": queue_type,
        "x-dead-letter-exchange": dead_letter_exchange,
    }
    if queue_type == "quorum":
        args["x-delivery-limit"] = delivery_limit
    return args


@dataclasses.dataclass(frozen=True)
class Topology:
    """The names and arguments of one namespace's exchanges and queues."""

    namespace: str
    queue_type: str
    delivery_limit: int

    def __post_init__(self) -> None:
        check_namespace(self.namespace)

    @property
    def exchange(self) -> str:
        """The public exchange: routes only to engine queues (start, event, cancel, retry)."""
        return self.namespace

    @property
    def internal_exchange(self) -> str:
        """The exchange sagaloop's own processes publish to: routes to every queue."""
        return f"{self.namespace}.internal"

    @staticmethod
    def public(queue: str) -> bool:
        """Whether ``queue`` is an engine queue (``<app>.engine`` or ``<app>.starts``), which
        the public exchange routes to; a step queue (``<app>.steps.<queue>``) is not."""
        return queue.endswith((".engine", ".starts")) and ".steps." not in queue

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.namespace}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.namespace}.dead"

    def queue(self, name: str) -> str:
        return f"{self.namespace}.{name}"

    def declare(self, queues: list[str], channel: Any, call: Call) -> None:
        """Declare the exchanges and the work queues (idempotent) on ``channel``, then close it
        and resolve ``call``. Sent without waiting for each reply (nowait) but the last: a
        refused declaration closes the channel, which fails the call. The dead-letter queue is
        declared apart (:meth:`declare_dead_letters`)."""

        def done(_frame: Any) -> None:
            call.resolve()
            channel.close()

        channel.exchange_declare(self.exchange, "topic", durable=True)
        channel.exchange_declare(self.internal_exchange, "topic", durable=True)
        args = queue_arguments(self.queue_type, self.delivery_limit, self.dead_letter_exchange)
        for q in queues:
            channel.queue_declare(self.queue(q), durable=True, arguments=args)
            channel.queue_bind(self.queue(q), self.internal_exchange, routing_key=q)
            if self.public(q):
                channel.queue_bind(self.queue(q), self.exchange, routing_key=q)
            else:  # earlier versions bound it: take that away (a no-op when absent)
                channel.queue_unbind(self.queue(q), self.exchange, routing_key=q)
        channel.exchange_declare(self.dead_letter_exchange, "fanout", durable=True, callback=done)

    def declare_dead_letters(self, channel: Any, call: Call) -> None:
        """Declare the dead-letter queue and bind it (idempotent), as :meth:`declare` does.

        It is a classic queue (peeking requeues, which a quorum queue would count towards a
        delivery limit), so it lives on one node of a cluster: while that node is down RabbitMQ
        refuses its declaration (see :func:`dead_letters_unavailable`), and a message
        dead-lettered to it comes back unroutable."""

        def done(_frame: Any) -> None:
            call.resolve()
            channel.close()

        dead_args = {"x-queue-type": "classic"}
        channel.queue_declare(self.dead_letter_queue, durable=True, arguments=dead_args)
        channel.queue_bind(self.dead_letter_queue, self.dead_letter_exchange, callback=done)


def dead_letters_unavailable(error: str) -> bool:
    """Whether declaring the dead-letter queue failed because the node it lives on is down
    (a node of the cluster lost), not because the declaration is wrong."""
    return "NOT_FOUND" in error and "is down or inaccessible" in error


def delivery_count(headers: Mapping[str, Any] | None, redelivered: bool) -> int:
    """1 on the first delivery. Quorum queues count earlier deliveries in ``x-delivery-count``;
    classic queues only say that the message was delivered before (then 2)."""
    count = (headers or {}).get("x-delivery-count")
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count + 1
    return 2 if redelivered else 1


def _text(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def dead_letter_origin(headers: Mapping[str, Any] | None, namespace: str) -> tuple[str, str]:
    """``(queue, reason)`` of a dead letter: from sagaloop's headers when sagaloop dead-lettered
    it, else from RabbitMQ's ``x-death`` headers (a message over the delivery limit)."""
    headers = headers or {}
    queue = _text(headers.get(QUEUE_HEADER))
    reason = _text(headers.get(REASON_HEADER))
    if queue is not None and reason is not None:
        return queue, reason
    first_queue = _text(headers.get("x-first-death-queue"))
    first_reason = _text(headers.get("x-first-death-reason"))
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        first_queue = first_queue or _text(deaths[0].get("queue"))
        first_reason = first_reason or _text(deaths[0].get("reason"))
    full = queue or first_queue or ""
    prefix = namespace + "."
    short = full[len(prefix) :] if full.startswith(prefix) else full
    why = first_reason or "unknown"
    if why == "delivery_limit":
        return short, "delivered more times than the queue's delivery limit (delivery_limit)"
    return short, reason or f"dead-lettered by RabbitMQ ({why})"


class Call:
    """The result of work handed to the I/O thread, awaited by another thread (or passed to
    ``then`` on the I/O thread)."""

    def __init__(self, then: Callable[[Call], None] | None = None) -> None:
        self._event = threading.Event()
        self._then = then
        self.value: Any = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def resolve(self, value: Any = None) -> None:
        if not self._event.is_set():
            self.value = value
            self._finish()

    def fail(self, error: str) -> None:
        if not self._event.is_set():
            self.error = error
            self._finish()

    def _finish(self) -> None:
        self._event.set()
        if self._then is not None:
            self._then(self)

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


class PublishRequest(Call):
    """One ``publish`` call: done when every message of it was confirmed, nacked or returned."""

    def __init__(self, size: int, then: Callable[[PublishRequest], None] | None = None) -> None:
        super().__init__(then)  # type: ignore[arg-type]  # called with this request
        self.outstanding = size
        self.problems: list[str] = []

    def settle(self, problem: str | None) -> None:
        if problem is not None:
            self.problems.append(problem)
        self.outstanding -= 1
        if self.outstanding <= 0:
            self.resolve()


class Confirms:
    """Publisher-confirm bookkeeping of one channel (used on the I/O thread only).

    Delivery tags count the channel's publishes from 1. A batch is published whole and its
    confirms are collected as they come (``multiple`` acks settle every tag up to theirs), so a
    batch costs one round trip, not one per message. A ``basic.return`` (unroutable with
    ``mandatory``) reaches the client before the ack of its message but names no tag: it is
    charged to the oldest unconfirmed message with the same routing key.
    """

    def __init__(self) -> None:
        self._seq = 0
        self._pending: dict[int, tuple[PublishRequest, str]] = {}
        self._returned: set[int] = set()

    def published(self, request: PublishRequest, routing_key: str) -> None:
        self._seq += 1
        self._pending[self._seq] = (request, routing_key)

    def confirmed(self, tag: int, multiple: bool, ack: bool) -> None:
        if multiple:
            tags = []
            for t in self._pending:
                if t > tag:
                    break
                tags.append(t)
        else:
            tags = [tag] if tag in self._pending else []
        for t in tags:
            request, key = self._pending.pop(t)
            problem = None
            if t in self._returned:
                self._returned.discard(t)
                problem = f"unroutable: no queue is bound to routing key {key!r}"
            elif not ack:
                problem = f"the broker refused (nacked) the message to {key!r}"
            request.settle(problem)

    def returned(self, routing_key: str) -> None:
        for t, (_, key) in self._pending.items():
            if key == routing_key and t not in self._returned:
                self._returned.add(t)
                return

    def abandon(self, request: PublishRequest) -> None:
        """Forget a request whose caller stopped waiting (confirm timeout)."""
        for t in [t for t, (r, _) in self._pending.items() if r is request]:
            del self._pending[t]
            self._returned.discard(t)

    def fail_all(self, error: str) -> None:
        for request in {r for r, _ in self._pending.values()}:
            request.fail(error)
        self._pending.clear()
        self._returned.clear()


@dataclasses.dataclass(eq=False)
class Consumer:
    queue: str
    prefetch: int
    generation: int  # of the connection it was made on
    tag: str | None = None  # None until basic.consume was sent
    unsettled: int = 0  # delivered and neither acked nor nacked (handed out, parked, buffered)


@dataclasses.dataclass(eq=False)
class Message:
    consumer: Consumer
    body: bytes
    content_type: str | None
    deliveries: int
    tag: int  # valid on the consumer's connection only
    trusted: bool = False  # signed by a sagaloop process (see signing.py)
    until: float = 0.0  # on the clock: end of the lease, or of the retry delay while parked
    holder: object = None  # the delivery handed out for it, while its lease holds
    trace: dict[str, Any] | None = None  # the W3C trace headers a plain publisher set, unchecked


class Holdings:
    """What a broker holds of RabbitMQ's messages: consumers per queue, deliveries buffered
    until ``receive`` takes them, leased deliveries, and parked retries. Shared by the I/O
    thread and the receiving threads; every method is called with ``cond`` held.

    A consumer is made only when all of a queue's consumers are full, with the prefetch the
    caller asked for, and never past ``prefetch`` in all for the queue: so a process holds no
    more messages than its callers asked for, and an idle one hides none from a busy one.
    Buffered messages have no lease (a nack would count as a delivery): they wait for the next
    ``receive`` here, or go back to the queue with the connection."""

    def __init__(self, clock: Any, lease: float, prefetch: int) -> None:
        self.cond = threading.Condition()
        self.clock = clock
        self.lease = lease
        self.prefetch = prefetch
        self.generation = 0  # of the connection: +1 on each loss
        self.consumers: dict[str, list[Consumer]] = collections.defaultdict(list)
        self.buffer: dict[str, collections.deque[Message]] = collections.defaultdict(
            collections.deque
        )
        self.leased: set[Message] = set()
        self.parked: list[Message] = []

    def now(self) -> float:
        ts: float = self.clock.now().timestamp()
        return ts

    def consumers_to_make(self, queues: list[str], max_messages: int) -> list[Consumer]:
        made = []
        for q in queues:
            active = self.consumers[q]
            room = self.prefetch - sum(c.prefetch for c in active)
            if room > 0 and all(c.unsettled >= c.prefetch for c in active):
                consumer = Consumer(q, min(max_messages, room), self.generation)
                active.append(consumer)
                made.append(consumer)
        return made

    def forget(self, consumer: Consumer) -> None:
        active = self.consumers.get(consumer.queue, [])
        if consumer in active:
            active.remove(consumer)

    def delivered(self, message: Message) -> None:
        if message.consumer.generation == self.generation:
            message.consumer.unsettled += 1
            self.buffer[message.consumer.queue].append(message)
            self.cond.notify_all()

    def take(self, queues: list[str], limit: int) -> list[Message]:
        now, out = self.now(), list[Message]()
        for q in queues:
            buffer = self.buffer.get(q)
            while buffer and len(out) < limit:
                message = buffer.popleft()
                message.until = now + self.lease
                self.leased.add(message)
                out.append(message)
        return out

    def expire(self) -> tuple[list[Message], list[Consumer]]:
        """Take back the leases that ran out (to be nacked) and bring back the retries that
        are due. Consumers that were full are returned too, to be cancelled before the nack:
        nothing can be on its way to a full consumer, and without it RabbitMQ cannot hand the
        message straight back to this process."""
        now = self.now()
        expired = [m for m in self.leased if m.until <= now]
        full = {m.consumer for m in expired if m.consumer.unsettled >= m.consumer.prefetch}
        for m in expired:
            self.leased.discard(m)
            m.holder = None
            m.consumer.unsettled -= 1
        for c in full:
            self.forget(c)
        due = [m for m in self.parked if m.until <= now]
        for m in due:
            self.parked.remove(m)
            self.buffer[m.consumer.queue].append(m)
        if due:
            self.cond.notify_all()
        return expired, list(full)

    def release(self, message: Message, holder: object) -> bool:
        """End the lease to settle the message; False if the lease was already lost."""
        if message.holder is not holder:
            return False
        message.holder = None
        self.leased.discard(message)
        message.consumer.unsettled -= 1
        return True

    def relet(self, message: Message, holder: object) -> None:
        """Undo ``release`` (a settlement that failed): the lease goes on."""
        if message.consumer.generation == self.generation:
            message.holder = holder
            message.consumer.unsettled += 1
            self.leased.add(message)

    def extend(self, message: Message, holder: object) -> bool:
        if message.holder is not holder:
            return False
        message.until = self.now() + self.lease
        return True

    def park(self, message: Message, holder: object, delay: float) -> None:
        if message.holder is not holder:
            return
        message.holder = None
        self.leased.discard(message)
        message.deliveries += 1
        message.until = self.now() + delay
        self.parked.append(message)

    def reset(self) -> None:
        """The connection is gone: RabbitMQ requeued every unacked message of it."""
        self.generation += 1
        self.buffer.clear()
        for m in self.leased:
            m.holder = None
        self.leased.clear()
        self.parked.clear()
        self.consumers.clear()
        self.cond.notify_all()
