"""The envelope's fast path (issue 27) refuses and accepts exactly what the slow one does: the
byte scans that spare ``Envelope.from_bytes`` its walk over every value. (``derived_id``'s
escaping is pinned too: a shortcut for parts without ``:`` was measured slower, as most ids
joined are derived ids, colons and all.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from sagaloop.engine import messages
from sagaloop.engine.messages import MAX_DEPTH, Envelope, derived_id
from sagaloop.errors import MessageError


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"k": [value]} if depth % 2 else [value]
    return value


def _body(data: Any, **extra: Any) -> bytes:
    env = {"type": "event", "run_id": "r", "payload": {"name": "go", "data": data}, **extra}
    return json.dumps(env).encode()


def _slow(body: bytes) -> str:
    """What the walk says of ``body``: ``ok`` or the refusal."""
    try:
        messages._check_values(json.loads(body))
    except MessageError as e:
        return e.reason
    return "ok"


def _outcome(body: bytes) -> str:
    try:
        Envelope.from_bytes(body)
    except MessageError as e:
        return e.reason
    return "ok"


def _kind(reason: str) -> str:
    return next((w for w in ("surrogate", "deeper") if w in reason), "other")


BODIES = [
    _body("plain"),
    _body("\ud800".encode("utf-16", "surrogatepass").decode("utf-16", "surrogatepass")),
    b'{"type":"event","run_id":"r","payload":{"name":"\\ud800"}}',
    b'{"type":"event","run_id":"r","payload":{"name":"\\uDFFF"}}',
    b'{"type":"event","run_id":"r","payload":{"name":"\\uDbFf"}}',
    b'{"type":"event","run_id":"r","payload":{"\\udc00":"key"}}',
    b'{"type":"event","run_id":"r","payload":{"name":"\\ud83d\\ude00"}}',  # a pair: fine
    b'{"type":"event","run_id":"r","payload":{"name":"\\\\ud800"}}',  # an escaped backslash
    b'{"type":"event","run_id":"r","payload":{"name":"\\ucafe"}}',
    _body(_nested(MAX_DEPTH - 3)),
    _body(_nested(MAX_DEPTH - 2)),
    _body(_nested(MAX_DEPTH - 1)),
    _body(_nested(MAX_DEPTH)),
    _body([[[]]] * 200),  # many containers, shallow
    _body("[{" * 300),  # brackets in a string only
    '{"type":"event","run_id":"r","payload":{"name":"\\ud800"}}'.encode("utf-16"),
    '{"type":"event","run_id":"r","payload":{"name":"\\ud800"}}'.encode("utf-32-le"),
    '{"type":"event","run_id":"r","payload":{"name":"x"}}'.encode("utf-16-be"),
    b'\xef\xbb\xbf{"type":"event","run_id":"r","payload":{"name":"\\ud800"}}',
]


@pytest.mark.parametrize("body", BODIES)
def test_from_bytes_refuses_what_the_walk_refuses(body: bytes) -> None:
    assert _kind(_outcome(body)) == _kind(_slow(body))


def test_the_bodies_cover_both_refusals_and_both_paths() -> None:
    slow = [_slow(b) for b in BODIES]
    assert any("surrogate" in r for r in slow) and any("deeper" in r for r in slow)
    plain = [messages._plain(b) for b in BODIES]
    assert any(plain) and not all(plain)
    assert all(r == "ok" for r, p in zip(slow, plain, strict=True) if p)


@pytest.mark.parametrize(
    "parts",
    [
        ("result", "run-1:3:do:1"),
        ("step", "run", 3, "do", 1),
        ("a%b", "c"),
        ("acct:7", "reply"),
        ("acct", "7:reply"),
        ("x" * 300, 1),
        ("%3A", ":"),
        (),
        ("",),
        ("a", ""),
    ],
)
def test_derived_id_escapes_as_it_always_did(parts: tuple[object, ...]) -> None:
    escaped = ":".join(str(p).replace("%", "%25").replace(":", "%3A") for p in parts)
    want = escaped if len(escaped) <= 200 else derived_id(escaped)
    if len(escaped) <= 200:
        assert derived_id(*parts) == want
    else:
        assert derived_id(*parts).startswith(escaped[:135] + "~")
