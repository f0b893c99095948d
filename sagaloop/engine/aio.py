"""Moved to ``sagaloop.runtime.aio``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.aio import loop as loop
from sagaloop.runtime.aio import run as run
