"""Executing one attempt of a step, its compensation or its reconcile function.

This module knows nothing of queues or transactions: it turns a ``step`` message into the
payload of its ``step_result`` reply. The worker service (and the engine, for local steps) wrap
it with the inbox, the outbox and the acknowledgement.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
from collections.abc import Callable
from typing import Any

from sagaloop.engine.messages import Envelope, derived_id
from sagaloop.errors import ErrorInfo, SagaloopError, UnknownStepError, ValidationError
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.context import StepContext

logger = logging.getLogger("sagaloop.step")

DO = "do"
UNDO = "undo"


def idempotency_key(run_id: str, pos: int, direction: str) -> str:
    return f"{run_id}/{pos}/{direction}"


def task_message_id(run_id: str, pos: int, direction: str, attempt: int) -> str:
    return derived_id("step", run_id, pos, direction, attempt)


class StepTimeoutError(SagaloopError):
    """An attempt ran past the step's timeout; it may still take effect (in doubt)."""


class _StepContext(StepContext):
    def __init__(self, task: Envelope, step: StepDef[Any, Any], in_doubt: bool) -> None:
        self.run_id = task.run_id
        self.saga = task.saga or ""
        self.step = step.name
        self.position = task.position or 0
        self.attempt = task.attempt or 1
        self.in_doubt = in_doubt
        self.idempotency_key = task.idempotency_key or ""
        self.logger = logging.LoggerAdapter(
            logger, {"run_id": self.run_id, "step": self.step, "attempt": self.attempt}
        )


def _invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = fn(*args, **kwargs)
    if asyncio.iscoroutine(result):
        return asyncio.run(result)
    return result


class StepRunner:
    """Runs the attempts of a step with a timeout on a thread pool, so that the timeout can be
    enforced and a stuck step never blocks its consumer: a timed-out attempt is reported as
    failed *in doubt*; its thread is left to finish and its late result is discarded. Attempts
    of a step without a timeout run on the caller's thread (nothing to enforce)."""

    def __init__(
        self, app: App, *, threads: int = 8, worker: str = "worker", inline: bool = False
    ) -> None:
        self.app = app
        self.worker = worker
        self.inline = inline
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="step")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(
        self, task: Envelope, *, redelivered: bool = False, inline: bool = False
    ) -> dict[str, Any]:
        """Run one attempt and return the ``step_result`` payload."""
        p = task.payload
        step = self.app.get_step(str(p.get("step")))
        if step is None:
            raise UnknownStepError(str(p.get("step")))
        direction = p.get("direction", DO)
        in_doubt = bool(p.get("in_doubt")) or redelivered
        inline = inline or self.inline
        ctx = _StepContext(task, step, in_doubt)
        reply: dict[str, Any] = {"direction": direction, "worker": self.worker}
        try:
            args = step.signature.args_from_json(p.get("args", {}), what=f"step {step.name!r}")
            if direction == DO:
                reply.update(self._do(step, ctx, args, in_doubt, bool(p.get("force")), inline))
            else:
                reply.update(self._undo(step, ctx, args, p.get("result"), in_doubt, inline))
        except ValidationError as e:
            info = ErrorInfo.from_exception(e)
            info.non_retryable = True
            reply.update(outcome="failed", error=info.to_json())
        except Exception as e:
            ctx.logger.warning("attempt %s of step %s failed: %r", ctx.attempt, step.name, e)
            reply.update(outcome="failed", error=ErrorInfo.from_exception(e).to_json())
        return reply

    def _do(
        self,
        step: StepDef[Any, Any],
        ctx: _StepContext,
        args: dict[str, Any],
        in_doubt: bool,
        force: bool,
        inline: bool,
    ) -> dict[str, Any]:
        if in_doubt and not force:
            if step.reconcile_fn is not None:
                found = self._call(step, inline, step.reconcile_fn, ctx, **args)
                if found is not None:
                    ctx.logger.info(
                        "step %s reconciled: the earlier attempt took effect", step.name
                    )
                    result = step.result.to_json(found, what=f"reconciled result of {step.name!r}")
                    return {"outcome": "completed", "result": result, "reconciled": True}
            elif not step.idempotent:
                reason = (
                    f"step {step.name!r} is declared idempotent=False and has no reconcile; an "
                    f"earlier attempt may have taken effect, so attempt {ctx.attempt} was not "
                    "run. Check the effect by hand, then `sagaloop retry` the run."
                )
                return {"outcome": "halted", "error": ErrorInfo("InDoubt", reason).to_json()}
        value = self._call(step, inline, step.fn, ctx, **args)
        return {
            "outcome": "completed",
            "result": step.result.to_json(value, what=f"result of {step.name!r}"),
        }

    def _undo(
        self,
        step: StepDef[Any, Any],
        ctx: _StepContext,
        args: dict[str, Any],
        result_json: Any,
        in_doubt: bool,
        inline: bool,
    ) -> dict[str, Any]:
        assert step.compensation_fn is not None
        result: Any = None
        if result_json is not None:
            result = step.result.from_json(result_json, what=f"result of {step.name!r}")
        elif in_doubt and step.reconcile_fn is not None:
            # The step failed after an attempt whose outcome is unknown: undo only what happened.
            # The look-up is about the step's attempts, so it gets the step's own key.
            look_up = copy.copy(ctx)
            look_up.idempotency_key = idempotency_key(ctx.run_id, ctx.position, DO)
            result = self._call(step, inline, step.reconcile_fn, look_up, **args)
            if result is None:
                return {"outcome": "completed", "result": None, "skipped": True}
        self._call(step, inline, step.compensation_fn, ctx, *args.values(), result)
        return {"outcome": "completed", "result": None}

    def _call(
        self, step: StepDef[Any, Any], inline: bool, fn: Callable[..., Any], *a: Any, **kw: Any
    ) -> Any:
        if inline or step.timeout is None:
            return _invoke(fn, *a, **kw)
        future = self._pool.submit(_invoke, fn, *a, **kw)
        try:
            return future.result(step.timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            raise StepTimeoutError(
                f"step {step.name!r} did not finish within {step.timeout}"
            ) from None
