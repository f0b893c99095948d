"""Moved to ``sagaloop.runtime.local``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.local import LocalWorker as LocalWorker
