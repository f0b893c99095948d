"""RabbitMQ's dead letters (the classic queue ``<namespace>.dead``): dead-lettering a delivery,
and reading, resending and purging dead letters on a channel of the broker's I/O thread (part of
:class:`~sagaloop.brokers.rabbitmq.RabbitBroker`, the ``DeadLetters`` protocol of
``sagaloop.brokers.dead_letters``).

Dead-lettering: a delivery whose lease is still held is published, with publisher confirms, to
the fanout exchange ``{namespace}.dlx`` with its reason, its queue and a new id in headers (and
signed again when it was trusted, so that resent it is trusted again), and only then acked. If
that publish fails, the lease is kept and the message is redelivered when it expires, so it is
not lost on the way.

Ids. A message in a queue has no id RabbitMQ keeps, so sagaloop makes one:

- a message that sagaloop dead-lettered carries it in the header ``x-sagaloop-dead-letter-id``
  (12 random hex digits, stamped when it was dead-lettered), with the time in the ``timestamp``
  property;
- one that RabbitMQ dead-lettered itself (over the delivery limit), or that an older sagaloop
  dead-lettered, gets 12 hex digits of the SHA-256 of its envelope's ``message_id`` (or of
  the body, when it is not an envelope), the queue it came from, the number of times it was
  dead-lettered (the counts of its ``x-death`` headers) and the time of the first of them.
  Two identical messages dead-lettered in the same second share that hash: the second gets
  ``-2`` (see ``Numbering``), counted from the head of the queue.

Every operation reads the queue from its head with ``basic.get`` and no ack; what it leaves
is given back with one ``basic.nack(0, multiple, requeue)``, and since the dead-letter queue is
classic, a requeued message keeps its place. A pass looks at no more messages than the queue
held when it began, so resending everything ends even when what it sends is dead-lettered again
meanwhile. A message being read is invisible to a second pass run at the same moment.

Resending publishes to the internal exchange with the original routing key, ``mandatory``, on a
channel in confirm mode, and acks the dead letter only after RabbitMQ confirmed the publish: a
dead letter is never lost. If the process dies between the confirm and the ack, the dead letter
comes back to the queue while its copy went out too: resent twice, the consumer's inbox
processes it once (same body, same ``message_id``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal

import pika

from sagaloop.brokers._amqp import QUEUE_HEADER, REASON_HEADER, Call, Topology, dead_letter_origin
from sagaloop.brokers.dead_letters import DeadLetter, Numbering
from sagaloop.brokers.rabbitmq.consuming import Consuming, RabbitDelivery
from sagaloop.brokers.rabbitmq.publishing import Publishing
from sagaloop.brokers.signing import SIGNATURE_HEADER, sign
from sagaloop.errors import BrokerError

logger = logging.getLogger(__name__)

DEAD_LETTER_ID_HEADER = "x-sagaloop-dead-letter-id"

Mode = Literal["list", "find", "resend", "purge"]


def new_dead_letter_id() -> str:
    return uuid.uuid4().hex[:12]


def _deaths(headers: Mapping[str, Any]) -> tuple[int, datetime | None]:
    """How many times RabbitMQ dead-lettered the message, and when it first did."""
    deaths = headers.get("x-death")
    if not isinstance(deaths, list):
        return 0, None
    entries = [d for d in deaths if isinstance(d, Mapping)]
    count = sum(c for d in entries if isinstance(c := d.get("count"), int))
    times = [t for d in entries if isinstance(t := d.get("time"), datetime)]
    return count, min(times) if times else None


def dead_letter(props: Any, body: bytes, namespace: str, number: Numbering) -> DeadLetter:
    """The dead letter of a message read from the dead-letter queue."""
    headers: Mapping[str, Any] = props.headers or {}
    queue, reason = dead_letter_origin(headers, namespace)
    stamped = headers.get(DEAD_LETTER_ID_HEADER)
    if isinstance(stamped, bytes):
        stamped = stamped.decode("utf-8", "replace")
    timestamp = props.timestamp if isinstance(props.timestamp, int) else None
    letter = DeadLetter(
        id="",
        queue=queue,
        reason=reason,
        at=datetime.fromtimestamp(timestamp, UTC) if timestamp is not None else None,
        body=body,
        content_type=props.content_type,
    )
    if isinstance(stamped, str) and stamped:
        base = stamped
    else:
        count, first = _deaths(headers)
        key = letter.message_id or "sha256:" + hashlib.sha256(body).hexdigest()
        text = "\0".join([key, queue, str(count), first.isoformat() if first else ""])
        base = hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:12]
        letter = dataclasses.replace(letter, at=first)
    return dataclasses.replace(letter, id=number(base))


class Scan:
    """One pass over the dead-letter queue on a channel of its own, run on the I/O thread as
    ``_with_channel`` runs things: ``scan(channel, call)`` resolves ``call`` with the scan once
    done and closes the channel (a failure fails ``call``).

    ``list``: up to ``limit``, left in place. ``find``: the first with one of ``ids``.
    ``resend``, ``purge``: those with one of ``ids`` (None: every message the queue held when
    the pass began). ``found`` holds what was listed, found or resent; ``purged`` counts.

    Resends are pipelined: up to ``WINDOW`` publishes await their confirms while the pass reads
    on; each dead letter is acked when its own publish is confirmed. After a failure the pass
    reads no further, settles what is in flight, then fails."""

    WINDOW = 100

    def __init__(
        self, topology: Topology, mode: Mode, ids: Sequence[str] | None, limit: int | None
    ) -> None:
        self.topology = topology
        self.mode = mode
        self.wanted = None if ids is None else set(ids)
        self.limit = limit
        self.found: list[DeadLetter] = []
        self.purged = 0
        self.remaining = 0  # dead letters in the queue after the pass
        self._number = Numbering()
        self._budget: int | None = None  # messages left to look at
        self._held = False  # a message may still be unacked on the channel
        self._getting = False  # a basic.get awaits its answer
        self._exhausted = False  # the queue answered basic.get-empty
        self._error: str | None = None
        self._seq = 0  # publishes on the channel, counted as its confirms count them
        self._inflight: dict[int, tuple[DeadLetter, int]] = {}  # seq: (letter, delivery tag)
        self._returned: set[int] = set()
        self._finishing = False
        self._channel: Any = None
        self._call: Call | None = None

    def __call__(self, channel: Any, call: Call) -> None:
        self._channel, self._call = channel, call
        channel.add_callback(self._on_empty, [pika.spec.Basic.GetEmpty], False)
        if self.mode == "resend":
            channel.add_on_return_callback(self._on_return)
            channel.confirm_delivery(self._on_confirm, callback=lambda _frame: self._next())
        else:
            self._next()

    def _done(self) -> bool:
        if self._error is not None or self._exhausted or self._budget == 0:
            return True
        if self.mode == "list":
            return self.limit is not None and len(self.found) >= self.limit
        return self.wanted is not None and not self.wanted

    def _next(self) -> None:
        if self._finishing or self._getting:
            return
        if self._done():
            if not self._inflight:
                self._finish()
        elif len(self._inflight) < self.WINDOW:
            self._getting = True
            self._channel.basic_get(self.topology.dead_letter_queue, self._got)

    def _on_empty(self, _frame: Any) -> None:
        self._getting, self._exhausted = False, True
        self._next()

    def _got(self, _channel: Any, method: Any, props: Any, body: bytes) -> None:
        self._getting, self._held = False, True
        if self._budget is None:  # the depth when the pass began
            self._budget = method.message_count + 1
        self._budget -= 1
        letter = dead_letter(props, body, self.topology.namespace, self._number)
        tag = method.delivery_tag
        if self.mode == "list":
            self.found.append(letter)
        elif self.wanted is not None and letter.id not in self.wanted:
            pass  # held until the end
        elif self.mode == "find":
            self.found.append(letter)
            self.wanted = set()
        elif self.mode == "purge":
            self._channel.basic_ack(tag)
            self.purged += 1
            self._discard(letter)
        else:
            self._discard(letter)
            self._resend(letter, props, tag)
        self._next()

    def _discard(self, letter: DeadLetter) -> None:
        if self.wanted is not None:
            self.wanted.discard(letter.id)

    def _fail(self, error: str) -> None:
        if self._error is None:
            self._error = error

    def _resend(self, letter: DeadLetter, props: Any, tag: int) -> None:
        if not letter.queue:
            self._fail(f"dead letter {letter.id} names no queue it came from: purge it")
            return
        signature = (props.headers or {}).get(SIGNATURE_HEADER)
        properties = pika.BasicProperties(
            content_type=props.content_type,
            delivery_mode=2,
            message_id=props.message_id,
            headers={SIGNATURE_HEADER: signature} if signature is not None else None,
        )
        try:
            self._channel.basic_publish(
                self.topology.internal_exchange, letter.queue, letter.body, properties, True
            )
        except Exception as e:
            self._fail(f"resending dead letter {letter.id} failed: {e!r}")
            return
        self._seq += 1
        self._inflight[self._seq] = (letter, tag)

    def _on_return(self, _channel: Any, method: Any, _props: Any, _body: bytes) -> None:
        """Unroutable: charged to the oldest message in flight to that routing key (a return
        comes before the confirm of its message and names no sequence number)."""
        for seq, (letter, _tag) in self._inflight.items():
            if letter.queue == method.routing_key and seq not in self._returned:
                self._returned.add(seq)
                return

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if method.multiple:
            seqs = [s for s in self._inflight if s <= method.delivery_tag]
        else:
            seqs = [method.delivery_tag] if method.delivery_tag in self._inflight else []
        for seq in seqs:
            letter, tag = self._inflight.pop(seq)
            if seq in self._returned:
                self._returned.discard(seq)
                self._fail(
                    f"dead letter {letter.id} was not resent: no queue is bound to "
                    f"{letter.queue!r} (is the queue declared? start a worker or engine of its "
                    "app first)"
                )
            elif not isinstance(method, pika.spec.Basic.Ack):
                self._fail(f"RabbitMQ refused (nacked) the resent dead letter {letter.id}")
            else:
                self._channel.basic_ack(tag)
                self.found.append(letter)
        self._next()

    def _finish(self) -> None:
        """Give back what is held, count what is left (on the same channel: after the
        requeue), then resolve and close."""
        call, channel, error = self._call, self._channel, self._error
        if call is None or self._finishing:
            return
        self._finishing = True
        if self._held:  # every message of the channel not acked, in one go
            channel.basic_nack(0, multiple=True, requeue=True)
        if error is not None and self.mode == "resend" and self.found:
            error = f"resent {len(self.found)} dead letters, then: {error}"

        def counted(frame: Any) -> None:
            self.remaining = frame.method.message_count
            if error is None:
                call.resolve(self)
            else:
                call.fail(error)
            channel.close()

        channel.queue_declare(self.topology.dead_letter_queue, passive=True, callback=counted)


def count(topology: Topology, channel: Any, call: Call) -> None:
    """Resolve ``call`` with the number of dead letters (a passive declare: unacked ones that a
    scan holds at that moment are not counted)."""

    def counted(frame: Any) -> None:
        call.resolve(frame.method.message_count)
        channel.close()

    channel.queue_declare(topology.dead_letter_queue, passive=True, callback=counted)


def purge(topology: Topology, channel: Any, call: Call) -> None:
    """Resolve ``call`` with the number of dead letters purged (all but unacked ones)."""

    def purged(frame: Any) -> None:
        call.resolve(frame.method.message_count)
        channel.close()

    channel.queue_purge(topology.dead_letter_queue, callback=purged)


class DeadLetters(Consuming, Publishing):
    """The dead letters of ``RabbitBroker``: ``dead_letter`` of a delivery, and the
    ``DeadLetters`` protocol (list, find, count, resend, purge)."""

    def peek_dead_letters(self, limit: int = 1000) -> list[tuple[str, bytes, str]]:
        """Up to ``limit`` dead letters as ``(queue, body, reason)``, oldest first, left in
        place (see :meth:`list_dead_letters`)."""
        return [(d.queue, d.body, d.reason) for d in self.list_dead_letters(limit)]

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        """Up to ``limit`` dead letters, oldest first, left in place: read with ``basic.get``
        without ack on a channel of their own, then all given back with one ``basic.nack``.
        The dead-letter queue is a classic queue, where a requeued message keeps its place
        and no delivery limit applies."""
        return self._dead_letter_scan("list", None, limit, "reading").found

    def find_dead_letter(self, id: str) -> DeadLetter | None:
        found = self._dead_letter_scan("find", [id], None, "reading").found
        return found[0] if found else None

    def count_dead_letters(self) -> int:
        """The depth of ``<namespace>.dead`` (a passive declare)."""
        counting = functools.partial(count, self.topology)
        out: int = self._call(
            functools.partial(self._with_channel, counting), "counting dead letters"
        )
        return out

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        """Publish each to its queue (with its signature, if it had one) and ack it once
        RabbitMQ confirmed the publish (see the module docstring)."""
        return self._dead_letter_scan("resend", ids, None, "resending").found

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        if ids is not None:
            return self._dead_letter_scan("purge", ids, None, "purging").purged
        purging = functools.partial(purge, self.topology)
        out: int = self._call(
            functools.partial(self._with_channel, purging), "purging dead letters"
        )
        return out

    def _dead_letter_scan(
        self, mode: Mode, ids: Sequence[str] | None, limit: int | None, what: str
    ) -> Scan:
        scan = Scan(self.topology, mode, ids, limit)
        out: Scan = self._call(
            functools.partial(self._with_channel, scan), f"{what} the dead letters"
        )
        return out

    def _dead_letter(self, delivery: RabbitDelivery, reason: str) -> None:
        message, queue = delivery._message, delivery.queue
        if not self._release(delivery):
            logger.info("not dead-lettering a message of %s: its lease was lost", queue)
            return
        headers = {
            REASON_HEADER: reason[:4000],
            QUEUE_HEADER: queue,
            DEAD_LETTER_ID_HEADER: new_dead_letter_id(),
        }
        if message.trusted and self._signing_key is not None:  # resent, it is trusted again
            headers[SIGNATURE_HEADER] = sign(self._signing_key, queue, message.body)
        props = pika.BasicProperties(
            content_type=message.content_type,
            delivery_mode=2,
            headers=headers,
            timestamp=int(self.clock.now().timestamp()),
        )
        try:
            self._publish([(self.topology.dead_letter_exchange, queue, message.body, props)])
        except BrokerError:
            with self._cond:  # keep the lease: the message is redelivered when it expires
                self._held.relet(message, delivery)
            raise
        logger.warning("dead-lettered a message of %s: %s", queue, reason)
        self._submit(functools.partial(self._ack, message))
