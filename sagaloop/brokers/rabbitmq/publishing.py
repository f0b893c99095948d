"""Publishing to RabbitMQ (part of :class:`~sagaloop.brokers.rabbitmq.RabbitBroker`).

Publishing: a batch is written whole, then its publisher confirms are awaited together (one
round trip per batch, not one per message), with ``mandatory`` so that an unroutable message
fails the batch instead of vanishing. Messages are persistent JSON; a body over
``max_message_bytes`` is refused before anything is written.

Trust: with ``signing_key``, every message this broker publishes carries a signature header
(HMAC-SHA256 of its queue and body, ``signing.py``).

Traces: a message with a trace context carries it in the W3C header ``traceparent`` too: the
publishing span's (the relay's ``sagaloop.relay.publish``) when it is of the message's trace,
else the message's own (``tracing.amqp_headers``).

Threads: ``publish`` runs on the caller's thread and waits; the writes, the confirms and the
returns happen on the I/O thread (``link.py``). ``publish_later`` waits for nothing: what it is
told of the confirms it is told on the I/O thread, so the thread that committed outbox rows
sends them without a hop through the relay's thread (``runtime/relay.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import pika

from sagaloop import tracing
from sagaloop.brokers._amqp import PublishRequest
from sagaloop.brokers.rabbitmq.link import Link
from sagaloop.brokers.signing import SIGNATURE_HEADER, sign
from sagaloop.engine.messages import CONTENT_TYPE
from sagaloop.errors import BrokerError, UndeliverableError

_Item = tuple[str, str, bytes, Any]  # exchange, routing key, body, pika.BasicProperties


class Publishing(Link):
    """Publishing with confirms: the part of ``RabbitBroker`` that writes messages."""

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """Publish persistent JSON messages and wait for every publisher confirm; raise
        :class:`BrokerError` if one is nacked, unroutable or not confirmed within
        ``confirm_timeout``, or if the connection is down."""
        self._publish(self._items(batch))

    def _publish(self, items: list[_Item]) -> None:
        if not items:
            return
        self._check_ready()
        request = PublishRequest(len(items))
        self._submit(functools.partial(self._publish_now, request, items))
        if not request.wait(self.confirm_timeout):
            self._submit(functools.partial(self._abandon, request))
            raise BrokerError(
                f"RabbitMQ did not confirm {request.outstanding} of {len(items)} messages "
                f"within {self.confirm_timeout} s"
            )
        error = _failure(request, len(items))
        if error is not None:
            raise error

    def publish_later(
        self,
        batch: Sequence[tuple[str, bytes]],
        then: Callable[[BrokerError | None], None],
    ) -> None:
        """Publish as :meth:`publish` does, without waiting: ``then`` is called on the I/O
        thread, with None once every message is confirmed, else with the error that
        :meth:`publish` would raise. Raises at once what :meth:`publish` raises before writing
        anything (a message too large, the broker not connected). No confirm timeout: a lost
        connection fails the batch (heartbeats find a silent one), and the caller's outbox rows
        are published again by a sweep once their claim runs out."""
        items = self._items(batch)
        if not items:
            then(None)
            return
        self._check_ready()
        size = len(items)
        request = PublishRequest(size, then=lambda done: then(_failure(done, size)))
        self._submit(functools.partial(self._publish_now, request, items))

    def _check_ready(self) -> None:
        with self._cond:
            if not self._ready:
                state = "the broker is closed" if self._closed else "not connected"
                raise BrokerError(f"cannot publish: {state} ({self.safe_url}: {self._last_error})")

    def _items(self, batch: Sequence[tuple[str, bytes]]) -> list[_Item]:
        """The batch ready to write; raises if a message is too large."""
        for queue, body in batch:
            if len(body) > self.max_message_bytes:
                raise UndeliverableError(
                    f"a message of {len(body)} bytes to {queue!r} exceeds max_message_bytes "
                    f"({self.max_message_bytes}): keep large payloads out of messages"
                )
        here = tracing.current()  # the relay's span sagaloop.relay.publish, when tracing
        exchange = self.topology.internal_exchange
        return [(exchange, q, body, self._properties(q, body, here)) for q, body in batch]

    def _properties(self, queue: str, body: bytes, here: tracing.Carrier | None) -> Any:
        headers: dict[str, str] = {}
        if self._signing_key is not None:
            headers[SIGNATURE_HEADER] = sign(self._signing_key, queue, body)
        headers.update(tracing.amqp_headers(body, here) or {})
        return pika.BasicProperties(
            content_type=CONTENT_TYPE, delivery_mode=2, headers=headers or None
        )

    # --- the I/O thread ----------------------------------------------------------------------

    def _publish_now(self, request: PublishRequest, items: list[_Item]) -> None:
        channel = self._publish_channel
        if channel is None or not channel.is_open:
            request.fail(f"cannot publish: not connected to RabbitMQ at {self.host_url}")
            return
        try:
            for exchange, key, body, props in items:
                channel.basic_publish(exchange, key, body, props, mandatory=True)
                self._confirms.published(request, key)
        except Exception as e:
            self._confirms.abandon(request)
            request.fail(f"publishing failed: {e!r}")

    def _abandon(self, request: PublishRequest) -> None:
        self._confirms.abandon(request)

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        ack = isinstance(method, pika.spec.Basic.Ack)
        self._confirms.confirmed(method.delivery_tag, method.multiple, ack)

    def _on_return(self, _channel: Any, method: Any, _props: Any, _body: bytes) -> None:
        self._confirms.returned(method.routing_key)


def _failure(request: PublishRequest, size: int) -> BrokerError | None:
    """What a finished ``request`` of ``size`` messages failed with (None: all confirmed)."""
    if request.error is not None:
        return BrokerError(request.error)
    if request.problems:
        unroutable = all(p.startswith("unroutable") for p in request.problems)
        return (UndeliverableError if unroutable else BrokerError)(
            f"{len(request.problems)} of {size} messages were not accepted: {request.problems[0]}"
        )
    return None
