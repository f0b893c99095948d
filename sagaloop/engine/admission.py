"""Moved to ``sagaloop.runtime.admission``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.client.admission import START_BACKLOG as START_BACKLOG
from sagaloop.client.admission import limit_from_env as limit_from_env
from sagaloop.runtime.admission import START_WINDOW as START_WINDOW
from sagaloop.runtime.admission import StartGate as StartGate
