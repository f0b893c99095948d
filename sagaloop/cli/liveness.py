"""Moved to ``sagaloop.runtime.liveness``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.liveness import RUN_DIR_ENV as RUN_DIR_ENV
from sagaloop.runtime.liveness import STALE_AFTER as STALE_AFTER
from sagaloop.runtime.liveness import Beat as Beat
from sagaloop.runtime.liveness import Live as Live
from sagaloop.runtime.liveness import Verdict as Verdict
from sagaloop.runtime.liveness import judge as judge
from sagaloop.runtime.liveness import read_all as read_all
from sagaloop.runtime.liveness import remove as remove
from sagaloop.runtime.liveness import run_dir as run_dir
from sagaloop.runtime.liveness import write as write
