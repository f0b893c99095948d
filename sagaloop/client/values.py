"""Values (inputs, results, published values, event data) shown to people: JSON, cut to a
budget at a value's edge with a visible marker, never in the middle of a number, a key or an
escape, so what is shown still reads as the JSON it comes from."""

from __future__ import annotations

import json
from typing import Any

MORE = "\x00…\x00"
"""What stands for the items left out, until the JSON is written (then ``…``)."""
_MORE_JSON = json.dumps(MORE, ensure_ascii=False)
MIN_CUT = 16
"""The fewest characters of a string inside a list or object kept when it is cut: with less
room the whole string is left out (a value alone is cut to what fits)."""


def clip_json(value: Any, limit: int = 200, *, indent: int | None = None) -> str:
    """``value`` as JSON, whole if it fits in ``limit`` characters; else cut: the items that
    fit are kept, the first that does not is cut if it is a string, list or object (a string
    ends with ``…`` inside its quotes) and the rest is one ``…`` in its list or object, whose
    brackets are closed; `` … (+N chars)`` follows, N the characters of the whole JSON not
    shown. ``indent``: pretty-printed (the budget is the compact form's)."""
    whole = json.dumps(value, ensure_ascii=False, default=str)
    if len(whole) <= limit:
        return whole if indent is None else _written(json.loads(whole), indent)
    kept = _clip(json.loads(whole), max(limit - 16, 8), least=1)[0]
    compact, text = _written(kept, None), _written(kept, indent)
    return f"{text} … (+{max(len(whole) - len(compact), 1)} chars)"


def _written(value: Any, indent: int | None) -> str:
    """``value`` as JSON with each :data:`MORE` written ``…`` (in an object: in place of a key
    and its value)."""
    text = json.dumps(value, ensure_ascii=False, indent=indent)
    return text.replace(f"{_MORE_JSON}: {_MORE_JSON}", "…").replace(_MORE_JSON, "…")


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def _clip(value: Any, room: int, least: int = MIN_CUT) -> tuple[Any, int, bool]:
    """``value`` cut to ``room`` characters of compact JSON: (what is kept, its length, whether
    it is whole). What cannot be kept at all is :data:`MORE`; a string is cut if at least
    ``least`` of its characters fit."""
    size = _size(value)
    if size <= room:
        return value, size, True
    if isinstance(value, str) and room >= 8:
        low, high = 0, min(len(value), room)  # the most characters that fit with "…"
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if _size(value[:mid]) + 1 <= room else (low, mid - 1)
        keep = low
        if keep >= least:  # else a stub, less legible than "…"
            cut = value[:keep] + "…"
            return cut, _size(cut), False
    if isinstance(value, list) and room >= 5:
        return _clip_items(list(enumerate(value)), room, keyed=False)
    if isinstance(value, dict) and room >= 5:
        return _clip_items(list(value.items()), room, keyed=True)
    return MORE, 1, False


def _clip_items(items: list[tuple[Any, Any]], room: int, *, keyed: bool) -> tuple[Any, int, bool]:
    """A list's (``keyed`` False) or an object's items, as many as fit in ``room``, then
    :data:`MORE` for the rest."""
    kept: list[tuple[Any, Any]] = []
    used = 2  # the brackets
    whole = True
    for i, (key, item) in enumerate(items):
        comma = 2 if kept else 0
        head = comma + (len(json.dumps(str(key), ensure_ascii=False)) + 2 if keyed else 0)
        left = room - used - head - (0 if i == len(items) - 1 else 3)  # ", …" for the rest
        part, size, whole = _clip(item, left) if left > 0 else (MORE, 1, False)
        if part is MORE:
            if keyed and left > 0:  # the key, and "…" for its value
                kept.append((key, MORE))
                used += head + 1
            break
        kept.append((key, part))
        used += head + size
        if not whole:
            break
    if len(kept) < len(items) or not whole:
        if len(kept) < len(items):
            kept.append((MORE, MORE))
            used += 3
        whole = False
    if keyed:
        return dict(kept), used, whole
    return [v for _, v in kept], used, whole
