"""Debounce (Inngest's ``debounce: {period, key}``): the starts of a saga with the same key
that come within ``period`` of each other make one run, with the input of the last start,
started ``period`` after that last start (or ``max_wait`` after the window's first start).
Declared with ``@app.saga(debounce=Debounce(...))``; :meth:`Client.start` records the start
(``runtime/debounce.py`` starts the run when it is due)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sagaloop.errors import DeclarationError
from sagaloop.sagas.concurrency import key_of


def _duration(value: Any, what: str) -> timedelta:
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise DeclarationError(f"Debounce({what}={value!r}): give a timedelta or seconds")
    period = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if period <= timedelta(0):
        raise DeclarationError(f"Debounce({what}={value!r}): give a duration > 0")
    return period


@dataclasses.dataclass(frozen=True)
class Debounce:
    """Starts of the saga with one key within ``period`` of each other make one run.

    ``period``: a ``timedelta`` (or seconds). The window's run starts ``period`` after its
    last start, with that start's input (the last input wins).

    ``key``: a function of the start's input (as the saga receives it) returning a ``str`` or
    an ``int``, or None: one key for the whole saga. Windows of different keys are independent.

    ``max_wait``: the run starts at the latest this long after the window's first start, even
    while starts keep coming (None: no bound; a steady stream of starts then never runs)."""

    period: timedelta | float
    key: Callable[[Any], Any] | None = None
    max_wait: timedelta | float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "period", _duration(self.period, "period"))
        if self.max_wait is not None:
            object.__setattr__(self, "max_wait", _duration(self.max_wait, "max_wait"))
        if self.key is not None and not callable(self.key):
            raise DeclarationError(
                f"Debounce(key={self.key!r}): give a function of the input, or None for one "
                "key per saga"
            )

    @property
    def wait(self) -> timedelta:
        """``period`` as a timedelta."""
        assert isinstance(self.period, timedelta)
        return self.period

    @property
    def bound(self) -> timedelta | None:
        """``max_wait`` as a timedelta, or None."""
        assert self.max_wait is None or isinstance(self.max_wait, timedelta)
        return self.max_wait

    def key_of(self, value: Any) -> str:
        """The key of a start whose input is ``value``: ``""`` without a key function.
        Raises ValidationError when the key function fails or returns no str or int."""
        return key_of(self.key, value, "debounce")
