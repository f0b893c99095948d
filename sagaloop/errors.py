"""sagaloop's exceptions: one root, a small tree per area.

Errors that cross a process boundary (a step failing on a worker, a run that failed) are stored
in the history as :class:`ErrorInfo` and come back as the same Python type on the other side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from datetime import timedelta
from types import CodeType
from typing import Any

from sagaloop._tracebacks import FOLDED_PACKAGES as FOLDED_PACKAGES
from sagaloop._tracebacks import causes_of, message_of, storable, traceback_text


class SagaloopError(Exception):
    """Root of every exception raised by sagaloop itself."""


# --- declaration and input -------------------------------------------------------------------


class DeclarationError(SagaloopError):
    """A saga or step is declared wrongly (duplicate name, bad signature, missing annotation)."""


class InvalidRateLimit(DeclarationError, ValueError):
    """A step's ``rate_limit`` or ``rate_key`` is not valid (a ``ValueError`` too)."""


class ValidationError(SagaloopError):
    """An input, result or event payload does not match the declared type."""


class UnencodableError(ValidationError):
    """A value cannot be stored or sent as JSON: a string holding a lone surrogate, an integer
    over Python's digit limit, NaN or Infinity, nesting too deep, or over the size limit."""


class UnknownSagaError(SagaloopError):
    """No saga of that name is registered in the app."""

    def __init__(self, name: str, known: list[str]) -> None:
        hint = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown saga {name!r} (registered: {hint})")
        self.saga = name


