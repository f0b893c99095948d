"""The start backlog limit ``Client.start`` enforces, and how a limit is read from the
environment (the engine's start window, ``sagaloop.runtime.admission``, reads its own the same
way)."""

from __future__ import annotations

import os

from sagaloop.errors import ValidationError

START_BACKLOG = 10_000
"""The default limit of an app's start backlog: runs started that no engine took up yet, past
which ``Client.start`` refuses new runs. ``SAGALOOP_START_BACKLOG`` sets another (``0``: no
limit)."""


def limit_from_env(name: str, value: int | None, default: int) -> int:
    """``value``, else the whole number in the environment's ``name``, else ``default``; 0 or
    more (0: no limit)."""
    if value is None:
        raw = os.environ.get(name, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise ValidationError(
                f"{name} must be a whole number of runs (0: no limit), not {raw!r}"
            ) from None
    if value < 0:
        raise ValidationError(f"{name} must be 0 (no limit) or more, not {value}")
    return value
