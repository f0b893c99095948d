"""Large values travel by reference: the payload table.

A value whose JSON is over :data:`OFFLOAD_BYTES` is written once per run to ``sagaloop_payloads``
(its JSON text zlib-compressed, keyed by the run and the sha256 of that text) and replaced where
it stood by a small reference::

    {"$sagaloop": "payload", "sha256": "<64 hex digits>", "size": <bytes of JSON>}

The store does it on the way in and undoes it on the way out, so the engine, workers and
user services only ever see whole values. The places, and only these, are:

- the top-level values of a message's ``payload`` (a step's ``args`` and ``result``, a reply's
  ``result`` and ``error``, a start's ``input``, an event's ``data``), when the message body
  is over the threshold: the largest first, until it is under it;
- the same for the ``data`` of a history event (``input``, ``args``, ``result``, ``output``);
- a run's ``input`` and ``output``, and the result stored in an inbox row, as a whole.

So no message body and no row holds a large JSON text inline, and the relay never meets a
message over the broker's limit. A value up to ``MAX_VALUE_BYTES`` (``sagas/convert.py``) can
be offloaded; a larger one is refused where it is produced, failing the step or saga.

The key ``$sagaloop`` is reserved in those places: a user value that is an object with that key
is stored escaped as ``{"$sagaloop": "literal", "value": ...}`` and comes back unchanged, so no
value can be mistaken for a reference. (A raw JSON message published without sagaloop's
client must not use the key there: a reference that does not resolve is dead-lettered.)

Inbox rows know no run: their payloads belong to a pseudo run id derived from the inbox key
(:func:`inbox_owner`), deleted with the row. Payloads of a run are deleted with the run.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope
from sagaloop.engine.ports import RunRecord
from sagaloop.errors import MessageError, StoreError
from sagaloop.store import tables as t

MARK = "$sagaloop"
"""The reserved key of references (and of escaped user values) in the places listed above."""
OFFLOAD_BYTES = 64 * 1024
"""A message body, history event or value whose JSON is over this many bytes has its large
values moved to the payload table."""
COMPRESSION_LEVEL = 6

Key = tuple[str, str]
"""(run_id, sha256): the primary key of a payload row."""

_REF_BYTES = 120  # about the JSON of a reference: offloading anything smaller gains nothing
_c = t.payloads.c


class PayloadError(StoreError):
    """A reference whose payload is missing, or malformed (a row deleted by hand?)."""


def encode(value: Any) -> bytes:
    """The JSON text that payloads store and hash: compact UTF-8 (lossless for any value
    that json accepts, a lone surrogate included)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"
    )


def decode(data: bytes) -> Any:
    return json.loads(zlib.decompress(data).decode("utf-8", "surrogatepass"))


def inbox_owner(consumer: str, message_id: str) -> str:
    """The pseudo run id that owns the payloads of the inbox row (consumer, message_id)."""
    digest = hashlib.sha256(f"{consumer}\x00{message_id}".encode("utf-8", "surrogatepass"))
    return "inbox~" + digest.hexdigest()[:48]


def marked(value: Any) -> bool:
    """Whether a stored value is a reference or an escaped value (to resolve)."""
    return isinstance(value, dict) and MARK in value


def _escape(value: Any) -> Any:
    return {MARK: "literal", "value": value} if marked(value) else value


# --- on the way in ---------------------------------------------------------------------------


