"""Moved to ``sagaloop.runtime.takeover``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.takeover import SHOWN as SHOWN
from sagaloop.runtime.takeover import STALE_AFTER as STALE_AFTER
from sagaloop.runtime.takeover import Registry as Registry
from sagaloop.runtime.takeover import Takeover as Takeover
from sagaloop.runtime.takeover import host_identity as host_identity
from sagaloop.runtime.takeover import machine as machine
from sagaloop.runtime.takeover import pid_alive as pid_alive
from sagaloop.runtime.takeover import start_of as start_of
from sagaloop.runtime.takeover import verdict as verdict
