"""How the client waits for something the store will show (a run's end, a published value):
it reads, and reads again after a pause that doubles up to :data:`MAX_POLL`, until a deadline.
One mechanism for every blocking read of :class:`~sagaloop.client.Client`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sagaloop.errors import RunFinishedError, ValidationError

MAX_POLL = 0.5
"""The longest pause between two reads, in seconds: a long wait costs two reads a second."""


class _Nothing:
    def __repr__(self) -> str:
        return "NOTHING"


NOTHING: Any = _Nothing()
"""No value (a key not published, an ``after`` not given): unlike None, which is a value."""


class NotPublishedError(RunFinishedError):
    """The run ended without publishing the value awaited (``Client.wait_published``) under
    ``key``; ``last``: the latest value it published under ``key`` (the one given as
    ``after``), or :data:`NOTHING`."""

    def __init__(self, run_id: str, status: str, key: str, last: Any = NOTHING) -> None:
        super().__init__(run_id, status)
        what = "anything" if last is NOTHING else f"a value other than {last!r:.60}"
        self.args = (
            f"run {run_id!r} ended ({status}) without publishing {what} under {key!r}: it "
            "will not publish any more (read what it published with Client.get_published, "
            "and why it ended with Client.status)",
        )
        self.key, self.last = key, last


@dataclass(frozen=True)
class Pending:
    """What a read returns while the awaited thing is not there yet: ``waiting`` says what is
    awaited (the message of the TimeoutError when the deadline passes)."""

    waiting: str


def seconds(timeout: float | timedelta | None) -> float | None:
    """``timeout`` in seconds (None: no deadline); refuses a negative one or another type."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValidationError(
            f"a timeout is a number of seconds (or a timedelta) of 0 or more, not {timeout!r:.40}"
        )
    return float(timeout)


def poll_until(
    read: Callable[[], Any], *, timeout: float | timedelta | None, poll: float = 0.05
) -> Any:
    """Call ``read`` until it returns something other than :class:`Pending` (or raises), and
    return that. Between reads, pause ``poll`` seconds, doubling up to :data:`MAX_POLL` (never
    past the deadline). After ``timeout`` seconds, raise TimeoutError saying what the last
    read was waiting for; ``timeout=0`` reads once; ``None`` waits for ever."""
    limit = seconds(timeout)
    deadline = None if limit is None else time.monotonic() + limit
    pause = poll
    while True:
        found = read()
        if not isinstance(found, Pending):
            return found
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"{found.waiting} after {limit:g} s")
        time.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, max(poll, MAX_POLL))
