"""Moved to ``sagaloop.runtime.steps``; this name is kept for one release."""

from __future__ import annotations

from sagaloop.engine.contract import DO as DO
from sagaloop.engine.contract import UNDO as UNDO
from sagaloop.engine.contract import UNENCODABLE_RESULT as UNENCODABLE_RESULT
from sagaloop.engine.contract import idempotency_key as idempotency_key
from sagaloop.engine.contract import task_message_id as task_message_id
from sagaloop.runtime.steps import AttemptNotStarted as AttemptNotStarted
from sagaloop.runtime.steps import Beat as Beat
from sagaloop.runtime.steps import History as History
from sagaloop.runtime.steps import StepRunner as StepRunner
from sagaloop.runtime.steps import StepTimeoutError as StepTimeoutError
from sagaloop.runtime.steps import _StepContext as _StepContext
from sagaloop.runtime.steps import current_step as current_step
