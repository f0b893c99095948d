"""Moved to ``sagaloop.runtime.lane``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.lane import LOCAL_LEASE as LOCAL_LEASE
from sagaloop.runtime.lane import LOOK_EVERY as LOOK_EVERY
from sagaloop.runtime.lane import Handoffs as Handoffs
from sagaloop.runtime.lane import LocalLane as LocalLane