class UnknownStepError(SagaloopError):
    """A message names a step that this process does not know."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown step {name!r}: is the worker running the same app version?")
        self.step = name


class RunNotFoundError(SagaloopError):
    def __init__(self, run_id: str, detail: str | None = None) -> None:
        super().__init__(f"no run with id {run_id!r}" + (f" yet: {detail}" if detail else ""))
        self.run_id = run_id


class RunFinishedError(SagaloopError):
    """An event or cancellation was addressed to a run that has already finished."""

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(f"run {run_id!r} is already {status}")
        self.run_id = run_id
        self.status = status


class RunStateError(SagaloopError):
    """The operation does not apply to the run in its current state."""


class ApprovalTakenError(RunStateError):
    """Another answer won the approval first (one answer per request): this one was not
    sent."""

    def __init__(self, message: str, *, run_id: str, call_id: str) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.call_id = call_id


class OverloadedError(SagaloopError):
    """The app's start backlog (runs started that no engine took up yet) is at its limit:
    nothing was written. Start it again later (with the same run id, it stays idempotent)."""

    def __init__(self, app: str, backlog: int, limit: int) -> None:
        super().__init__(
            f"app {app!r} has {backlog} run(s) waiting for an engine to start them, its limit "
            f"(SAGALOOP_START_BACKLOG={limit}): the run was not started; start it again later, "
            "or add engines and workers"
        )
        self.app = app
        self.backlog = backlog
        self.limit = limit


# --- storage ---------------------------------------------------------------------------------


class StoreError(SagaloopError):
    """The database failed; the original driver error is the ``__cause__``.

    ``code`` is the driver's error code when it gave one: the SQLSTATE on PostgreSQL
    (``"40001"``), the error name on SQLite (``"SQLITE_BUSY"``).
    """

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class TransientStoreError(StoreError):
    """The database failed in a way worth retrying: the connection was lost or refused, the
    server is shutting down or starting up, or the transaction lost a race (serialization
    failure, deadlock, lock timeout, SQLite's ``database is locked``). Run the transaction
    again after a short backoff. It was rolled back, unless the connection was lost during the
    commit itself: then it may have committed, so retried work must be idempotent."""


class AccessRefusedError(SagaloopError):
    """A server refused sagaloop's credentials or what they name: a wrong password, an unknown
    user or role, a database or virtual host that does not exist, a missing permission.
    Waiting does not help until someone fixes the configuration, so a service that meets it at
    start-up stops (``sagaloop engine``, ``worker`` and ``dev`` exit with status 78) instead of
    retrying for ever; met later (a password rotated under a running service), it is retried
    like an outage. ``reason`` says what was refused, in a few words; ``where`` is the server's
    URL, its password masked."""

    reason: str = ""
    where: str = ""


class DatabaseAccessRefused(TransientStoreError, AccessRefusedError):
    """The database refused the connection: see :class:`AccessRefusedError`. A
    TransientStoreError, so that a running service waits for the fix rather than give up on
    the messages in hand."""

    def __init__(self, message: str, *, reason: str, where: str, code: str | None = None):
        super().__init__(message, code=code)
        self.reason = reason
        self.where = where


class SchemaOutdatedError(StoreError):
    def __init__(self, current: int, expected: int) -> None:
        super().__init__(
            f"the database schema is at version {current}, this sagaloop needs {expected}: "
            "run `sagaloop db upgrade`"
        )
        self.current = current
        self.expected = expected


class SchemaTooNewError(StoreError):
    def __init__(self, current: int, expected: int) -> None:
        super().__init__(
            f"the database schema is at version {current}, newer than this sagaloop "
            f"understands ({expected}): upgrade sagaloop"
        )
        self.current = current
        self.expected = expected


class DuplicateMessageError(StoreError):
    """The inbox already holds this (consumer, message_id): the message was processed."""


class BrokerError(SagaloopError):
    """The message broker failed; the driver error is the ``__cause__``."""


class BrokerAccessRefused(BrokerError, AccessRefusedError):
    """The broker refused the connection: see :class:`AccessRefusedError`."""

    def __init__(self, message: str, *, reason: str, where: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.where = where


class UndeliverableError(BrokerError):
    """A message that the broker will never accept as it is (no queue bound to its routing
    key, too large). The relay dead-letters such an outbox row instead of retrying it."""


class MessageError(SagaloopError):
    """A message cannot be processed (not JSON, unknown type, invalid payload, too large).

    Consumers dead-letter such messages with ``reason`` and keep running.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RunNotStartedError(MessageError):
    """A message for a run that does not exist, maybe not yet: a saga that starts a run and
    sends it an event writes two messages in one commit, and two consumers (threads or
    processes) may take them apart and process the event first. The engine's consumer hands
    sagaloop's own such messages back a few times before dead-lettering them."""


# --- replay ----------------------------------------------------------------------------------


class NonDeterminismError(SagaloopError):
    """Replaying the saga code issued a different command than the history recorded. Its
    message says what the history has and what the code issues now, then, with ``fix``, what
    to do (``divergence``: the message without it)."""

    def __init__(
        self, message: str, *, run_id: str = "", position: int = -1, fix: str = ""
    ) -> None:
        super().__init__(f"{message}; {fix}" if fix else message)
        self.run_id = run_id
        self.position = position
        self.divergence = message
        self.fix = fix


class SagaDeterminismViolation(SagaloopError):
    """Saga code tried to do real I/O, start a thread or an asyncio timer."""


class ActivationDeadlineError(SagaloopError):
    """Saga code ran past the activation deadline without yielding; ``stack`` is where it was.
    The engine parks the run in ``needs_attention``."""

    def __init__(self, message: str, *, stack: str = "") -> None:
        super().__init__(message)
        self.stack = stack


# --- errors seen by saga and step code -------------------------------------------------------


class ApplicationError(SagaloopError):
    """Raise from a step to fail it with control over retries.

    ``non_retryable=True`` fails the step for good at once. ``needs_attention=True`` says that
    a person must fix the cause (a revoked key, an unknown model): the step is not retried and
    its run parks in ``needs_attention`` with nothing undone, until ``sagaloop retry`` runs the
    step again. ``retry_after`` (seconds, or a timedelta: a provider's ``Retry-After``) makes
    the next attempt wait at least that long. Any other exception raised by a step is retried
    according to its :class:`~sagaloop.RetryPolicy` and, because it does not prove the effect
    did not happen, makes the next attempt *in doubt*.
    """

    def __init__(
        self,
        message: str,
        *,
        type: str | None = None,
        non_retryable: bool = False,
        needs_attention: bool = False,
        retry_after: float | timedelta | None = None,
    ):
        super().__init__(message)
        self.type = type or "ApplicationError"
        self.non_retryable = non_retryable
        self.needs_attention = needs_attention
        if isinstance(retry_after, timedelta):
            retry_after = retry_after.total_seconds()
        self.retry_after = retry_after


class NotAppliedError(ApplicationError):
    """Raise from a step when the effect certainly did not happen (say, a connection refused
    before the request was sent). The step is retried and the next attempt is *not* in doubt."""

    def __init__(
        self,
        message: str,
        *,
        type: str | None = None,
        needs_attention: bool = False,
        retry_after: float | timedelta | None = None,
    ) -> None:
        super().__init__(
            message,
            type=type or "NotAppliedError",
            needs_attention=needs_attention,
            retry_after=retry_after,
        )


class StepCancelled(SagaloopError):
    """Raised by ``ctx.heartbeat()`` in a running step whose run is being cancelled or undone,
    or whose attempt was superseded (its lease was lost): stop, clean up (``finally`` runs),
    and let it propagate."""


class CompleteAsync(BaseException):
    """Raised by ``ctx.complete_async()`` in a step's body: the attempt is handed off to an
    outside system, which completes it later through the client (``Client.complete_step``,
    ``Client.fail_step``, ``sagaloop complete-step``) with the attempt's ``ctx.task_token``.
    Its reply says ``handed_off``; no result is recorded until then. A ``BaseException``, like
    Temporal's ``CompleteAsyncError``, so that a step's ``except Exception`` lets it through."""


class StepAttemptGoneError(RunStateError):
    """A completion (``Client.complete_step``/``fail_step``/``heartbeat_step``) named a step
    attempt that is no longer waiting to be completed from outside: it was completed already,
    timed out and retried (a new attempt has a new token), or its run was cancelled or ended.
    Nothing was sent."""

    def __init__(self, message: str, *, run_id: str, position: int, attempt: int) -> None:
        super().__init__(message)
        self.run_id = run_id
        self.position = position
        self.attempt = attempt


class StepFailedError(SagaloopError):
    """Raised inside saga code by ``await ctx.call(...)`` when the step failed for good."""

    def __init__(self, step: str, error: ErrorInfo) -> None:
        super().__init__(f"step {step!r} failed: {error.describe()}")
        self.step = step
        """The step's name, or the child saga's for ``await ctx.call(child_saga, ...)``."""
        self.error = error
        """The step's error (its last attempt's), or the child run's."""

    @property
    def cause_type(self) -> str:
        """The type of the step's error (``ApplicationError``'s ``type``), or of the child
        run's: ``"ValueError"``, ``"CardDeclined"``..."""
        return self.error.type

    @property
    def cause_message(self) -> str:
        """The message of the step's error, or of the child run's."""
        return self.error.message


class ApprovalDenied(SagaloopError):
    """Raised inside saga code by ``await ctx.call(step, ...)`` for a step declared with
    ``approval=True`` whose call a person denied (or nobody answered before its deadline)."""

    def __init__(self, step: str, reason: str | None) -> None:
        super().__init__(f"the call of step {step!r} was denied: {reason or 'no reason given'}")
        self.step = step
        self.reason = reason


class EventTimeoutError(SagaloopError):
    """Raised inside saga code when ``ctx.wait_for_event`` reaches its timeout."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no event {name!r} arrived before the timeout")
        self.event = name


class ChildTimeoutError(SagaloopError, TimeoutError):
    """Raised inside saga code by ``await ctx.call(saga, input, timeout=...)`` when the
    timeout passed before the child run ended: the child run is cancelled (it compensates).
    A ``TimeoutError`` too, as ``asyncio.wait_for`` raises."""

    def __init__(self, saga: str, run_id: str, timeout: timedelta) -> None:
        super().__init__(f"child run {run_id!r} of saga {saga!r} did not end within {timeout}")
        self.saga = saga
        self.run_id = run_id
        self.timeout = timeout


class SagaFailedError(SagaloopError):
    """Raised by ``Client.result`` for a run that did not complete."""

    def __init__(self, run_id: str, status: str, error: ErrorInfo | None) -> None:
        detail = f": {error.type}: {error.message}" if error else ""
        super().__init__(f"run {run_id!r} ended {status}{detail}")
        self.run_id = run_id
        self.status = status
        self.error = error


class UpdateFailedError(SagaloopError):
    """Raised by ``Client.update`` when the update's handler raised: ``error`` (an
    ``ErrorInfo``) has the type and message of what it raised. The update was applied up to
    where its handler raised; the run goes on."""

    _outcome = "failed"

    def __init__(self, run_id: str, name: str, update_id: str, error: ErrorInfo) -> None:
        what = f"update {name!r} of run {run_id!r} {self._outcome}"
        super().__init__(f"{what}: {error.type}: {error.message}")
        self.run_id, self.name, self.update_id, self.error = run_id, name, update_id, error


class UpdateRefusedError(UpdateFailedError):
    """Raised by ``Client.update`` when the update was refused before it was recorded: its
    validator raised (``error`` is what it raised), the run has no handler for it, its data did
    not fit the handler's model, or the run ended or needs attention. Nothing was applied."""

    _outcome = "was refused"


