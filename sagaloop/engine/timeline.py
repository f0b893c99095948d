"""Moved to ``sagaloop.client.timeline``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.client.timeline import KeptLine as KeptLine
from sagaloop.client.timeline import RefusedLine as RefusedLine
from sagaloop.client.timeline import StepLine as StepLine
from sagaloop.client.timeline import Timeline as Timeline
from sagaloop.client.timeline import WaitLine as WaitLine
from sagaloop.client.timeline import short_json as short_json
from sagaloop.client.timeline import timeline as timeline
