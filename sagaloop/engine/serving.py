"""Moved to ``sagaloop.client.serving``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.client.serving import LIVE as LIVE
from sagaloop.client.serving import WAITING_STATES as WAITING_STATES
from sagaloop.client.serving import Serving as Serving
from sagaloop.client.serving import served as served
from sagaloop.client.serving import unserved as unserved
