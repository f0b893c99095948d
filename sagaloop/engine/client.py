"""Moved to ``sagaloop.client.client``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.client.client import LIVE as LIVE
from sagaloop.client.client import Client as Client
