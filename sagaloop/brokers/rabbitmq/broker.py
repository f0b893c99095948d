"""``RabbitBroker``: the parts of ``link.py`` (connection, I/O thread, hosts, topology),
``publishing.py``, ``consuming.py`` and ``dead_letters.py`` put together, with the
constructor that connects and the wiring of a new connection's channels.

On every (re)connection, in this order: a publishing channel in confirm mode, then a consuming
channel, then the topology; only then is the broker ready and do waiting ``receive`` calls make
their consumers again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import pika
from pika.adapters.select_connection import IOLoop

from sagaloop.brokers._amqp import Call, Confirms, Holdings, Topology, broker_urls, mask_url
from sagaloop.brokers.rabbitmq.consuming import POLL
from sagaloop.brokers.rabbitmq.dead_letters import DeadLetters
from sagaloop.brokers.rabbitmq.link import FIRST_BACKOFF
from sagaloop.engine.messages import MAX_MESSAGE_BYTES
from sagaloop.engine.ports import Clock, SystemClock
from sagaloop.errors import BrokerAccessRefused, BrokerError


class RabbitBroker(DeadLetters):
    """The broker on a RabbitMQ server (``url``: ``amqp://user:password@host:port/vhost``, or
    several such URLs separated by commas: the nodes of a cluster, tried in turn).

    ``namespace`` names the exchange and prefixes the queues; ``queue_type`` is ``quorum``
    (durable and replicated, with ``delivery_limit``: a message delivered more often goes to the
    dead letters) or ``classic``; ``prefetch`` is the most messages of one queue that this
    broker holds unsettled at once (handed out, waiting to retry, or buffered); ``lease``, on
    ``clock``, is how long a delivery may stay unacked; ``confirm_timeout`` bounds every wait
    for the server (connecting, declaring, publisher confirms). The constructor connects and
    raises :class:`BrokerError` when it cannot; later losses are reconnected in the background.
    ``signing_key`` (``SqlStore.signing_key()``) signs what it publishes and verifies what it
    receives; without it nothing it receives is trusted.
    """

    uses_outbox = False

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "sagaloop",
        queue_type: Literal["quorum", "classic"] = "quorum",
        delivery_limit: int = 20,
        prefetch: int = 16,
        confirm_timeout: timedelta = timedelta(seconds=30),
        lease: timedelta = timedelta(seconds=60),
        clock: Clock | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        connection_name: str = "sagaloop",
        connect_timeout: timedelta | None = None,
        signing_key: bytes | None = None,
    ) -> None:
        if queue_type not in ("quorum", "classic"):
            raise ValueError(f"queue_type must be 'quorum' or 'classic', not {queue_type!r}")
        self.safe_url = mask_url(url)  # for logs and errors: the passwords masked
        self.topology = Topology(namespace, queue_type, delivery_limit)
        self.prefetch = max(1, prefetch)
        self.confirm_timeout = confirm_timeout.total_seconds()
        self.lease = lease.total_seconds()
        self.clock = clock or SystemClock()
        self.max_message_bytes = max_message_bytes
        self._signing_key = signing_key
        self._hosts: list[tuple[str, pika.URLParameters]] = []  # (masked URL, parameters)
        for one in broker_urls(url):
            params = pika.URLParameters(one)
            params.client_properties = {"connection_name": connection_name}
            self._hosts.append((mask_url(one), params))

        # Shared with the I/O thread, guarded by _cond.
        self._held = Holdings(self.clock, self.lease, self.prefetch)
        self._cond = self._held.cond
        self._ready = False
        self._closed = False
        self._last_error = "not connected yet"
        self._refused = False  # the server refused the credentials: no use waiting
        self._refusal: str | None = None  # what it refused (see refused_access)
        self._queues: dict[str, None] = {}  # declared so far (an ordered set)
        self._todo: list[Callable[[], None]] = []  # for the I/O thread (see _submit)
        self._todo_lock = threading.Lock()

        # Touched by the I/O thread only.
        self._connection: Any = None
        self._publish_channel: Any = None
        self._consume_channel: Any = None
        self._confirms = Confirms()
        self._backoff = FIRST_BACKOFF
        self._host = 0  # index in _hosts of the host connected to, or tried next
        self._failures = 0  # hosts that failed in a row since the last connection
        self._dead_letters_down = False  # the dead-letter queue's node was down when declared
        self._lost = False
        self._closing = False
        self._topology_error = ""

        self._ioloop = IOLoop()
        self._thread = threading.Thread(target=self._run, name=f"amqp-{namespace}", daemon=True)
        self._thread.start()
        with self._cond:
            connect_wait = connect_timeout.total_seconds() if connect_timeout else None
            self._cond.wait_for(
                lambda: self._ready or self._refused, connect_wait or self.confirm_timeout
            )
            ready, error, refusal = self._ready, self._last_error, self._refusal
        if not ready:
            self.close()
            if refusal is not None:
                raise BrokerAccessRefused(
                    f"cannot connect to RabbitMQ at {self.safe_url}: {refusal} ({error})",
                    reason=refusal,
                    where=self.safe_url,
                )
            raise BrokerError(
                f"cannot connect to RabbitMQ at {self.safe_url} ({error}): is the server running "
                "and the URL (user, password, vhost) right?"
            )

    # --- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        self._ioloop.add_callback_threadsafe(self._connect)
        self._ioloop.call_later(POLL, self._tick)
        self._ioloop.start()

    def _on_open(self, connection: Any) -> None:
        def consume_channel_open(channel: Any) -> None:
            self._consume_channel = channel
            channel.add_on_cancel_callback(self._on_cancelled_by_server)
            with self._cond:
                queues = list(self._queues)
            self._declare(queues, Call(then=self._on_topology))

        def confirming(_frame: Any) -> None:
            channel = connection.channel(on_open_callback=consume_channel_open)
            channel.add_on_close_callback(self._on_channel_closed)

        def publish_channel_open(channel: Any) -> None:
            self._publish_channel = channel
            self._confirms = Confirms()
            channel.add_on_return_callback(self._on_return)
            channel.confirm_delivery(self._on_confirm, callback=confirming)

        channel = connection.channel(on_open_callback=publish_channel_open)
        channel.add_on_close_callback(self._on_channel_closed)
