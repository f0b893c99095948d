"""The connection to RabbitMQ: the I/O thread, the hosts, reconnecting, and declaring the
topology (part of :class:`~sagaloop.brokers.rabbitmq.RabbitBroker`; the other parts are
``publishing``, ``consuming`` and ``dead_letters``).

Topology, declared on connect and again on every reconnect: two durable topic exchanges, the
public one named after the namespace and ``{namespace}.internal``; per queue ``Q`` a durable
queue ``{namespace}.{Q}`` (quorum by default, with a delivery limit) bound with routing key
``Q`` to the internal exchange and, for an engine queue only, to the public one; a fanout
dead-letter exchange ``{namespace}.dlx`` feeding the durable queue ``{namespace}.dead``. Each
part is declared on a channel of its own, so a refused declaration takes no other with it.

Threads: one I/O thread per broker runs the connection's ioloop and makes every pika call
(pika is not thread-safe); other threads hand it work with ``add_callback_threadsafe``
(``_submit``, or ``_call`` to wait for the answer). Steps never run on it, so heartbeats never
starve.

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
from collections.abc import Callable, Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop

from sagaloop.brokers._amqp import Call, Confirms, Holdings, Topology, dead_letters_unavailable
from sagaloop.engine.ports import Clock
from sagaloop.errors import BrokerError

logger = logging.getLogger(__name__)

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


class Link:
    """The connection part of ``RabbitBroker``. Its constructor sets the state declared here,
    which the other parts (publishing, consuming, dead letters) share."""

    safe_url: str  # for logs and errors: the passwords masked
    topology: Topology
    prefetch: int
    confirm_timeout: float
    lease: float
    clock: Clock
    max_message_bytes: int
    _signing_key: bytes | None
    _hosts: list[tuple[str, pika.URLParameters]]  # (masked URL, parameters)

    # Shared with the I/O thread, guarded by _cond.
    _held: Holdings
    _cond: threading.Condition
    _ready: bool
    _closed: bool
    _last_error: str
    _refused: bool  # the server refused the credentials: no use waiting
    _refusal: str | None  # what it refused (see refused_access)
    _queues: dict[str, None]  # declared so far (an ordered set)
    _todo: list[Callable[[], None]]  # handed to the I/O thread, not yet taken (see _submit)
    _todo_lock: threading.Lock

    # Touched by the I/O thread only.
    _connection: Any
    _publish_channel: Any
    _consume_channel: Any
    _confirms: Confirms
    _backoff: float
    _host: int  # index in _hosts of the host connected to, or tried next
    _failures: int  # hosts that failed in a row since the last connection
    _dead_letters_down: bool  # the dead-letter queue's node was down when declared
    _lost: bool
    _closing: bool
    _topology_error: str
    _ioloop: IOLoop
    _thread: threading.Thread

    def _on_open(self, connection: Any) -> None:
        """Open the channels and declare the topology (``RabbitBroker``: it wires the parts)."""
        raise NotImplementedError

    # --- the Broker protocol -----------------------------------------------------------------

    def queue_name(self, queue: str) -> str:
        """The RabbitMQ queue behind sagaloop queue ``queue``."""
        return self.topology.queue(queue)

    def queue_depth(self, queue: str) -> int | None:
        """How many messages sagaloop queue ``queue`` holds ready (a passive declare, all that
        AMQP tells: those delivered and not yet acked are not counted, and the age of the
        oldest is not known without the management plugin); None when RabbitMQ has no such
        queue. Raises :class:`BrokerError` when RabbitMQ cannot be asked."""
        name = self.queue_name(queue)

        def ask(channel: Any, call: Call) -> None:
            def counted(frame: Any) -> None:
                call.resolve(frame.method.message_count)
                channel.close()

            channel.queue_declare(name, passive=True, callback=counted)

        try:
            depth: int = self._call(
                functools.partial(self._with_channel, ask), f"counting queue {name}"
            )
        except BrokerError as e:
            if "NOT_FOUND" in str(e):
                return None
            raise
        return depth

    @property
    def declared(self) -> list[str]:
        with self._cond:
            return list(self._queues)

    def declare(self, queues: Sequence[str]) -> None:
        names = list(dict.fromkeys(queues))
        self._call(functools.partial(self._declare, names), "declaring")
        with self._cond:  # declared again on every reconnect
            self._queues.update(dict.fromkeys(names))

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
        """Run ``fn`` on the I/O thread, in order. Work handed over while the I/O thread has
        not yet taken the earlier work goes with it: one wake-up (a write to the ioloop's
        socket, a turn of its poller) for, say, a batch's acks and the publish of its commit,
        not one each."""
        if threading.current_thread() is self._thread:
            fn()
        elif not self._closed:
            with self._todo_lock:
                self._todo.append(fn)
                if len(self._todo) > 1:
                    return  # the I/O thread is woken for the first already
            self._ioloop.add_callback_threadsafe(self._do_todo)

    def _do_todo(self) -> None:
        with self._todo_lock:
            todo, self._todo = self._todo, []
        for fn in todo:
            fn()

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

    # --- the I/O thread ----------------------------------------------------------------------

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
