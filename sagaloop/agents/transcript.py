"""Transcripts stored once: each model request records only what is new since the previous one.

An agent sends the whole conversation with every model request. Recording it whole in each
request's step would make a run's history grow with the square of its length (21 requests
with 2 KB tool results made an 812 KB history, 92% of it re-sent transcript). Instead the saga
side records a *delta*: "the first ``keep`` messages of the request at position ``prev``, then
``append``". The step that runs the request (on a worker) rebuilds the full list from its own
cache, or, after a restart, from the run's history.

This module is framework-neutral: messages are JSON values; the adapter decides how one is
encoded and when two are the same (identity of the framework's objects, or equality). Its users:
the Pydantic AI and OpenAI Agents adapters, and :class:`~sagaloop.agents.conversation.Conversation`
for loops written without a framework.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.errors import SagaloopError, ValidationError

Delta = dict[str, Any]
"""``{"prev": n | None, "keep": int, "append": [message JSON, ...]}`` for request ``n`` of an
agent run (``conversation``, ``n``: added by the adapter). It travels as the ``"transcript"``
of a dict that is an argument of the step (any parameter name): where the history is searched."""


class TranscriptError(SagaloopError):
    """A model request's transcript cannot be rebuilt from the run's history."""


class Encoder:
    """The saga side of one agent run: remembers what the previous request sent (the
    framework's message objects and the request's number)."""

    def __init__(
        self,
        encode: Callable[[Sequence[Any]], list[Any]],
        same: Callable[[Any, Any], bool] | None = None,
    ) -> None:
        self._encode = encode
        self._same = same or (lambda a, b: a is b)
        """When a message is the one at the same place in the previous request (identity of the
        framework's objects by default; equality for a framework that rebuilds them)."""
        self._prev_pos: int | None = None
        self._prev: list[Any] = []

    def delta(self, messages: Sequence[Any]) -> Delta:
        """What to record for a request of ``messages``: the messages that are not the same as
        those at the same place in the previous request, and how many that are."""
        keep = 0
        if self._prev_pos is not None:
            limit = min(len(messages), len(self._prev))
            while keep < limit and self._same(messages[keep], self._prev[keep]):
                keep += 1
        return {
            "prev": self._prev_pos if keep else None,
            "keep": keep,
            "append": self._encode(messages[keep:]),
        }

    def sent(self, position: int, messages: Sequence[Any]) -> None:
        self._prev_pos = position
        self._prev = list(messages)

    def sent_as_recorded(self, position: int, delta: Delta) -> None:
        """Like :meth:`sent` for the request ``delta`` describes, but keeps its messages as the
        delta encoded them, not the caller's objects: for messages compared by equality, which
        the caller may change in place once sent (the next request then records the change)."""
        self._prev_pos = position
        self._prev = [*self._prev[: int(delta["keep"])], *delta["append"]]


class Decoder:
    """The worker side: rebuilds the full transcript of a request. Keeps the last transcript
    of each run (bounded), so a loop costs what is new, not its length; after a restart or on
    another worker it reads the run's history once."""

    def __init__(
        self, parse: Callable[[list[Any]], list[Any]] | None = None, size: int = 256
    ) -> None:
        self._parse = parse or (lambda messages: messages)
        """JSON messages to the framework's objects: run on what is new only (the cache holds
        parsed messages, shared between requests: the framework must not change them)."""
        self._lock = threading.Lock()
        self._last: collections.OrderedDict[tuple[str, str], tuple[int, Delta, list[Any]]] = (
            collections.OrderedDict()
        )
        """The last request of each agent run, by (run id, agent run): its position, its delta
        and its full transcript."""
        self.size = size

    def messages(
        self,
        run_id: str,
        delta: Delta,
        *,
        step: str | None,
        history: Callable[[str], list[Event]] | None,
    ) -> list[Any]:
        """The full transcript of the request ``delta`` describes, parsed. ``step`` names the
        step whose requests the history holds; None: any step of the run (a conversation sent
        to several steps). The same request again (a retried attempt) is served from the
        cache too, as a new list."""
        prev, keep = delta.get("prev"), int(delta.get("keep", 0))
        position = int(delta.get("n", 0))
        key = (run_id, str(delta.get("conversation")))
        with self._lock:
            hit = self._last.get(key)
        if hit is not None and hit[0] == position and hit[1] == delta:
            return list(hit[2])
        base: list[Any] = []
        if prev is not None:
            if hit is not None and hit[0] == prev:
                base = hit[2]
            else:
                try:
                    if history is None:
                        raise ValidationError("no reader of histories was given")
                    events = history(run_id)
                except ValidationError as e:
                    raise TranscriptError(
                        f"the transcript of run {run_id!r} at position {prev} is not in this "
                        f"process and it cannot read the run's history ({e})"
                    ) from None
                found = _from_history(events, step, delta.get("conversation"), prev)
                base = self._parse(found)
        if keep > len(base):
            raise TranscriptError(
                f"request {position} of run {run_id!r} keeps {keep} messages of request {prev},"
                f" which had {len(base)}"
            )
        full = [*base[:keep], *self._parse(list(delta.get("append", [])))]
        with self._lock:
            self._last[key] = (position, delta, full)
            self._last.move_to_end(key)
            while len(self._last) > self.size:
                self._last.popitem(last=False)
        return full


def _from_history(
    events: list[Event], step: str | None, conversation: Any, target: int
) -> list[Any]:
    """The messages of request ``target`` of ``conversation`` (an agent run of the run): its
    deltas are the ``"transcript"`` of an argument of the scheduled steps (``step``'s, or any
    step's for None)."""
    deltas: dict[int, Delta] = {}
    for ev in events:
        if ev.kind != h.STEP_SCHEDULED or (step is not None and ev.name != step):
            continue
        for arg in (ev.data.get("args") or {}).values():
            found = arg.get("transcript") if isinstance(arg, dict) else None
            if isinstance(found, dict) and found.get("conversation") == conversation:
                deltas[int(found.get("n", 0))] = found
    chain: list[int] = []
    pos: int | None = target
    while pos is not None:
        if pos not in deltas:
            raise TranscriptError(
                f"no request {pos} of {conversation!r} in the run's history: a request must be "
                "an argument of the step itself (ctx.call(step, request)), not inside another "
                "value"
            )
        chain.append(pos)
        pos = deltas[pos].get("prev")
    messages: list[Any] = []
    for pos in reversed(chain):
        d = deltas[pos]
        messages = [*messages[: int(d.get("keep", 0))], *d.get("append", [])]
    return messages
