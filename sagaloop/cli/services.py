"""Moved to ``sagaloop.runtime.service``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.service import EXIT_ACCESS_REFUSED as EXIT_ACCESS_REFUSED
from sagaloop.runtime.service import EXIT_THREAD_DIED as EXIT_THREAD_DIED
from sagaloop.runtime.service import GRACE as GRACE
from sagaloop.runtime.service import MAX_BACKOFF as MAX_BACKOFF
from sagaloop.runtime.service import Runtime as Runtime
