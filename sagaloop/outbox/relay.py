"""Moved to ``sagaloop.runtime.relay``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.relay import HANDOFF_LEASE as HANDOFF_LEASE
from sagaloop.runtime.relay import Relay as Relay
