"""Moved to ``sagaloop.runtime.registry``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.registry import LIVE_WITHIN as LIVE_WITHIN
from sagaloop.runtime.registry import MAX_PROBLEM as MAX_PROBLEM
from sagaloop.runtime.registry import PRUNE_AFTER as PRUNE_AFTER
from sagaloop.runtime.registry import RECENT_PROBLEM as RECENT_PROBLEM
from sagaloop.runtime.registry import SEEN_EVERY as SEEN_EVERY
from sagaloop.runtime.registry import ProcessRegistry as ProcessRegistry
from sagaloop.runtime.registry import Registration as Registration
from sagaloop.runtime.registry import abandoned_text as abandoned_text
from sagaloop.runtime.registry import assess as assess
from sagaloop.runtime.registry import describe as describe
from sagaloop.runtime.registry import fleet as fleet
