"""Moved to ``sagaloop.runtime.consumers``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.runtime.consumers import CONFLICT_RETRIES as CONFLICT_RETRIES
from sagaloop.runtime.consumers import LATE_WAKES as LATE_WAKES
from sagaloop.runtime.consumers import MAX_FAILURES as MAX_FAILURES
from sagaloop.runtime.consumers import MAX_GIVE_BACK as MAX_GIVE_BACK
from sagaloop.runtime.consumers import RATE_WAIT as RATE_WAIT
from sagaloop.runtime.consumers import RETRY_DELAY as RETRY_DELAY
from sagaloop.runtime.consumers import STARTED as STARTED
from sagaloop.runtime.consumers import WORKER_CONSUMER as WORKER_CONSUMER
from sagaloop.runtime.consumers import EngineConsumer as EngineConsumer
from sagaloop.runtime.consumers import TimerScheduler as TimerScheduler
from sagaloop.runtime.consumers import WorkerConsumer as WorkerConsumer
from sagaloop.runtime.consumers import decode as decode
from sagaloop.runtime.consumers import log_failure as log_failure
from sagaloop.runtime.consumers import run_extra as run_extra
