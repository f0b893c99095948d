"""Moved to ``sagaloop.runtime.crashpoints``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.crashpoints import POINTS as POINTS
from sagaloop.runtime.crashpoints import CrashPointRaised as CrashPointRaised
from sagaloop.runtime.crashpoints import arm as arm
from sagaloop.runtime.crashpoints import crash_point as crash_point
from sagaloop.runtime.crashpoints import disarm as disarm