class Offloader:
    """Replaces large values by references, collecting the payload rows to write; call
    :meth:`flush` in the transaction that writes the rows holding the references."""

    def __init__(self) -> None:
        self.rows: dict[Key, tuple[bytes, int]] = {}

    def _reference(self, run_id: str, text: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(text).hexdigest()
        key = (run_id, digest)
        if key not in self.rows:
            self.rows[key] = (zlib.compress(text, COMPRESSION_LEVEL), len(text))
        return {MARK: "payload", "sha256": digest, "size": len(text)}

    def value(self, run_id: str, value: Any) -> Any:
        """``value`` as a row stores it: escaped if marked, a reference if large."""
        if value is None or isinstance(value, bool | int | float):
            return value
        text = encode(value)
        if len(text) > OFFLOAD_BYTES:
            return self._reference(run_id, text)
        return _escape(value)

    def fields(self, run_id: str, fields: Mapping[str, Any], budget: int = OFFLOAD_BYTES) -> Any:
        """``fields`` (a message payload, an event's data) with marked values escaped and, if
        their JSON is over ``budget``, the largest values replaced by references until it is
        not (values no larger than a reference stay)."""
        out = {k: _escape(v) for k, v in fields.items()}
        texts = {k: encode(v) for k, v in fields.items()}  # a payload holds the value as given
        total = sum(len(k) + len(v) + 4 for k, v in texts.items())
        for k in sorted(texts, key=lambda k: len(texts[k]), reverse=True):
            if total <= budget or len(texts[k]) <= _REF_BYTES:
                break
            out[k] = self._reference(run_id, texts[k])
            total -= len(texts[k]) - _REF_BYTES
        return out

    def data(self, run_id: str, data: Mapping[str, Any]) -> Any:
        """A history event's ``data`` as its row stores it (itself when small and unmarked)."""
        if not marked_fields(data) and len(encode(data)) <= OFFLOAD_BYTES:
            return data
        return self.fields(run_id, data)

    def message(self, env: Envelope) -> bytes:
        """The body to send for ``env``: as it is, unless it is over the threshold or holds
        marked values. :class:`~sagaloop.errors.MessageError` if it stays over the broker
        limit even with its large values offloaded (the producer fails; nothing is sent)."""
        body = env.to_bytes()
        payload = env.payload
        if len(body) <= OFFLOAD_BYTES and not marked_fields(payload):
            return body
        packed = self.fields(env.run_id, payload)
        body = env.model_copy(update={"payload": packed}).to_bytes()
        if len(body) > MAX_MESSAGE_BYTES:
            raise MessageError(
                f"the {env.type} message {env.message_id!r} of run {env.run_id!r} would be "
                f"{len(body)} bytes even with its large values in the payload table, over the "
                f"limit of {MAX_MESSAGE_BYTES}: too many fields, or a long trace or saga name"
            )
        return body

    def flush(self, conn: Connection, now: datetime) -> None:
        """Write the collected payload rows (an existing row, the same value, is kept)."""
        if not self.rows:
            return
        rows = [
            {"run_id": r, "hash": h, "data": data, "size": size, "created_at": now}
            for (r, h), (data, size) in sorted(self.rows.items())  # one lock order
        ]
        self.rows = {}
        conn.execute(_insert_ignore(conn.dialect.name), rows)


def _insert_ignore(dialect: str) -> Any:
    stmt = _INSERTS.get(dialect)
    if stmt is None:
        insert: Any = {"postgresql": pg_insert, "sqlite": sqlite_insert}.get(dialect)
        if insert is None:
            raise StoreError(f"payloads need SQLite or PostgreSQL, not {dialect}")
        stmt = _INSERTS[dialect] = insert(t.payloads).on_conflict_do_nothing()
    return stmt


_INSERTS: dict[str, Any] = {}


# --- on the way out --------------------------------------------------------------------------


def references(value: Any, run_id: str, into: set[Key]) -> bool:
    """Add the payload key ``value`` refers to, if it is a reference, to ``into``; True if
    ``value`` is marked (a reference or an escaped value) and needs :func:`resolve`."""
    if not marked(value):
        return False
    if value.get(MARK) == "payload" and isinstance(value.get("sha256"), str):
        into.add((run_id, value["sha256"]))
    return True


def field_references(fields: Mapping[str, Any], run_id: str, into: set[Key]) -> bool:
    marked = False
    for value in fields.values():
        marked = references(value, run_id, into) or marked
    return marked


def load(conn: Connection, keys: Iterable[Key]) -> dict[Key, Any]:
    """The values of these payloads, in one query; a missing one is absent."""
    keys = set(keys)
    if not keys:
        return {}
    runs = {r for r, _ in keys}
    q = sa.select(_c.run_id, _c.hash, _c.data)
    if len(runs) == 1:
        q = q.where(_c.run_id == next(iter(runs)), _c.hash.in_(sorted(h for _, h in keys)))
    else:
        q = q.where(sa.tuple_(_c.run_id, _c.hash).in_(sorted(keys)))
    return {(r.run_id, r.hash): decode(bytes(r.data)) for r in conn.execute(q)}


def resolve(value: Any, run_id: str, loaded: Mapping[Key, Any]) -> Any:
    """``value`` as it was given: a reference's payload, an escaped value unwrapped."""
    if not marked(value):
        return value
    kind = value.get(MARK)
    if kind == "literal" and set(value) == {MARK, "value"}:
        return value["value"]
    if kind == "payload" and (run_id, value.get("sha256")) in loaded:
        return loaded[(run_id, value["sha256"])]
    if kind == "payload":
        raise PayloadError(
            f"payload {value.get('sha256')!r} of run {run_id!r} is not in the database: was "
            "the run pruned, or does this process use another database than the one that "
            "wrote it?"
        )
    raise PayloadError(
        f"a value of run {run_id!r} is an object with the reserved key {MARK!r} that is "
        "neither a payload reference nor an escaped value"
    )


def resolve_fields(fields: Mapping[str, Any], run_id: str, loaded: Mapping[Key, Any]) -> Any:
    return {k: resolve(v, run_id, loaded) for k, v in fields.items()}


def resolve_message(conn: Connection, env: Envelope) -> Envelope:
    """``env`` with its payload's references resolved (itself when it holds none)."""
    keys: set[Key] = set()
    if not field_references(env.payload, env.run_id, keys):
        return env
    try:
        payload = resolve_fields(env.payload, env.run_id, load(conn, keys))
    except PayloadError as e:
        raise MessageError(f"message {env.message_id!r}: {e}") from e
    return env.model_copy(update={"payload": payload})


def delete(conn: Connection, owners: Iterable[str]) -> None:
    """Delete the payloads of these runs (or inbox rows: see :func:`inbox_owner`)."""
    owners = list(owners)
    if owners:
        conn.execute(t.payloads.delete().where(_c.run_id.in_(owners)))


def marked_fields(fields: Mapping[str, Any]) -> bool:
    """Whether any top-level value of ``fields`` is a reference or an escaped value."""
    return any(map(marked, fields.values()))


def resolve_value(conn: Connection, run_id: str, value: Any) -> Any:
    """One stored value (a run's input, an inbox result) as it was given."""
    keys: set[Key] = set()
    if not references(value, run_id, keys):
        return value
    return resolve(value, run_id, load(conn, keys))


def resolve_datas(conn: Connection, run_id: str, datas: list[Any]) -> list[Any]:
    """The ``data`` of a run's history events as given, its payloads loaded in one query."""
    keys: set[Key] = set()
    marked = [isinstance(d, dict) and field_references(d, run_id, keys) for d in datas]
    if not any(marked):
        return datas
    loaded = load(conn, keys)
    return [
        resolve_fields(d, run_id, loaded) if m else d for d, m in zip(datas, marked, strict=True)
    ]


def resolve_runs(conn: Connection, runs: list[RunRecord]) -> list[RunRecord]:
    """The runs with their input and output as given (in place), in one query."""
    keys: set[Key] = set()
    marked = []
    for run in runs:
        input_marked = references(run.input, run.run_id, keys)
        if references(run.output, run.run_id, keys) or input_marked:
            marked.append(run)
    if marked:
        loaded = load(conn, keys)
        for run in marked:
            run.input = resolve(run.input, run.run_id, loaded)
            run.output = resolve(run.output, run.run_id, loaded)
    return runs
