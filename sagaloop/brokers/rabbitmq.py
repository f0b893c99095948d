"""RabbitMQ, the production broker (pika's asynchronous ``SelectConnection``).

Topology, declared on connect and again on every reconnect: two durable topic exchanges, the
public one named after the namespace and ``{namespace}.internal``; per queue ``Q`` a durable
queue ``{namespace}.{Q}`` (quorum by default, with a delivery limit) bound with routing key
``Q`` to the internal exchange and, for an engine queue only, to the public one; a fanout
dead-letter exchange ``{namespace}.dlx`` feeding the durable queue ``{namespace}.dead``. So any
AMQP client starts a run by publishing JSON to exchange ``sagaloop`` with routing key
``<app>.engine``, and can reach no step queue; RabbitMQ permissions can fence the internal
exchange (docs/operations.md).

Trust: with ``signing_key``, every message this broker publishes carries a signature header
(HMAC-SHA256 of its queue and body, ``signing.py``), and a delivery is ``trusted`` only when its
signature verifies. Consumers refuse internal messages (step, step result, timer) that are not.

Threads: one I/O thread per broker runs the connection's ioloop and makes every pika call
(pika is not thread-safe); other threads hand it work with ``add_callback_threadsafe``. Steps
never run on it, so heartbeats never starve.

Publishing: a batch is written whole, then its publisher confirms are awaited together (one
round trip per batch, not one per message), with ``mandatory`` so that an unroutable message
fails the batch instead of vanishing.

Consuming: deliveries are buffered from the I/O thread into a local queue that ``receive`` takes
from; consumers are made on demand, sized to what callers ask for (see ``Holdings``). A
handed-out delivery is leased on ``clock``: unacked past its lease it is nacked with requeue, so
RabbitMQ redelivers it and counts it towards the delivery limit, and its stale ack is ignored.
``retry_later`` keeps the message here without telling RabbitMQ. A process that dies loses its
connection, and RabbitMQ redelivers its messages at once.

Several hosts (the nodes of a cluster): ``url`` may list whole URLs separated by commas or
semicolons. The broker connects to the first that answers; when a connection fails or is lost
it goes on to the next host at once, round-robin, and waits a backoff (0.2 s doubling to 3 s)
only after every host of the list failed in turn. Each connection (and loss) is logged with
the host. The quorum queues are replicated on the cluster's nodes, so any node serves them.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop

from sagaloop.brokers import rabbitmq_dead_letters as dead
from sagaloop.brokers._amqp import (
    QUEUE_HEADER,
    REASON_HEADER,
    Call,
    Confirms,
    Consumer,
    Holdings,
    Message,
    PublishRequest,
    Topology,
    broker_urls,
    dead_letters_unavailable,
    delivery_count,
    mask_url,
)
from sagaloop.brokers.dead_letters import DeadLetter
from sagaloop.brokers.signing import SIGNATURE_HEADER, sign, verify
from sagaloop.engine.messages import CONTENT_TYPE, MAX_MESSAGE_BYTES
from sagaloop.engine.ports import Clock, Delivery, SystemClock, Tx
from sagaloop.errors import BrokerAccessRefused, BrokerError, UndeliverableError
from sagaloop.tracing import TRACEPARENT, TRACESTATE

logger = logging.getLogger(__name__)

POLL = 0.05
"""Real seconds between looks at the clock for expired leases and due retries."""
FIRST_BACKOFF, MAX_BACKOFF = 0.2, 3.0  # a broker back from an outage is found within ~3 s

_LOGIN_REFUSED = (pika.exceptions.AuthenticationError, pika.exceptions.ProbableAuthenticationError)
_VHOST_MISSING = re.compile(r"vhost (.*) not found")


def refused_access(error: BaseException | str) -> str | None:
    """What RabbitMQ refused, in a few words, when connecting failed for a reason that waiting
    will not fix: the login (a wrong password or an unknown user: RabbitMQ does not say which),
    a virtual host that does not exist or that the user may not use, a permission the topology
    needs (``ACCESS_REFUSED``). None for anything else (a refused or timed-out connection, a
    server starting or stopping: worth retrying)."""
    text = str(error) if isinstance(error, str) else f"{type(error).__name__}: {error}"
    if isinstance(error, _LOGIN_REFUSED):
        return "the user name or password was refused"
    if isinstance(error, pika.exceptions.ProbableAccessDeniedError) or "NOT_ALLOWED" in text:
        missing = _VHOST_MISSING.search(text)
        if missing:
            return f"the virtual host {missing.group(1).strip(chr(39))!r} does not exist"
        return "the user may not use this virtual host"
    if "ACCESS_REFUSED" in text:
        return "the user lacks a permission (configure, write or read) in this virtual host"
    return None


_Item = tuple[str, str, bytes, Any]  # exchange, routing key, body, pika.BasicProperties


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


class RabbitBroker:
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

    # --- the Broker protocol -----------------------------------------------------------------

    def queue_name(self, queue: str) -> str:
        """The RabbitMQ queue behind sagaloop queue ``queue``."""
        return self.topology.queue(queue)

    @property
    def declared(self) -> list[str]:
        with self._cond:
            return list(self._queues)

    def declare(self, queues: Sequence[str]) -> None:
        names = list(dict.fromkeys(queues))
        self._call(functools.partial(self._declare, names), "declaring")
        with self._cond:  # declared again on every reconnect
            self._queues.update(dict.fromkeys(names))

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """Publish persistent JSON messages and wait for every publisher confirm; raise
        :class:`BrokerError` if one is nacked, unroutable or not confirmed within
        ``confirm_timeout``, or if the connection is down."""
        for queue, body in batch:
            if len(body) > self.max_message_bytes:
                raise UndeliverableError(
                    f"a message of {len(body)} bytes to {queue!r} exceeds max_message_bytes "
                    f"({self.max_message_bytes}): keep large payloads out of messages"
                )
        self._publish(
            [
                (self.topology.internal_exchange, q, body, self._properties(q, body))
                for q, body in batch
            ]
        )

    def _properties(self, queue: str, body: bytes) -> Any:
        headers = None
        if self._signing_key is not None:
            headers = {SIGNATURE_HEADER: sign(self._signing_key, queue, body)}
        return pika.BasicProperties(content_type=CONTENT_TYPE, delivery_mode=2, headers=headers)

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

    def peek_dead_letters(self, limit: int = 1000) -> list[tuple[str, bytes, str]]:
        """Up to ``limit`` dead letters as ``(queue, body, reason)``, oldest first, left in
        place (see :meth:`list_dead_letters`)."""
        return [(d.queue, d.body, d.reason) for d in self.list_dead_letters(limit)]

    # --- dead letters (sagaloop.brokers.dead_letters.DeadLetters; rabbitmq_dead_letters.py) --

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
        count = functools.partial(dead.count, self.topology)
        out: int = self._call(functools.partial(self._with_channel, count), "counting dead letters")
        return out

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        """Publish each to its queue (with its signature, if it had one) and ack it once
        RabbitMQ confirmed the publish (see ``rabbitmq_dead_letters``)."""
        return self._dead_letter_scan("resend", ids, None, "resending").found

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        if ids is not None:
            return self._dead_letter_scan("purge", ids, None, "purging").purged
        purge = functools.partial(dead.purge, self.topology)
        out: int = self._call(functools.partial(self._with_channel, purge), "purging dead letters")
        return out

    def _dead_letter_scan(
        self, mode: dead.Mode, ids: Sequence[str] | None, limit: int | None, what: str
    ) -> dead.Scan:
        scan = dead.Scan(self.topology, mode, ids, limit)
        out: dead.Scan = self._call(
            functools.partial(self._with_channel, scan), f"{what} the dead letters"
        )
        return out

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed, self._ready = True, False
            self._cond.notify_all()
        self._ioloop.add_callback_threadsafe(self._shutdown)
        self._thread.join(10.0)
        if self._thread.is_alive():
            logger.warning("the AMQP I/O thread of %s did not stop in time", self.safe_url)
        else:
            self._ioloop.close()

    # --- other threads -----------------------------------------------------------------------

    def _submit(self, fn: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            fn()
        elif not self._closed:
            self._ioloop.add_callback_threadsafe(fn)

    def _call(self, fn: Callable[[Call], None], what: str) -> Any:
        with self._cond:
            if not self._ready:
                state = "the broker is closed" if self._closed else "not connected"
                raise BrokerError(f"{what}: {state} (RabbitMQ at {self.safe_url})")
        call = Call()
        self._submit(functools.partial(fn, call))
        if not call.wait(self.confirm_timeout):
            raise BrokerError(f"{what}: RabbitMQ did not answer within {self.confirm_timeout} s")
        if call.error is not None:
            raise BrokerError(f"{what}: {call.error}")
        return call.value

    def _publish(self, items: list[_Item]) -> None:
        if not items:
            return
        with self._cond:
            if not self._ready:
                state = "the broker is closed" if self._closed else "not connected"
                raise BrokerError(f"cannot publish: {state} ({self.safe_url}: {self._last_error})")
        request = PublishRequest(len(items))
        self._submit(functools.partial(self._publish_now, request, items))
        if not request.wait(self.confirm_timeout):
            self._submit(functools.partial(self._abandon, request))
            raise BrokerError(
                f"RabbitMQ did not confirm {request.outstanding} of {len(items)} messages "
                f"within {self.confirm_timeout} s"
            )
        if request.error is not None:
            raise BrokerError(request.error)
        if request.problems:
            unroutable = all(p.startswith("unroutable") for p in request.problems)
            raise (UndeliverableError if unroutable else BrokerError)(
                f"{len(request.problems)} of {len(items)} messages were not accepted: "
                f"{request.problems[0]}"
            )

    def _hand_out(self, message: Message) -> Delivery:
        delivery = RabbitDelivery(self, message)
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

    def _dead_letter(self, delivery: RabbitDelivery, reason: str) -> None:
        message, queue = delivery._message, delivery.queue
        if not self._release(delivery):
            logger.info("not dead-lettering a message of %s: its lease was lost", queue)
            return
        headers = {
            REASON_HEADER: reason[:4000],
            QUEUE_HEADER: queue,
            dead.DEAD_LETTER_ID_HEADER: dead.new_dead_letter_id(),
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

    # --- the I/O thread ----------------------------------------------------------------------

    def _run(self) -> None:
        self._ioloop.add_callback_threadsafe(self._connect)
        self._ioloop.call_later(POLL, self._tick)
        self._ioloop.start()

    def _tick(self) -> None:
        if not self._closing:
            with self._cond:
                self._housekeep()
            self._ioloop.call_later(POLL, self._tick)

    @property
    def host_url(self) -> str:
        """The host (masked URL) connected to, or tried next."""
        return self._hosts[self._host][0]

    def _connect(self) -> None:
        if self._closing:
            return
        try:
            self._connection = pika.SelectConnection(
                self._hosts[self._host][1],
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
                custom_ioloop=self._ioloop,
            )
        except Exception as e:
            self._retry(repr(e))

    def _retry(self, error: str) -> None:
        """Try the next host: at once, or after a backoff once every host failed in turn."""
        failed = self.host_url
        with self._cond:
            self._last_error = self._last_error if self._topology_error else f"{failed}: {error}"
        if self._closing:
            self._ioloop.stop()
            return
        self._host = (self._host + 1) % len(self._hosts)
        self._failures += 1
        delay = 0.0
        if self._failures % len(self._hosts) == 0:  # a whole round failed
            delay, self._backoff = self._backoff, min(self._backoff * 2, MAX_BACKOFF)
        logger.debug(
            "connecting to %s failed (%s); trying %s in %.1f s", failed, error, self.host_url, delay
        )
        self._ioloop.call_later(delay, self._connect)

    def _on_open_error(self, connection: Any, error: BaseException) -> None:
        self._connection = None
        refusal = refused_access(error)
        if refusal is not None:
            with self._cond:
                self._refused, self._refusal = True, refusal
                self._cond.notify_all()
        self._retry(str(error) or repr(error))

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

    def _on_topology(self, call: Call) -> None:
        if call.error is not None:
            if call.error != self._topology_error:  # once, not on every try
                logger.error("declaring the topology on %s failed: %s", self.host_url, call.error)
            self._topology_error = call.error
            with self._cond:  # a constructor waiting for the first connection gives up
                self._last_error = f"declaring the topology failed: {call.error}"
                self._refused = True
                self._refusal = refused_access(call.error)
                self._cond.notify_all()
            if self._connection is not None and self._connection.is_open:
                self._connection.close()  # and try again after a backoff
            return
        self._backoff, self._topology_error, self._failures = FIRST_BACKOFF, "", 0
        if self._lost:
            self._lost = False
            logger.warning("reconnected to RabbitMQ at %s", self.host_url)
        elif len(self._hosts) > 1:
            logger.info("connected to RabbitMQ at %s", self.host_url)
        with self._cond:
            self._ready = True
            self._last_error = ""
            self._cond.notify_all()  # waiting receive calls make their consumers again

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        connection = self._connection
        if self._closing or connection is None or not connection.is_open:
            return  # the connection is going: _on_closed cleans up
        logger.warning("a channel to %s closed (%s); reconnecting", self.host_url, reason)
        connection.close()

    def _on_closed(self, connection: Any, reason: BaseException) -> None:
        self._connection = self._publish_channel = self._consume_channel = None
        self._confirms.fail_all(f"the connection to RabbitMQ was lost before confirms: {reason}")
        with self._cond:
            was_ready, self._ready = self._ready, False
            self._held.reset()
        if self._closing:
            self._ioloop.stop()
            return
        if was_ready:
            self._lost = True
            logger.warning(
                "lost the connection to RabbitMQ at %s (%s); reconnecting%s",
                self.host_url,
                reason,
                f" to {self._hosts[(self._host + 1) % len(self._hosts)][0]}"
                if len(self._hosts) > 1
                else "",
            )
        self._retry(str(reason) or repr(reason))

    def _shutdown(self) -> None:
        self._closing = True
        self._ioloop.call_later(5.0, self._ioloop.stop)  # in case the close handshake hangs
        connection = self._connection
        if connection is not None and not (connection.is_closed or connection.is_closing):
            try:
                connection.close()
                return
            except Exception:
                logger.debug("closing the AMQP connection failed", exc_info=True)
        if connection is None or connection.is_closed:
            self._ioloop.stop()

    def _declare(self, queues: list[str], call: Call) -> None:
        """The topology, each part on a channel of its own: the exchanges and ``queues``, then
        the dead-letter queue. The latter lives on one node of a cluster: while that node is
        down, the rest is served (and dead-lettering waits, see ``_dead_letter``)."""

        def dead_letters_declared(declared: Call) -> None:
            if declared.error is None:
                self._dead_letters_down = False
                call.resolve()
            elif dead_letters_unavailable(declared.error):
                if not self._dead_letters_down:  # once, not on every declaration
                    logger.warning(
                        "the dead-letter queue %s is unavailable (%s): the node it lives on is "
                        "down; serving the other queues, dead-lettering waits for it",
                        self.topology.dead_letter_queue,
                        declared.error,
                    )
                self._dead_letters_down = True
                call.resolve()
            else:
                call.fail(declared.error)

        def queues_declared(declared: Call) -> None:
            if declared.error is not None:
                call.fail(declared.error)
            else:
                after = Call(then=dead_letters_declared)
                self._with_channel(self.topology.declare_dead_letters, after)

        self._with_channel(functools.partial(self.topology.declare, queues), Call(queues_declared))

    def _with_channel(self, use: Callable[[Any, Call], None], call: Call) -> None:
        """Run ``use`` on a channel of its own, which it closes when done: a refused
        declaration closes its channel and must not take the others with it."""
        connection = self._connection
        if connection is None or not connection.is_open:
            call.fail(f"not connected to RabbitMQ at {self.host_url}")
            return

        def closed(_channel: Any, reason: BaseException) -> None:
            call.fail(str(reason) or repr(reason))

        channel = connection.channel(on_open_callback=lambda ch: use(ch, call))
        channel.add_on_close_callback(closed)

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
