"""The per-run live channel on RabbitMQ: a non-durable direct exchange ``<namespace>.stream``
keyed by run id. A reader binds an exclusive, auto-deleted queue to its run's key, named inside
the namespace (``<namespace>.stream.<random>``, which the documented permissions of the
namespace allow; a server-named ``amq.gen-...`` queue they refuse); nothing is kept for a
reader that is not there (the history holds what is durable).

Anyone allowed to publish to that exchange can put items in front of readers: they are shown,
never recorded or trusted (docs/operations.md has the permissions).

The URL may list several hosts (the nodes of a cluster, separated by commas): a connection goes
to the first that answers; the publisher's next connection (after a loss) tries the hosts after
that one first."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
import uuid
from typing import Any

import pika
import pika.exceptions

from sagaloop._secrets import mask_url
from sagaloop.brokers._amqp import broker_urls, check_namespace
from sagaloop.engine.ports import Subscription
from sagaloop.errors import BrokerError

logger = logging.getLogger(__name__)


def _parameters(url: str) -> list[pika.URLParameters]:
    return [pika.URLParameters(one) for one in broker_urls(url)]


def _after(hosts: list[pika.URLParameters], connection: Any) -> list[pika.URLParameters]:
    """``hosts`` turned so that the one ``connection`` went to comes last (round-robin: after
    a loss, the others are tried first)."""
    used = getattr(getattr(connection, "_impl", None), "params", None)
    at = next((i for i, h in enumerate(hosts) if h is used or h == used), None)
    return hosts if at is None else hosts[at + 1 :] + hosts[: at + 1]


class _RabbitSubscription:
    """A reader of one run's items: the server pushes them (``basic_consume`` on the reader's
    queue) and ``get`` takes them in on the connection's own thread (pika's blocking connection
    is not thread-safe), so an item that arrives while ``get`` waits is returned at once, not at
    the next poll. Items are JSON; one that is not is dropped with a warning."""

    def __init__(
        self, hosts: list[pika.URLParameters], exchange: str, run_id: str, where: str
    ) -> None:
        self._connection: Any = None
        self._items: list[Any] = []
        try:
            self._connection = pika.BlockingConnection(hosts)  # the first that answers
            self._channel = self._connection.channel()
            self._channel.exchange_declare(exchange, "direct", durable=False)
            self._queue = f"{exchange}.{uuid.uuid4().hex}"  # inside the namespace
            self._channel.queue_declare(self._queue, exclusive=True, auto_delete=True)
            self._channel.queue_bind(self._queue, exchange, routing_key=run_id)
            self._channel.basic_consume(self._queue, self._arrived, auto_ack=True)
        except pika.exceptions.AMQPError as e:
            self.close()
            raise BrokerError(
                f"cannot follow the live items of run {run_id!r} on RabbitMQ at {where}: "
                f"{_reason(e)} (the user needs the permissions of docs/operations.md)"
            ) from e

    def _arrived(self, _channel: Any, _method: Any, _props: Any, body: bytes) -> None:
        try:
            self._items.append(json.loads(body))
        except ValueError:
            logger.warning("dropped a stream item that is not JSON")

    def get(self, timeout: float) -> list[Any]:
        """What arrived since the last call; if nothing has, waits up to ``timeout`` and returns
        as soon as the first item is pushed (or ``[]`` at the deadline). A lost connection
        raises pika's AMQPError, as before."""
        deadline = time.monotonic() + timeout
        self._connection.process_data_events(time_limit=0)  # what the socket already holds
        while not self._items:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # returns early once a delivery is ready for dispatch (then ``_arrived`` has run)
            self._connection.process_data_events(time_limit=left)
        out, self._items = self._items, []
        return out

    def close(self) -> None:
        if self._connection is not None and self._connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                self._connection.close()


