"""Moved to ``sagaloop.runtime.slots``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.slots import Job as Job
from sagaloop.runtime.slots import Slots as Slots
