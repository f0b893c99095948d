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
import copy
import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.errors import SagaloopError, ValidationError

Delta = dict[str, Any]
"""``{"prev": n | None, "keep": int, "append": [message JSON, ...]}`` for request ``n`` of an
agent run (``conversation``, ``n``: added by the adapter). It travels as the ``"transcript"``
of a dict that is an argument of the step (any parameter name): where the history is searched.

Two optional keys spare what the history holds already (a delta without them is read as
before, so runs recorded earlier replay and resume):

- ``"refs"``: ``{"<index in append>": {"n": m, "path": [...], "set": {...}, "drop": [...]}}``:
  the message at that index (``null`` in ``append``) is the value at ``path`` of the response
  to request ``m`` as its step's result recorded it, with the keys ``set`` set and ``drop``
  removed (each left out when empty); ``sha``: the start of the sha256 of the value's
  canonical JSON, which the worker checks (a result its cache holds from an attempt that was
  not the one recorded is not used). A model's response is thus stored once, as the model
  step's result, not again as a message of the next request.
- ``"values"``: ``[{"at": [index in append, key or index, ...], "sha": "<digest>"}, ...]``:
  the string at ``at`` (``null`` there) is a string of at least :data:`LONG` characters of a
  step's recorded result (a tool's result, in the message that gives it to the model), named by
  the start of its sha256. A tool's result is thus stored once, as its step's result.
- ``"same"``: ``{"<key>": m}``: the request's entry ``key`` (its tool definitions, settings)
  is the one request ``m`` recorded; it is recorded again only when it changes."""

LONG = 256
"""A string of a step's result this long or longer is recorded once (see ``"values"``)."""