def _reason(e: Exception) -> str:
    """A pika error in one line: its class, and what the server said (if it said anything)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__


class RabbitStreams:
    """Publishes from any thread without waiting for RabbitMQ: ``publish`` queues the item and
    returns, and one thread of its own sends the items in order over one connection of its own
    (opened at the first item, reopened after a loss). A blocking publish cost the step's thread
    a few hundred microseconds per item (pika's work, on a core that had gone cold between two
    tokens), about 3 ms per streamed model response. An item that cannot be sent, or that finds
    ``max_pending`` items still waiting (RabbitMQ away or slow), is dropped with a warning: the
    channel is best effort, its readers get the durable result from the history. ``flush``
    waits until what was published has gone (a step's attempt flushes before its reply is
    stored, so its items reach readers before the run can finish); ``close`` flushes too."""

    def __init__(self, url: str, *, namespace: str = "sagaloop", max_pending: int = 10_000) -> None:
        self._exchange = f"{check_namespace(namespace)}.stream"
        self._hosts = _parameters(url)
        self._where = mask_url(url)
        self._max_pending = max_pending
        self._lock = threading.Lock()  # the pending items, the thread's state
        self._ready = threading.Condition(self._lock)  # an item to send, or closed
        self._sent = threading.Condition(self._lock)  # nothing pending: flush returns
        self._pending: collections.deque[tuple[str, bytes]] = collections.deque()
        self._sending = 0  # items taken by the thread and not sent yet
        self._full = False  # dropping for lack of room (warned once per spell)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._connection: Any = None  # the thread's
        self._channel: Any = None

    def publish(self, run_id: str, item: Any) -> None:
        body = json.dumps(item, separators=(",", ":"), default=str).encode()
        with self._lock:
            if self._closed:
                logger.warning("stream item of run %s dropped: the channel is closed", run_id)
                return
            if len(self._pending) >= self._max_pending:
                if not self._full:
                    self._full = True
                    logger.warning(
                        "stream items dropped: %d wait for RabbitMQ at %s already",
                        len(self._pending),
                        self._where,
                    )
                return
            self._pending.append((run_id, body))
            if self._thread is None or not self._thread.is_alive():  # first, or after a fork
                self._thread = threading.Thread(target=self._run, name="streams", daemon=True)
                self._thread.start()
            self._ready.notify()

    def flush(self, timeout: float) -> bool:
        """Wait until every item published so far was sent (or dropped); False if ``timeout``
        seconds passed first."""
        with self._lock:
            return self._sent.wait_for(lambda: not self._pending and not self._sending, timeout)

    def subscribe(self, run_id: str) -> Subscription:
        return _RabbitSubscription(self._hosts, self._exchange, run_id, self._where)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._ready.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    break  # closed, and all sent
                batch, self._sending = list(self._pending), len(self._pending)
                self._pending.clear()
            try:
                for run_id, body in batch:
                    self._send(run_id, body)
            finally:  # whatever happened, flush must not wait for these
                with self._lock:
                    self._sending = 0
                    self._full = self._full and bool(self._pending)
                    self._sent.notify_all()
        self._drop()

    def _send(self, run_id: str, body: bytes) -> None:
        for attempt in (1, 2):
            try:
                if self._channel is None:
                    self._connection = pika.BlockingConnection(self._hosts)
                    self._hosts = _after(self._hosts, self._connection)
                    self._channel = self._connection.channel()
                    self._channel.exchange_declare(self._exchange, "direct", durable=False)
                self._channel.basic_publish(self._exchange, run_id, body)
                return
            except Exception as e:  # pika's, AMQPConnectorStackTimeout (no AMQPError) too
                self._drop()
                if attempt == 2:
                    logger.warning("stream item of run %s dropped: %s", run_id, _reason(e))

    def _drop(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # it is lost already
                connection.close()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending (for at most ``timeout`` seconds), then close the connection;
        items published after are dropped."""
        with self._lock:
            self._closed = True
            self._ready.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)  # it closes its connection once all went
            if thread.is_alive():
                logger.warning(
                    "stream items not sent to RabbitMQ at %s in %g s", self._where, timeout
                )
