"""Consuming from RabbitMQ (part of :class:`~sagaloop.brokers.rabbitmq.RabbitBroker`).

Consuming: deliveries are buffered from the I/O thread into a local queue that ``receive`` takes
from; consumers are made on demand, sized to what callers ask for (see ``Holdings``). A
handed-out delivery is leased on ``clock``: unacked past its lease it is nacked with requeue, so
RabbitMQ redelivers it and counts it towards the delivery limit, and its stale ack is ignored.
``retry_later`` keeps the message here without telling RabbitMQ. A process that dies loses its
connection, and RabbitMQ redelivers its messages at once.

Trust: a delivery is ``trusted`` only when its signature header verifies with the broker's
``signing_key`` (``signing.py``). Consumers refuse internal messages (step, step result, timer)
that are not.

Threads: the I/O thread looks at the clock every ``POLL`` seconds for expired leases and due
retries; a message is acked or nacked only on the channel it came on (after a reconnect,
RabbitMQ redelivers it instead).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from sagaloop.brokers._amqp import Consumer, Message, delivery_count
from sagaloop.brokers.rabbitmq.link import Link
from sagaloop.brokers.signing import SIGNATURE_HEADER, verify
from sagaloop.engine.ports import Delivery, Tx
from sagaloop.tracing import TRACEPARENT, TRACESTATE

if TYPE_CHECKING:
    from sagaloop.brokers.rabbitmq.broker import RabbitBroker

logger = logging.getLogger(__name__)

POLL = 0.05
"""Real seconds between looks at the clock for expired leases and due retries."""


class RabbitDelivery:
    """A received message. ``settle`` is a no-op: RabbitMQ takes no part in the database
    transaction; the consumer acks after its commit, and the inbox absorbs redeliveries."""

    def __init__(self, broker: RabbitBroker, message: Message) -> None:
        self._broker = broker
        self._message = message
        self.body = message.body
        self.content_type = message.content_type
        self.deliveries = message.deliveries
        self.queue = message.consumer.queue
        self.trusted = message.trusted
        self.trace = message.trace  # checked by the consumer (``runtime.decode``)

    def settle(self, tx: Tx) -> None:
        pass

    def ack(self) -> None:
        if self._broker._release(self):
            self._broker._submit(functools.partial(self._broker._ack, self._message))

    def extend(self) -> bool:
        return self._broker._extend(self)

    def retry_later(self, delay: timedelta) -> None:
        self._broker._park(self, delay)

    def dead_letter(self, reason: str) -> None:
        self._broker._dead_letter(self, reason)


class Consuming(Link):
    """Receiving, leasing and settling deliveries: the part of ``RabbitBroker`` that reads."""

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        names = list(dict.fromkeys(queues))
        if max_messages < 1 or not names:
            return []
        with self._cond:
            unknown = [q for q in names if q not in self._queues]
        if unknown:  # consuming a missing queue would close the channel
            self.declare(unknown)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._housekeep()
                out = [self._hand_out(m) for m in self._held.take(names, max_messages)]
                remaining = deadline - time.monotonic()
                if out or self._closed or remaining <= 0:
                    return out
                if self._ready:
                    for consumer in self._held.consumers_to_make(names, max_messages):
                        self._submit(functools.partial(self._start_consumer, consumer))
                self._cond.wait(min(remaining, POLL))

    def _hand_out(self, message: Message) -> Delivery:
        broker = cast("RabbitBroker", self)  # the only class made of this part
        delivery = RabbitDelivery(broker, message)
        message.holder = delivery
        return delivery

    def _housekeep(self) -> None:
        """With ``_cond`` held, from ``receive`` and from the I/O thread's timer."""
        expired, full = self._held.expire()
        if expired:
            self._submit(functools.partial(self._requeue, expired, full))

    def _release(self, delivery: RabbitDelivery) -> bool:
        with self._cond:
            return self._held.release(delivery._message, delivery)

    def _extend(self, delivery: RabbitDelivery) -> bool:
        with self._cond:
            return self._held.extend(delivery._message, delivery)

    def _park(self, delivery: RabbitDelivery, delay: timedelta) -> None:
        """Keep the message unacked and hand it out again here after ``delay``: a nack would
        count towards the delivery limit while, say, the database is down."""
        with self._cond:
            self._held.park(delivery._message, delivery, delay.total_seconds())

    # --- the I/O thread ----------------------------------------------------------------------

    def _tick(self) -> None:
        if not self._closing:
            with self._cond:
                self._housekeep()
            self._ioloop.call_later(POLL, self._tick)

    def _start_consumer(self, consumer: Consumer) -> None:
        channel = self._consume_channel
        if consumer.generation != self._held.generation or channel is None or not channel.is_open:
            with self._cond:  # the connection was lost since: receive makes another
                self._held.forget(consumer)
            return
        try:
            channel.basic_qos(prefetch_count=consumer.prefetch)  # for the next consumer
            tag = channel.basic_consume(
                self.queue_name(consumer.queue), functools.partial(self._on_message, consumer)
            )
        except Exception:
            logger.warning("could not consume %s", self.queue_name(consumer.queue), exc_info=True)
            with self._cond:
                self._held.forget(consumer)
            return
        with self._cond:
            consumer.tag = tag

    def _on_cancelled_by_server(self, frame: Any) -> None:  # say, the queue was deleted
        with self._cond:
            for active in self._held.consumers.values():
                for c in [c for c in active if c.tag == frame.method.consumer_tag]:
                    active.remove(c)

    def _on_message(
        self, consumer: Consumer, _channel: Any, method: Any, props: Any, body: bytes
    ) -> None:
        count = delivery_count(props.headers, method.redelivered)
        headers = props.headers or {}
        signature = headers.get(SIGNATURE_HEADER)
        trusted = verify(self._signing_key, consumer.queue, body, signature)
        message = Message(consumer, body, props.content_type, count, method.delivery_tag, trusted)
        if TRACEPARENT in headers:  # a plain publisher's W3C trace context
            message.trace = {k: headers[k] for k in (TRACEPARENT, TRACESTATE) if k in headers}
        with self._cond:
            self._held.delivered(message)

    def _usable(self, message: Message) -> Any:
        channel = self._consume_channel
        if message.consumer.generation != self._held.generation or channel is None:
            return None  # the channel it came on is gone: RabbitMQ redelivers it
        return channel if channel.is_open else None

    def _ack(self, message: Message) -> None:
        channel = self._usable(message)
        if channel is not None:
            channel.basic_ack(message.tag)

    def _requeue(self, messages: list[Message], cancel: list[Consumer]) -> None:
        """Nack with requeue; first cancel the consumers that were full (see ``expire``)."""
        channel = self._consume_channel
        batch = [m for m in messages if self._usable(m) is not None]
        if channel is None or not batch:
            return

        def nack(_frame: Any = None) -> None:
            if channel.is_open:
                for m in batch:
                    channel.basic_nack(m.tag, requeue=True)

        tags = [c.tag for c in cancel if c.tag in channel.consumer_tags]
        for tag in tags:  # cancel-oks come in order: nack after the last
            channel.basic_cancel(tag, callback=nack if tag == tags[-1] else _ignore)
        if not tags:
            nack()


def _ignore(_frame: Any) -> None:
    pass