_NO_REF = 24
"""A message is recorded by reference only when that saves at least this many bytes."""


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
        self._same = same
        """When a message is the one at the same place in the previous request (None: identity
        of the framework's objects; equality for a framework that rebuilds them)."""
        self._prev_pos: int | None = None
        self._prev: list[Any] = []
        self._answer: tuple[int, list[tuple[list[Any], Any]]] | None = None
        self._extras: dict[str, tuple[int, Any]] = {}
        self._received: dict[str, str] = {}

    def delta(self, messages: Sequence[Any]) -> Delta:
        """What to record for a request of ``messages``: the messages that are not the same as
        those at the same place in the previous request, and how many that are; a new message
        that is (nearly) a value of the last response (:meth:`answered`) as a reference to it."""
        keep = 0
        if self._prev_pos is not None:
            keep = _common_prefix(messages, self._prev, self._same)
        append = self._encode(messages[keep:])
        delta: Delta = {"prev": self._prev_pos if keep else None, "keep": keep, "append": append}
        refs = self._refs(append)
        if refs:
            delta["refs"] = refs
        if self._received:
            values: list[dict[str, Any]] = []
            append[:] = [
                m if m is None else _cut(m, [i], values, self._received)
                for i, m in enumerate(append)
            ]
            self._received = {}
            if values:
                delta["values"] = values
        return delta

    def received(self, result: Any) -> None:
        """A step's result the saga code got (a tool's, as recorded): a message of the next
        request that repeats one of its long strings refers to it (``"values"``)."""
        for text in _long_strings(result):
            self._received[text] = _sha(text)

    def answered(self, n: int, values: list[tuple[list[Any], Any]]) -> None:
        """The response to request ``n`` as its step's result recorded it, as the values that
        may come back as messages of the next request: ``(path in the result, value)``."""
        self._answer = (n, values)

    def _refs(self, append: list[Any]) -> dict[str, Any]:
        if self._answer is None:
            return {}
        n, values = self._answer
        left = list(values)
        refs: dict[str, Any] = {}
        for i, message in enumerate(append):
            if not isinstance(message, dict):
                continue
            for j, (path, value) in enumerate(left):
                if not isinstance(value, dict):
                    continue
                changed = {k: v for k, v in message.items() if k not in value or value[k] != v}
                drop = [k for k in value if k not in message]
                ref: dict[str, Any] = {"n": n, "path": path, "sha": _sha(value)}
                if changed:
                    ref["set"] = changed
                if drop:
                    ref["drop"] = drop
                if _size(ref) + _NO_REF <= _size(message):
                    refs[str(i)] = ref
                    append[i] = None
                    del left[j]
                    break
        return refs

    def same(self, n: int, extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
        """Request ``n``'s other entries (``extra``): those to record, and for each entry equal
        to the one an earlier request recorded, that request's number (``"same"``). An entry
        that is None is not recorded (read back as None)."""
        out: dict[str, Any] = {}
        same: dict[str, int] = {}
        for key, value in extra.items():
            if value is None:  # left out: the worker reads a missing entry as None
                self._extras.pop(key, None)
                continue
            known = self._extras.get(key)
            if known is not None and known[1] == value and _size(value) > _NO_REF:
                same[key] = known[0]
            else:
                out[key] = value
                self._extras[key] = (n, value)
        return out, same

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
        self._responses: collections.OrderedDict[tuple[str, str], tuple[int, Any]] = (
            collections.OrderedDict()
        )
        """The last response this process gave to each agent run: (its request, its result)."""
        self._extras: collections.OrderedDict[tuple[str, str], dict[str, tuple[int, Any]]] = (
            collections.OrderedDict()
        )
        """The entries (``"same"``) each agent run's requests recorded last, with their number."""
        self._strings: collections.OrderedDict[str, tuple[int, dict[str, str]]] = (
            collections.OrderedDict()
        )
        """Each run's long strings of step results (``"values"``), by digest, with the seq of
        the last event read: the next read asks for the events after it only."""
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
        history: Callable[..., list[Event]] | None,
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
        append = list(delta.get("append", []))
        if delta.get("refs"):
            append = _expand(append, delta["refs"], self._answer_of(run_id, delta, step, history))
        if delta.get("values"):
            append = _fill(append, delta["values"], lambda sha: self._string(run_id, sha, history))
        full = [*base[:keep], *self._parse(append)]
        with self._lock:
            self._last[key] = (position, delta, full)
            self._last.move_to_end(key)
            while len(self._last) > self.size:
                self._last.popitem(last=False)
        return full

    def _string(self, run_id: str, sha: str, history: Callable[..., list[Event]] | None) -> str:
        """The long string ``sha`` names, of a step result of the run: from what this process
        read of its history, else from the events recorded since (one read, as long as a turn).
        """
        with self._lock:
            seen = self._strings.get(run_id)
        if seen is not None and sha in seen[1]:
            return seen[1][sha]
        after, index = (seen[0], dict(seen[1])) if seen is not None else (0, {})
        found = self._read_strings(run_id, history, after, index)
        if sha not in found and after:  # the history started again (continued as new)
            found = self._read_strings(run_id, history, 0, {})
        index = found
        if sha not in index:
            raise TranscriptError(
                f"a message of run {run_id!r} refers to a step's result (sha256 {sha}...) that "
                "the run's history does not hold"
            )
        return index[sha]

    def _read_strings(
        self,
        run_id: str,
        history: Callable[..., list[Event]] | None,
        after: int,
        index: dict[str, str],
    ) -> dict[str, str]:
        """``index`` with the long strings of the step results recorded after ``after``;
        remembered with the last seq read."""
        try:
            if history is None:
                raise ValidationError("no reader of histories was given")
            events = history(run_id, after=after)
        except ValidationError as e:
            raise TranscriptError(
                f"a message of run {run_id!r} refers to a step's result this process has not "
                f"read, and it cannot read the run's history ({e})"
            ) from None
        index.update(strings_of(events))
        while len(index) > self.size:
            del index[next(iter(index))]
        with self._lock:
            self._strings[run_id] = (max((e.seq for e in events), default=after), index)
            self._strings.move_to_end(run_id)
            while len(self._strings) > self.size:
                self._strings.popitem(last=False)
        return index

    def responded(self, run_id: str, delta: Delta, result: Any) -> None:
        """The step's result for the request ``delta`` describes (what its step returns, as
        JSON): a reference of the next request to it is then resolved without the history."""
        key = (run_id, str(delta.get("conversation")))
        with self._lock:
            self._responses[key] = (int(delta.get("n", 0)), result)
            self._responses.move_to_end(key)
            while len(self._responses) > self.size:
                self._responses.popitem(last=False)

    def _answer_of(
        self,
        run_id: str,
        delta: Delta,
        step: str | None,
        history: Callable[..., list[Event]] | None,
    ) -> Callable[[int, str | None], Any]:
        key = (run_id, str(delta.get("conversation")))
        events: list[Event] | None = None

        def answer(n: int, mismatch: str | None) -> Any:
            """The recorded result of request ``n``: from the cache, unless ``mismatch``
            (the cached one is not the recorded one)."""
            nonlocal events
            with self._lock:
                hit = self._responses.get(key)
            if hit is not None and hit[0] == n and mismatch is None:
                return hit[1]
            if events is None:
                events = _read(history, run_id, n)
            return _result_of(events, step, delta.get("conversation"), n)

        return answer

    def extras(
        self,
        run_id: str,
        request: dict[str, Any],
        *,
        step: str | None,
        history: Callable[..., list[Event]] | None,
    ) -> dict[str, Any]:
        """The request's entries other than its transcript, those it records as the same as an
        earlier request's (``"same"``) read from this process's cache or the run's history."""
        delta = request.get("transcript") or {}
        key = (run_id, str(delta.get("conversation")))
        n = int(delta.get("n", 0))
        out = {k: v for k, v in request.items() if k != "transcript"}
        with self._lock:
            known = dict(self._extras.get(key) or {})
        events: list[Event] | None = None
        for name, m in (delta.get("same") or {}).items():
            hit = known.get(name)
            if hit is not None and hit[0] == m:
                out[name] = hit[1]
                continue
            if events is None:
                events = _read(history, run_id, m)
            out[name] = _request_of(events, step, delta.get("conversation"), int(m)).get(name)
            known[name] = (int(m), out[name])
        for name in out:
            if name not in (delta.get("same") or {}):
                known[name] = (n, out[name])
        with self._lock:
            self._extras[key] = known
            self._extras.move_to_end(key)
            while len(self._extras) > self.size:
                self._extras.popitem(last=False)
        return out


def _read(history: Callable[..., list[Event]] | None, run_id: str, n: int) -> list[Event]:
    try:
        if history is None:
            raise ValidationError("no reader of histories was given")
        return history(run_id)
    except ValidationError as e:
        raise TranscriptError(
            f"request {n} of run {run_id!r} is not in this process and it cannot read the "
            f"run's history ({e})"
        ) from None


def _common_prefix(
    messages: Sequence[Any], prev: Sequence[Any], same: Callable[[Any, Any], bool] | None
) -> int:
    """How many of ``messages`` are the ``same`` as those at the same place in ``prev`` (None:
    the same objects). Every request walks the whole transcript here: identity is compared
    inline, a call per message only for a framework that compares by equality."""
    limit = min(len(messages), len(prev))
    keep = 0
    if same is None:
        while keep < limit and messages[keep] is prev[keep]:
            keep += 1
        return keep
    while keep < limit and same(messages[keep], prev[keep]):
        keep += 1
    return keep


def _long_strings(value: Any) -> list[str]:
    """The strings of at least :data:`LONG` characters in a JSON value."""
    if isinstance(value, str):
        return [value] if len(value) >= LONG else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _long_strings(v)]
    if isinstance(value, list):
        return [t for v in value for t in _long_strings(v)]
    return []


