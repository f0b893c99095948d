"""Moved to ``sagaloop.runtime`` (split into ``consumers``, ``worker``, ``timers`` and
``delivery``); this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.consumers import CONFLICT_RETRIES as CONFLICT_RETRIES
from sagaloop.runtime.consumers import EngineConsumer as EngineConsumer
from sagaloop.runtime.delivery import MAX_FAILURES as MAX_FAILURES
from sagaloop.runtime.delivery import RETRY_DELAY as RETRY_DELAY
from sagaloop.runtime.delivery import decode as decode
from sagaloop.runtime.delivery import log_failure as log_failure
from sagaloop.runtime.delivery import run_extra as run_extra
from sagaloop.runtime.timers import TimerScheduler as TimerScheduler
from sagaloop.runtime.worker import LATE_WAKES as LATE_WAKES
from sagaloop.runtime.worker import MAX_GIVE_BACK as MAX_GIVE_BACK
from sagaloop.runtime.worker import RATE_WAIT as RATE_WAIT
from sagaloop.runtime.worker import STARTED as STARTED
from sagaloop.runtime.worker import WORKER_CONSUMER as WORKER_CONSUMER
from sagaloop.runtime.worker import WorkerConsumer as WorkerConsumer
