"""Run concurrency keys: at most ``limit`` runs of a saga at once per key, and what a start
does at the limit (DBOS queues' ``concurrency``, Hatchet concurrency expressions, Inngest
``concurrency`` and ``singleton``). Declared with ``@app.saga(concurrency=Concurrency(...))``;
the engine enforces it (``engine/concurrency.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from sagaloop.errors import DeclarationError, ValidationError

AtLimit = Literal["queue", "cancel_in_progress", "cancel_new"]
AT_LIMIT: tuple[str, ...] = ("queue", "cancel_in_progress", "cancel_new")
MAX_KEY = 200
"""The longest key (characters) a key function may return."""


@dataclasses.dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` runs of the saga run their code at once per key.

    ``key``: a function of the run's input (as the saga receives it) returning a ``str`` or an
    ``int``, or None: one key for the whole saga. It must be deterministic: it is called when a
    start is processed and its result is stored with the slot.

    ``at_limit``, what a start does when its key has ``limit`` runs:

    * ``"queue"`` (the default): the run is recorded, its code starts once a slot is free;
      the runs of a key start in the order they were started.
    * ``"cancel_in_progress"``: the new run takes the slot of the key's longest-held one, which
      is cancelled (and compensated, as any cancel).
    * ``"cancel_new"``: the new run ends ``cancelled`` at once, its reason naming the key.
    """

    limit: int = 1
    key: Callable[[Any], Any] | None = None
    at_limit: AtLimit = "queue"

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise DeclarationError(f"Concurrency(limit={self.limit!r}): give an int >= 1")
        if self.key is not None and not callable(self.key):
            raise DeclarationError(
                f"Concurrency(key={self.key!r}): give a function of the input, or None for "
                "one key per saga"
            )
        if self.at_limit not in AT_LIMIT:
            raise DeclarationError(
                f"Concurrency(at_limit={self.at_limit!r}): give one of {', '.join(AT_LIMIT)}"
            )

    def key_of(self, value: Any) -> str:
        """The key of a run whose input is ``value``: ``""`` without a key function.
        Raises ValidationError when the key function fails or returns no str or int."""
        return key_of(self.key, value, "concurrency")


def key_of(fn: Callable[[Any], Any] | None, value: Any, what: str) -> str:
    """The key ``fn`` (a saga's ``what`` key function: concurrency, debounce) gives the input
    ``value`` as text, ``""`` when ``fn`` is None. Raises ValidationError when ``fn`` fails,
    returns no str or int, or a key longer than ``MAX_KEY`` characters or holding NUL."""
    if fn is None:
        return ""
    try:
        key = fn(value)
    except Exception as e:
        raise ValidationError(f"the {what} key function raised {type(e).__name__}: {e}") from e
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ValidationError(
            f"the {what} key function returned {type(key).__name__}: return a str or an int"
        )
    text = str(key)
    if len(text) > MAX_KEY or "\x00" in text:
        raise ValidationError(
            f"the {what} key {text[:40]!r}... is longer than {MAX_KEY} characters or holds "
            "NUL: return a shorter key (a hash, say)"
        )
    return text
