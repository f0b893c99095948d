"""What the engine consumer and the worker consumer share: decoding a delivery into its
envelope (or dead-lettering it), the log line of a failure, a run's log ``extra``, and
:class:`Troubles`, what a consumer remembers of the messages that failed.
"""

from __future__ import annotations

import collections
import logging
import threading
from datetime import timedelta
from typing import Any

from sagaloop import tracing
from sagaloop.engine.messages import CONTENT_TYPE, INTERNAL_TYPES, Envelope, StepReply
from sagaloop.engine.ports import Delivery, Store
from sagaloop.errors import MessageError, StoreError, TransientStoreError

# The name these lines had before the consumers were split: logs and their filters do not change.
logger = logging.getLogger("sagaloop.runtime.consumers")

RETRY_DELAY = timedelta(seconds=1)
MAX_FAILURES = 5
"""How often a message may fail (other than for an outage) before its run is parked."""
NOT_STARTED_TRIES = 10
"""How often sagaloop's own message for a run that does not exist is delivered (every
``RETRY_DELAY``) before it is dead-lettered: its run's start may come after it
(:class:`~sagaloop.errors.RunNotStartedError`)."""


def log_failure(what: str, exc: BaseException, extra: dict[str, Any] | None = None) -> None:
    """An outage of the database is expected and retried: one line. Anything else: a trace.
    ``extra``: the run's ids (see :func:`run_extra`), for a failure about a run's message."""
    if isinstance(exc, TransientStoreError):
        logger.warning("%s: %s; retrying", what, exc, extra=extra)
    else:
        logger.error("%s; retrying", what, exc_info=exc, extra=extra)


def run_extra(env: Envelope) -> dict[str, Any]:
    """The ``extra`` of a log record about ``env``'s run."""
    return {"run_id": env.run_id, "saga": env.saga} if env.saga else {"run_id": env.run_id}


def decode(delivery: Delivery, store: Store | None = None) -> Envelope | None:
    """The delivery's envelope, or None after dead-lettering a message that is not one, or
    an internal message (step, step result, timer) that sagaloop's processes did not send.
    With ``store``, its large payload values are loaded back from the payload table (None
    after handing the message back if the database failed). An envelope without a trace
    context takes the one a plain AMQP publisher put in the headers, if valid; one with a trace
    context takes the headers' when they continue its trace (the relay's publish span)."""
    content_type = delivery.content_type  # None: not set, which plain clients often do
    if content_type is not None and content_type.split(";")[0].strip().lower() != CONTENT_TYPE:
        delivery.dead_letter(f"content type {delivery.content_type!r} is not {CONTENT_TYPE}")
        return None
    try:
        env = Envelope.from_bytes(delivery.body)
    except MessageError as e:
        delivery.dead_letter(e.reason)
        return None
    trace = tracing.continued(env.trace, getattr(delivery, "trace", None))
    if trace != env.trace:  # RabbitMQ's ``traceparent`` header: a plain publisher's, the relay's
        env = env.model_copy(update={"trace": trace})
    if env.type in INTERNAL_TYPES and not delivery.trusted:
        # Before any inbox row: a forged message must never occupy a real one's id.
        delivery.dead_letter(
            f"{env.type} message {env.message_id!r} is not signed by sagaloop: only start, "
            "event, cancel and retry messages may come from outside sagaloop's processes "
            "(see docs/messages.md)"
        )
        return None
    if store is None:
        return env
    try:
        return store.resolve(None, env)
    except MessageError as e:
        delivery.dead_letter(e.reason)
    except StoreError as e:
        log_failure(f"could not load the payloads of message {env.message_id}", e)
        delivery.retry_later(RETRY_DELAY)
    return None


class Troubles:
    """What a consumer remembers of the messages that failed: per inbox key, how often
    they failed (not counting outages) and were retried for an outage, and the reply computed
    for one that could not be stored yet. Bounded: the oldest are forgotten."""

    MAX_KEYS = 10_000
    MAX_REPLIES = 256

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._replies: collections.OrderedDict[str, StepReply] = collections.OrderedDict()

    def reply(self, key: str) -> StepReply | None:
        with self._lock:
            return self._replies.get(key)

    def keep(self, key: str, reply: StepReply) -> None:
        with self._lock:
            self._replies[key] = reply
            self._replies.move_to_end(key)
            while len(self._replies) > self.MAX_REPLIES:
                self._replies.popitem(last=False)

    def forget(self, key: str) -> None:
        with self._lock:
            self._replies.pop(key, None)
            self._counts.pop(key, None)

    def transient(self, key: str) -> None:
        with self._lock:
            self._count(key)[1] += 1

    def give_up(
        self,
        key: str,
        delivery: Delivery,
        what: str,
        exc: Exception,
        limit: int,
        extra: dict[str, Any] | None = None,
    ) -> int | None:
        """Count a failure (with the earlier deliveries that this process did not see retried
        for an outage). Below ``limit``: log it, hand the message back, return None. At the
        limit: return how many failures there were (the caller gives up on the message)."""
        with self._lock:
            counts = self._count(key)
            counts[0] = max(counts[0], delivery.deliveries - 1 - counts[1]) + 1
            failures = counts[0]
        if failures >= limit:
            return failures
        log_failure(f"{what}, {failures} of {limit} times", exc, extra)
        delivery.retry_later(RETRY_DELAY)
        return None

    def unanswered(self, key: str, deliveries: int) -> int:
        """Earlier deliveries of the message that this process did not see retried for an
        outage (a worker that died while running it, as often as not)."""
        with self._lock:
            counts = self._counts.get(key)
            return deliveries - 1 - (counts[1] if counts else 0)

    def _count(self, key: str) -> list[int]:
        counts = self._counts.setdefault(key, [0, 0])
        self._counts.move_to_end(key)
        while len(self._counts) > self.MAX_KEYS:
            self._counts.popitem(last=False)
        return counts