MAX_ERROR_MESSAGE = 8 * 1024
"""Characters of an error message kept in the history; a longer one is cut."""
MAX_TRACEBACK = 4 * 1024
"""Characters of a formatted traceback kept in the history (its end: the innermost frames)."""


MAX_CAUSE_DEPTH = 8
"""Links of an ``ErrorInfo.cause`` chain kept (children of children... of a failed call)."""


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class ErrorInfo:
    """A stored, JSON-shaped description of an exception. Built from any exception, it always
    holds storable text: a message that cannot be read, holds lone surrogates or is very long
    is replaced, escaped or cut, so that recording a failure never fails in turn."""

    type: str
    message: str
    _: dataclasses.KW_ONLY
    non_retryable: bool = False
    not_applied: bool = False
    traceback: str | None = None
    causes: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """The exception's ``__cause__`` (or unsuppressed ``__context__``) chain, outermost
    first, as ``(type, message)``: ``raise StepError(...) from ConnectionError(...)``."""
    needs_attention: bool = False
    """A person must fix the cause: the run parks, nothing undone (see ApplicationError)."""
    retry_after: float | None = None
    """Seconds the next attempt waits at least (a provider's ``Retry-After``)."""
    step: str | None = None
    """For a run's error raised by a step or child run that failed (a ``StepFailedError`` that
    saga code did not catch, or one in the ``__cause__`` chain of what it raised): the step's
    name, or the child saga's."""
    cause: ErrorInfo | None = None
    """That step's error, or that child run's (whose own ``cause`` goes on down the chain),
    without its traceback: ``run.error.cause.type == "CardDeclined"``."""

    @property
    def root_cause(self) -> ErrorInfo:
        """The innermost failed step's error down the ``cause`` chain (a child run's child's
        step...), or this error when it has no ``cause``."""
        error = self
        for _ in range(MAX_CAUSE_DEPTH):
            if error.cause is None:
                break
            error = error.cause
        return error

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        with_traceback: bool = False,
        called: Collection[CodeType] = (),
    ) -> ErrorInfo:
        """Never raises. ``with_traceback`` keeps where it was raised (cut to MAX_TRACEBACK,
        keeping its end). ``called``: the code of the user's functions that sagaloop called
        (a step's body, its compensation...): the traceback starts at the first of them, without
        the frames of sagaloop that called it."""
        name = storable(type(exc).__name__, 200)
        message = storable(message_of(exc, name), MAX_ERROR_MESSAGE)
        trace = traceback_text(exc, called, MAX_TRACEBACK) if with_traceback else None
        causes = causes_of(exc)
        failed = _failed_call(exc)
        step = None if failed is None else failed.step
        cause = None if failed is None else failed.error.without_traceback()
        if isinstance(exc, ApplicationError):
            return cls(
                storable(str(exc.type), 200),
                message,
                non_retryable=bool(exc.non_retryable),
                not_applied=isinstance(exc, NotAppliedError),
                traceback=trace,
                causes=causes,
                needs_attention=bool(getattr(exc, "needs_attention", False)),
                retry_after=_seconds(getattr(exc, "retry_after", None)),
                step=step,
                cause=cause,
            )
        return cls(name, message, traceback=trace, causes=causes, step=step, cause=cause)

    def without_traceback(self, depth: int = MAX_CAUSE_DEPTH) -> ErrorInfo:
        """A copy without tracebacks, down a ``cause`` chain cut at ``depth`` links."""
        cause = self.cause.without_traceback(depth - 1) if self.cause and depth > 1 else None
        return dataclasses.replace(
            self, traceback=None, causes=list(self.causes), cause=cause, step=self.step
        )

    def describe(self) -> str:
        """``type: message``, then ``(caused by type: message)`` for each cause."""
        text = f"{self.type}: {self.message}"
        return text + "".join(f" (caused by {t}: {m})" for t, m in self.causes)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.non_retryable:
            data["non_retryable"] = True
        if self.not_applied:
            data["not_applied"] = True
        if self.needs_attention:
            data["needs_attention"] = True
        if self.retry_after is not None:
            data["retry_after"] = self.retry_after
        if self.traceback is not None:
            data["traceback"] = self.traceback
        if self.causes:
            data["causes"] = [{"type": t, "message": m} for t, m in self.causes]
        if self.step is not None:
            data["step"] = self.step
        if self.cause is not None:
            data["cause"] = self.cause.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], *, _depth: int = 0) -> ErrorInfo:
        trace, step, cause = data.get("traceback"), data.get("step"), data.get("cause")
        if not isinstance(cause, dict) or _depth + 1 >= MAX_CAUSE_DEPTH:
            cause = None
        return cls(
            str(data.get("type", "Error")),
            str(data.get("message", "")),
            non_retryable=bool(data.get("non_retryable", False)),
            not_applied=bool(data.get("not_applied", False)),
            needs_attention=bool(data.get("needs_attention", False)),
            retry_after=_seconds(data.get("retry_after")),
            traceback=None if trace is None else str(trace),
            causes=[
                (str(c.get("type", "Error")), str(c.get("message", "")))
                for c in data.get("causes") or []
                if isinstance(c, dict)
            ],
            step=None if step is None else str(step),
            cause=None if cause is None else cls.from_json(cause, _depth=_depth + 1),
        )

    def __repr__(self) -> str:
        return f"ErrorInfo({self.type!r}, {self.message!r})"


MAX_RETRY_AFTER = 24 * 3600.0
"""The longest ``retry_after`` honoured (seconds): a longer one is cut to it."""


def _seconds(value: Any) -> float | None:
    """A ``retry_after`` as a number of seconds in [0, MAX_RETRY_AFTER], or None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return min(max(float(value), 0.0), MAX_RETRY_AFTER)


def _failed_call(exc: BaseException) -> StepFailedError | None:
    """The ``StepFailedError`` that ``exc`` is, or the first in its cause chain."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, StepFailedError):
            return current
        seen.add(id(current))
        suppressed = current.__suppress_context__
        current = current.__cause__ or (None if suppressed else current.__context__)
    return None
