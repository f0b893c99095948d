"""What the engine needs from a broker: the queues messages travel on (:class:`Broker`, each
message received as a :class:`Delivery`) and the live channel a running step streams on
(:class:`Streams`). Re-exported by :mod:`sagaloop.engine.ports` beside the store's ports."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sagaloop.engine.ports import Tx


# --- the live channel -------------------------------------------------------------------------
# What a step streams while it runs (an agent's model tokens, a long step's progress), for readers
# that follow the run (``Client.stream``, ``sagaloop tail``): best effort and never recorded; a
# reader that is not listening misses live items, the durable result is what the history holds.
# Adapters: ``sagaloop.brokers.local_streams`` (in-process) and ``sagaloop.brokers.streams``
# (RabbitMQ).


class Subscription(Protocol):
    def get(self, timeout: float) -> list[Any]:
        """The items published since the last call, waiting up to ``timeout`` for a first."""

    def close(self) -> None: ...


class Streams(Protocol):
    def publish(self, run_id: str, item: Any) -> None:
        """Send ``item`` (JSON) to the readers of ``run_id``; never raises (logs instead), and
        may return before the item has gone."""

    def flush(self, timeout: float) -> bool:
        """Wait until what was published has gone; False if ``timeout`` seconds passed first."""

    def subscribe(self, run_id: str) -> Subscription: ...

    def close(self) -> None: ...


# --- the broker port ---------------------------------------------------------------------------


class Delivery(Protocol):
    """One received message. Settle it inside the transaction that processed it, then ack it
    after the commit; or hand it back, or dead-letter it."""

    body: bytes
    content_type: str | None
    deliveries: int
    """1 on the first delivery; more means an earlier consumer may have processed it."""
    trusted: bool
    """Whether sagaloop's own processes sent it (a verified signature, or a row its store
    wrote): only then may it be an internal message (step, step result, timer)."""

    def settle(self, tx: Tx) -> None: ...
    def ack(self) -> None: ...
    def retry_later(self, delay: timedelta) -> None: ...
    def dead_letter(self, reason: str) -> None: ...
    def extend(self) -> bool:
        """Renew the lease while a long step runs; False if it was already lost."""
        ...


class Broker(Protocol):
    uses_outbox: bool
    """True when the outbox table itself is the queue (no relay needed)."""

    def declare(self, queues: Sequence[str]) -> None: ...
    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """Send ``(queue, body)`` pairs and wait until the broker confirmed every one."""
        ...

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds for the first."""
        ...

    def close(self) -> None: ...