def strings_of(events: list[Event]) -> dict[str, str]:
    """The long strings of the step results among ``events``, by the digest a delta's
    ``"values"`` names them with (the console's transcript resolves them with it too)."""
    return {
        _sha(text): text
        for ev in events
        if ev.kind == h.STEP_COMPLETED
        for text in _long_strings(ev.data.get("result"))
    }


def _cut(value: Any, at: list[Any], found: list[dict[str, Any]], known: dict[str, str]) -> Any:
    """``value`` with its strings in ``known`` (text -> digest) replaced by None, each noted in
    ``found`` with where it was."""
    if isinstance(value, str):
        sha = known.get(value) if len(value) >= LONG else None
        if sha is None:
            return value
        found.append({"at": at, "sha": sha})
        return None
    if isinstance(value, dict):
        return {k: _cut(v, [*at, k], found, known) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v, [*at, j], found, known) for j, v in enumerate(value)]
    return value


def _known(strings: dict[str, str], sha: str) -> str:
    if sha not in strings:
        raise TranscriptError(
            f"a message refers to a step's result (sha256 {sha}...) that the run's history "
            "does not hold"
        )
    return strings[sha]


def _fill(
    append: list[Any], values: list[dict[str, Any]], string: Callable[[str], str]
) -> list[Any]:
    """``append`` with the strings ``values`` names (see :data:`Delta`) in their places."""
    out = copy.deepcopy(append)
    for value in values:
        *path, last = value["at"]
        if not path:
            out[int(last)] = string(value["sha"])
            continue
        node = out
        for key in path:
            node = node[key]
        node[last] = string(value["sha"])
    return out


