"""Redis through kombu: sagaloop's queues are kombu's Redis queues (``redis://``, ``rediss://``).

What kombu does here: it parses the URL and makes the connection pool (TLS, user, password,
database number), publishes (:class:`kombu.Producer` writes kombu's JSON message, the body
base64-encoded, with ``LPUSH`` onto the list ``{namespace}.{queue}``, a batch in one pipeline),
and decodes what it wrote. So any kombu client can start a run by publishing a JSON start
message with routing key ``{namespace}.{app}.engine`` to the default exchange.

What it does not, and why the consuming side is four Lua scripts of ours, run with kombu's own
Redis client over kombu's lists: kombu's Redis consumer pops a message (``BRPOP``/``RPOP``) and
records it as unacknowledged in a *second* round trip, so a process killed, or a connection
lost, between the two loses the message (a ``BRPOP`` reply still in the socket is lost the same
way); a redelivered message keeps its delivery tag, so a late ack of an earlier holder deletes
the new holder's claim; it keeps no delivery count (a ``redelivered`` flag only); and its
visibility timeout is measured on the wall clock at a sweep every few seconds. Here one script
pops a message *and* records the claim (a new claim id, a lease on ``clock``, the delivery count)
atomically; acks, renewals and dead-lettering act only on a claim id still held, so a stale one
changes nothing; and every claim first puts back what is due: leases that ran out (their holder
died or hung) and messages whose ``retry_later`` delay passed, at the head of their queue. So a
SIGKILLed consumer's messages come back one lease after their last renewal, as soon as any
consumer of the namespace asks for messages. Leases are compared across processes: keep the
hosts' clocks in sync.

Keys, per namespace ``ns``: the lists ``ns.<queue>`` (and kombu's priority lists beside them:
priority 0, sagaloop's, is read first, as kombu does); ``ns:held`` (claim id: the list and the
message), ``ns:until`` (claim id: when it goes back), ``ns:deliveries`` (SHA-1 of the message:
how many times it was claimed), ``ns:seq``; dead letters in ``ns:dead`` and ``ns:dead-ids``.

Trust: with ``signing_key`` every message published carries a signature header (``signing.py``);
a delivery is ``trusted`` only when it verifies for its queue. An item on a list that is not a
kombu message is delivered as a bare body, untrusted, without a content type.

Traces: a message published with a trace context carries it in the headers ``traceparent``
(and ``tracestate``) too: the relay's span when of the message's trace, else the message's own
(``tracing.amqp_headers``); ``publish_raw`` sets none, as a plain kombu client.

Durability is Redis's: see docs/guarantees.md for the persistence settings it needs.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import kombu

from sagaloop import tracing
from sagaloop._secrets import mask_url
from sagaloop.brokers._redis_scripts import ACK, BURY, CLAIM, RESEND, SET_BACK, split
from sagaloop.brokers.dead_letters import DeadLetter
from sagaloop.brokers.signing import SIGNATURE_HEADER, sign, verify
from sagaloop.engine.messages import CONTENT_TYPE, MAX_MESSAGE_BYTES
from sagaloop.engine.ports import Clock, Delivery, SystemClock, Tx
from sagaloop.errors import BrokerAccessRefused, BrokerError, UndeliverableError
from sagaloop.tracing import TRACEPARENT, TRACESTATE

logger = logging.getLogger(__name__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class KombuDelivery:
    """A claimed message. ``settle`` is a no-op: Redis takes no part in the database
    transaction; the consumer acks after its commit, and the inbox absorbs redeliveries."""

    def __init__(
        self, broker: KombuBroker, claim: str, queue: str, message: bytes, deliveries: int
    ) -> None:
        self._broker = broker
        self._claim = claim
        self._done = False
        self.queue = queue
        self.deliveries = deliveries
        self.body, self.content_type, headers = broker._open(message)
        self.trusted = verify(broker._signing_key, queue, self.body, headers.get(SIGNATURE_HEADER))
        trace = {
            k: headers[k] for k in (TRACEPARENT, TRACESTATE) if isinstance(headers.get(k), str)
        }
        self.trace = trace or None  # a plain kombu publisher's W3C trace context, unchecked

    def settle(self, tx: Tx) -> None:
        pass

    def ack(self) -> None:
        """Delete the message, if this claim still holds it. A failure is logged, not raised:
        the message then comes back after its lease and the inbox absorbs it."""
        if self._finish():
            try:
                self._broker._run("acknowledging", "ack", self._claim)
            except BrokerError as e:
                logger.warning("%s; it comes back after its lease", e)

    def extend(self) -> bool:
        with self._broker._lock:
            if self._done:
                return False
        until = self._broker._at(self._broker.lease)
        return bool(self._broker._run("renewing a lease", "set_back", self._claim, until))

    def retry_later(self, delay: timedelta) -> None:
        """Back on its queue (at the head) once ``delay`` has passed on the clock."""
        if self._finish():
            try:
                self._broker._run("retrying", "set_back", self._claim, self._broker._at(delay))
            except BrokerError as e:
                logger.warning("%s; it comes back after its lease instead", e)

    def dead_letter(self, reason: str) -> None:
        if not self._finish():
            return
        meta = {"queue": self.queue, "reason": reason[:4000], "at": self._broker._now_iso()}
        try:
            buried = self._broker._run("dead-lettering", "bury", self._claim, json.dumps(meta))
        except BrokerError:
            with self._broker._lock:  # still held: redelivered after its lease
                self._done = False
                self._broker._live[self._claim] = self
            raise
        if buried:
            logger.warning("dead-lettered a message of %s: %s", self.queue, reason)

    def _finish(self) -> bool:
        with self._broker._lock:
            if self._done:
                return False
            self._done = True
            self._broker._live.pop(self._claim, None)
            return True


class KombuBroker:
    """The broker on Redis through kombu (``url``: ``redis://[user:password@]host:port/db`` or
    ``rediss://...``).

    ``namespace`` prefixes every key; ``lease``, on ``clock``, is how long a claimed message
    stays invisible without an ack or a renewal (the visibility timeout); ``signing_key``
    (``SqlStore.signing_key()``) signs what this broker publishes and verifies what it receives;
    ``poll_interval`` is how often an idle ``receive`` looks for messages that other processes
    published (this process's publishes wake it at once); ``connect_timeout`` bounds connecting.
    The constructor connects and raises :class:`BrokerError` when it cannot; a lost connection
    is made again by the next command. No delivery limit applies: a message is redelivered
    until a consumer acks or dead-letters it (the engine and workers count deliveries and halt
    a crash loop themselves)."""

    uses_outbox = False

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "sagaloop",
        lease: timedelta = timedelta(seconds=60),
        clock: Clock | None = None,
        signing_key: bytes | None = None,
        poll_interval: float = 0.05,
        connect_timeout: timedelta | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        try:
            import redis  # noqa: F401  (kombu's Redis transport needs it)
        except ImportError as e:
            from sagaloop.extras import missing_extra

            raise missing_extra("the Redis broker", "redis", e) from e
        self.safe_url = mask_url(url)  # for logs and errors: the password masked
        self.namespace = namespace
        self.lease = lease
        self.clock = clock or SystemClock()
        self.poll_interval = poll_interval
        self.max_message_bytes = max_message_bytes
        self._signing_key = signing_key
        self._lock = threading.Lock()  # the claims held, and the count of publishes
        self._published = threading.Condition(self._lock)
        self._producing = threading.Lock()  # kombu's producer is not shared between threads
        self._publishes = 0
        self._live: dict[str, KombuDelivery] = {}
        self._closed = False
        self._turn = itertools.count()
        self._keys = {k: f"{namespace}:{k}" for k in ("held", "until", "deliveries", "seq")}
        self._dead, self._dead_ids = f"{namespace}:dead", f"{namespace}:dead-ids"
        options = {
            "socket_connect_timeout": (connect_timeout or timedelta(seconds=10)).total_seconds(),
            "socket_timeout": 30,  # a dead TCP connection fails a command instead of hanging
            "max_connections": 100,  # per process: every consumer thread holds one at times
        }
        self._connection = kombu.Connection(url, transport_options=options)
        try:
            if self._connection.transport.driver_type != "redis":
                raise BrokerError(
                    f"{self.safe_url}: KombuBroker runs on kombu's Redis transport only "
                    "(redis://, rediss://): its claims, leases and fenced acks are Redis scripts"
                )
            with self._errors("connecting"):
                self._channel = self._connection.channel()  # kombu pings the server
                self._client = self._channel.client
        except BaseException:
            self._connection.release()
            raise
        self._producer = kombu.Producer(self._channel, auto_declare=False)
        self._scripts = {
            name: self._client.register_script(lua)  # sent once, then run by their SHA-1
            for name, lua in [
                ("claim", CLAIM),
                ("set_back", SET_BACK),
                ("ack", ACK),
                ("bury", BURY),
                ("resend", RESEND),
            ]
        }
        self._check_persistence()

    # --- the Broker protocol -----------------------------------------------------------------

    def queue_key(self, queue: str) -> str:
        """The Redis list (kombu's queue) behind sagaloop queue ``queue``."""
        return f"{self.namespace}.{queue}"

    def declare(self, queues: Sequence[str]) -> None:
        """Nothing to create (a list exists once it holds a message): check the server answers."""
        with self._errors("checking the server"):
            self._client.ping()

    def publish(self, batch: Sequence[tuple[str, bytes]]) -> None:
        """``LPUSH`` each message (one pipeline) and return once Redis answered: the messages
        are then in the server's memory, on its disk only as its persistence settings say."""
        for queue, body in batch:
            if len(body) > self.max_message_bytes:
                raise UndeliverableError(
                    f"a message of {len(body)} bytes to {queue!r} exceeds max_message_bytes "
                    f"({self.max_message_bytes}): keep large payloads out of messages"
                )
        here = tracing.current()  # the relay's span sagaloop.relay.publish, when tracing
        self._publish(
            [
                (q, body, CONTENT_TYPE, self._signing_key, tracing.amqp_headers(body, here))
                for q, body in batch
            ]
        )

    def publish_raw(
        self,
        queue: str,
        body: bytes,
        content_type: str | None = CONTENT_TYPE,
        *,
        trusted: bool = False,
    ) -> None:
        """Put a message on ``queue`` as any kombu client would: unsigned, unless ``trusted``."""
        self._publish([(queue, body, content_type, self._signing_key if trusted else None, None)])

    def _publish(
        self, items: list[tuple[str, bytes, str | None, bytes | None, dict[str, str] | None]]
    ) -> None:
        batch = getattr(self._producer, "batch", None)  # kombu >= 5.7: one pipeline
        grouped = batch() if batch is not None else contextlib.nullcontext()
        with self._errors("publishing"), self._producing, grouped:
            for queue, body, content_type, key, trace in items:
                headers = {SIGNATURE_HEADER: sign(key, queue, body)} if key else {}
                headers.update(trace or {})  # the W3C trace headers (tracing.amqp_headers)
                self._producer.publish(
                    body,
                    routing_key=self.queue_key(queue),
                    content_type=content_type or "",
                    content_encoding="binary",
                    headers=headers,
                    delivery_mode=2,
                )
        with self._lock:
            self._publishes += 1
            self._published.notify_all()

    def receive(self, queues: Sequence[str], max_messages: int, timeout: float) -> list[Delivery]:
        names = list(dict.fromkeys(queues))
        if max_messages < 1 or not names:
            return []
        turn = next(self._turn) % len(names)  # which queue is read first: each in turn
        names = names[turn:] + names[:turn]
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                seen, closed = self._publishes, self._closed
            out = [] if closed else self._claim(names, max_messages)
            remaining = deadline - time.monotonic()
            if out or closed or remaining <= 0:
                return out
            with self._lock:
                if self._publishes == seen and not self._closed:
                    self._published.wait(min(remaining, self.poll_interval))

    def _claim(self, names: list[str], max_messages: int) -> list[Delivery]:
        steps = self._channel.priority_steps  # kombu's lists of a queue, priority 0 first
        lists = [(q, self._channel._q_for_pri(self.queue_key(q), p)) for q in names for p in steps]
        now, until = self._at(timedelta(0)), self._at(self.lease)
        keys = [*self._keys.values(), *(key for _, key in lists)]
        with self._errors("receiving"):
            flat = self._scripts["claim"](keys=keys, args=[now, until, max_messages])
        fields = iter(flat)  # claim id, message, deliveries, which list: four per message
        out = [
            KombuDelivery(self, _text(claim), lists[int(index) - 1][0], message, int(n))
            for claim, message, n, index in zip(fields, fields, fields, fields, strict=True)
        ]
        with self._lock:
            self._live.update((d._claim, d) for d in out)
        return list[Delivery](out)

    def close(self) -> None:
        """Give back at once what this broker holds and nobody settled (it would otherwise
        come back after its lease), then close the connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._published.notify_all()
            held, self._live = list(self._live.values()), {}
        for delivery in held:
            with contextlib.suppress(BrokerError):
                self._run("giving back", "set_back", delivery._claim, self._at(timedelta(0)))
        with contextlib.suppress(Exception):
            self._channel.close()
        self._connection.release()

    # --- dead letters (sagaloop.brokers.dead_letters.DeadLetters) ----------------------------
    # A dead letter's id is a number that grows with each one (shared with the claim ids); it
    # keeps the message as it was on its queue, so a resent one keeps its signature and trust.

    def list_dead_letters(self, limit: int = 1000) -> list[DeadLetter]:
        with self._errors("reading the dead letters"):
            ids = [_text(i) for i in self._client.zrange(self._dead_ids, 0, limit - 1)]
        return self._letters(ids)

    def find_dead_letter(self, id: str) -> DeadLetter | None:
        found = self._letters([id]) if id.isascii() and id.isdigit() else []
        return found[0] if found else None

    def count_dead_letters(self) -> int:
        with self._errors("counting the dead letters"):
            return int(self._client.zcard(self._dead_ids))

    def resend_dead_letters(self, ids: Sequence[str] | None = None) -> list[DeadLetter]:
        """Back to the tail of their queues, oldest first: each one moved from the dead
        letters to its queue in one step, so none is lost or sent twice."""
        with self._errors("reading the dead letters"):
            all_ids = [_text(i) for i in self._client.zrange(self._dead_ids, 0, -1)]
        chosen = None if ids is None else set(ids)
        wanted = [i for i in all_ids if chosen is None or i in chosen]
        resent: list[DeadLetter] = []
        for start in range(0, len(wanted), 100):
            letters = {d.id: d for d in self._letters(wanted[start : start + 100])}
            with self._errors("resending dead letters"):
                moved = self._scripts["resend"](
                    keys=[self._dead, self._dead_ids], args=list(letters)
                )
            resent += [letters[_text(i)] for i in moved]
        return resent

    def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        with self._errors("purging the dead letters"), self._client.pipeline() as pipe:
            if ids is None:
                count, _ = pipe.zcard(self._dead_ids).delete(self._dead, self._dead_ids).execute()
                return int(count)
            if not ids:
                return 0
            removed, _ = pipe.hdel(self._dead, *ids).zrem(self._dead_ids, *ids).execute()
            return int(removed)

    def _letters(self, ids: list[str]) -> list[DeadLetter]:
        if not ids:
            return []
        with self._errors("reading the dead letters"):
            records = self._client.hmget(self._dead, ids)
        out = []
        for id, record in zip(ids, records, strict=True):
            if record is not None:
                _list, rest = split(record)
                meta_json, message = split(rest)
                meta = json.loads(meta_json)
                body, content_type, _ = self._open(message)
                at = datetime.fromisoformat(meta["at"])
                out.append(DeadLetter(id, meta["queue"], meta["reason"], at, body, content_type))
        return out

    # --- helpers -----------------------------------------------------------------------------

    def _open(self, message: bytes) -> tuple[bytes, str | None, dict[str, Any]]:
        """Body, content type and headers of a message on a list: kombu decodes its own
        messages; anything else is a bare body without a content type."""
        try:
            payload = json.loads(message)
            if isinstance(payload, dict) and isinstance(payload.get("properties"), dict):
                decoded = self._channel.Message(payload, channel=self._channel)
                headers = decoded.headers if isinstance(decoded.headers, dict) else {}
                body = decoded.body
                if isinstance(body, bytes):
                    return body, decoded.content_type or None, headers
        except Exception:  # not kombu's: delivered as it is (and dead-lettered by the consumer)
            pass
        return message, None, {}

    def _at(self, delay: timedelta) -> str:
        """``now + delay`` on the clock, as a score (seconds, full precision)."""
        return repr((self.clock.now() + delay).timestamp())

    def _now_iso(self) -> str:
        return self.clock.now().isoformat()

    def _run(self, what: str, script: str, *args: str) -> Any:
        keys = list(self._keys.values())
        if script == "bury":
            keys += [self._dead, self._dead_ids]
        with self._errors(what):
            return self._scripts[script](keys=keys, args=list(args))

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Redis's and kombu's errors as :class:`BrokerError` (a refused login or database as
        :class:`BrokerAccessRefused`)."""
        from kombu.exceptions import KombuError
        from redis.exceptions import AuthenticationError, RedisError

        try:
            yield
        except (RedisError, OSError, KombuError) as e:
            text = str(e)
            refusal = None
            if isinstance(e, AuthenticationError) or any(
                word in text for word in ("NOAUTH", "WRONGPASS", "NOPERM")
            ):
                refusal = "the user name or password was refused, or the user lacks a permission"
            elif "DB index is out of range" in text:
                refusal = "the database number does not exist on this server"
            message = f"{what}: Redis at {self.safe_url}: {type(e).__name__}: {text}"
            if refusal is not None:
                raise BrokerAccessRefused(
                    f"{message} ({refusal})", reason=refusal, where=self.safe_url
                ) from e
            raise BrokerError(message) from e

    def _check_persistence(self) -> None:
        """Warn once per server about settings under which Redis loses messages."""
        if self.safe_url in _CHECKED:
            return
        _CHECKED.add(self.safe_url)
        try:
            config: dict[str, str] = {}
            for name in ("appendonly", "maxmemory-policy"):
                config.update(
                    {_text(k): _text(v) for k, v in self._client.config_get(name).items()}
                )
        except Exception:  # CONFIG is often disabled on managed Redis: nothing to check
            logger.info("could not read the persistence settings of Redis at %s", self.safe_url)
            return
        if config.get("maxmemory-policy", "").startswith("allkeys"):
            logger.warning(
                "Redis at %s may evict any key (maxmemory-policy %s): queued messages can "
                "vanish; set maxmemory-policy noeviction",
                self.safe_url,
                config["maxmemory-policy"],
            )
        if config.get("appendonly") != "yes":
            logger.warning(
                "Redis at %s keeps messages in memory (appendonly no): a restart of Redis loses "
                "what was queued; set appendonly yes (docs/guarantees.md)",
                self.safe_url,
            )


_CHECKED: set[str] = set()
"""The servers whose persistence settings were looked at by this process."""