def _at(result: Any, ref: dict[str, Any]) -> Any:
    value = result
    for step in ref.get("path") or []:
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _sha(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str))


def _expand(
    append: list[Any], refs: dict[str, Any], answer: Callable[[int, str | None], Any]
) -> list[Any]:
    """``append`` with the messages ``refs`` stands for (see :data:`Delta`) in their places."""
    out = list(append)
    for index, ref in refs.items():
        value = _at(answer(int(ref["n"]), None), ref)
        if ref.get("sha") and _sha(value) != ref["sha"]:
            value = _at(answer(int(ref["n"]), ref["sha"]), ref)
        if not isinstance(value, dict):
            raise TranscriptError(f"a message refers to {ref!r}, which is not a message")
        message = {k: v for k, v in value.items() if k not in set(ref.get("drop") or [])}
        message.update(ref.get("set") or {})
        out[int(index)] = message
    return out


def _scheduled_requests(
    events: list[Event], step: str | None, conversation: Any
) -> dict[int, tuple[int | None, dict[str, Any]]]:
    """Each request of ``conversation`` the history holds, by number: its step's position and
    the step's argument that holds it (its ``"transcript"`` and other entries)."""
    found: dict[int, tuple[int | None, dict[str, Any]]] = {}
    for ev in events:
        if ev.kind != h.STEP_SCHEDULED or (step is not None and ev.name != step):
            continue
        for arg in (ev.data.get("args") or {}).values():
            delta = arg.get("transcript") if isinstance(arg, dict) else None
            if isinstance(delta, dict) and delta.get("conversation") == conversation:
                found[int(delta.get("n", 0))] = (ev.pos, arg)
    return found


def _request_of(events: list[Event], step: str | None, conversation: Any, n: int) -> dict[str, Any]:
    found = _scheduled_requests(events, step, conversation).get(n)
    if found is None:
        raise TranscriptError(f"no request {n} of {conversation!r} in the run's history")
    return found[1]


def _result_of(events: list[Event], step: str | None, conversation: Any, n: int) -> Any:
    """The recorded result of the step that made request ``n`` of ``conversation``."""
    found = _scheduled_requests(events, step, conversation).get(n)
    if found is not None:
        for ev in events:
            if ev.kind == h.STEP_COMPLETED and ev.pos == found[0]:
                return ev.data.get("result")
    raise TranscriptError(
        f"a message of {conversation!r} refers to the response to request {n}, which the "
        "run's history does not hold"
    )


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
    strings: dict[str, str] | None = None
    for pos in reversed(chain):
        d = deltas[pos]
        append = list(d.get("append", []))
        if d.get("refs"):
            append = _expand(
                append, d["refs"], lambda n, _: _result_of(events, step, conversation, n)
            )
        if d.get("values"):
            strings = strings_of(events) if strings is None else strings
            append = _fill(append, d["values"], partial(_known, strings))
        messages = [*messages[: int(d.get("keep", 0))], *append]
    return messages
