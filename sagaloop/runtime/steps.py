"""Executing one attempt of a step, its compensation or its reconcile function.

This module knows nothing of queues or transactions: it turns a ``step`` message into the
payload of its ``step_result`` reply. The worker service (and the engine, for local steps) wrap
it with the inbox, the outbox and the acknowledgement.

Whatever step code does ends as a reply: a result, or a failed attempt counted by the retry
policy. That includes a ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``,
``asyncio.CancelledError``, ``GeneratorExit``) raised by a step, its compensation or its
reconcile function: steps run on consumer and pool threads, where no signal is delivered, so
such an exception is the step's own doing and must not end the thread that runs it. (The one
exception: :class:`~sagaloop.runtime.crashpoints.CrashPointRaised`, which tests raise to simulate
the death of the process.) A result
that cannot be stored or sent (a lone surrogate, an integer over Python's digit limit, NaN, over
``MAX_VALUE_BYTES``) fails the attempt as ``UnencodableResult``, in doubt: the body ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from types import CodeType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from sagaloop import tracing
from sagaloop.engine.contract import DO, UNENCODABLE_RESULT, halts_in_doubt, idempotency_key
from sagaloop.engine.handoff import TaskToken
from sagaloop.engine.history import Event
from sagaloop.engine.messages import Envelope, Outcome, StepReply, StepTask
from sagaloop.engine.ports import Streams
from sagaloop.errors import (
    CompleteAsync,
    ErrorInfo,
    NotAppliedError,
    SagaloopError,
    StepCancelled,
    UnencodableError,
    UnknownStepError,
    ValidationError,
)
from sagaloop.runtime import aio
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.runtime.slots import Job, Slots
from sagaloop.sagas.app import App, StepDef
from sagaloop.sagas.context import StepContext
from sagaloop.sagas.convert import ANY

if TYPE_CHECKING:
    from sqlalchemy import Connection

logger = logging.getLogger("sagaloop.step")
COMPLETED, FAILED, HALTED = Outcome.COMPLETED, Outcome.FAILED, Outcome.HALTED
HANDED_OFF = Outcome.HANDED_OFF
STREAM_FLUSH = 1.0  # how long an attempt that streamed waits at its end for its items to go


class StepTimeoutError(SagaloopError):
    """An attempt ran past the step's timeout; it may still take effect (in doubt)."""


class AttemptNotStarted(SagaloopError):
    """The runner stopped (its process stops) before the attempt's body started: nothing ran,
    so its message is given back, not answered."""


Beat = Callable[["_StepContext"], None]
"""What a heartbeat does besides recording the time (the worker's: renew the lease, look at
the run); raises StepCancelled to stop the step."""


class History(Protocol):
    """Reads a run's history (``Store.load_history``): how a step finds what earlier steps of
    its run were given, such as the transcript an agent's model step extends. ``within``: the
    connection of a transactional step's transaction, to read in it; ``after``: only the
    events after that seq."""

    def __call__(
        self, run_id: str, within: Connection | None = None, after: int = 0
    ) -> list[Event]: ...


class _StepContext(StepContext):
    def __init__(
        self,
        task: Envelope,
        step: StepDef[Any, Any],
        in_doubt: bool,
        beat: Beat | None = None,
        history: History | None = None,
        streams: Streams | None = None,
        schedule_deadline: datetime | None = None,
    ) -> None:
        self._beat = beat
        self._streams = streams
        self._history = history
        self.last_beat = time.monotonic()
        self.details: Any = None
        self.streamed = False
        self.abandoned = False
        """Set when the attempt ran past its timeout: its outcome is dropped, and
        ``heartbeat()`` tells it to stop."""
        self.app_name = ""
        """The app of the run: part of :attr:`task_token`."""
        self.may_hand_off = False
        """Set while the step's own body runs (not its compensation or reconcile function), if
        it is not transactional: :meth:`complete_async` is allowed."""
        self.deadline: float | None = None
        """When all attempts must be over (monotonic), from the step's ``schedule_to_close``."""
        if schedule_deadline is not None:
            left = (schedule_deadline - datetime.now(UTC)).total_seconds()
            self.deadline = time.monotonic() + left
        self.run_id = task.run_id
        self.saga = task.saga or ""
        self.step = step.name
        self.position = task.position or 0
        self.attempt = task.attempt or 1
        self.in_doubt = in_doubt
        self.idempotency_key = task.idempotency_key or ""
        self.logger = logging.LoggerAdapter(
            logger,
            {"run_id": self.run_id, "saga": self.saga, "step": self.step, "attempt": self.attempt},
        )

    def stream(self, data: Any) -> None:
        if self._streams is None or self.abandoned:
            return
        item = {"step": self.step, "position": self.position, "attempt": self.attempt}
        try:
            item["data"] = ANY.to_json(data, what="a streamed item")
        except ValidationError as e:
            self.logger.warning("stream item of step %s dropped: %s", self.step, e)
            return
        self.streamed = True
        self._streams.publish(self.run_id, item)

    def history(self, run_id: str | None = None, *, after: int = 0) -> list[Event]:
        if self._history is None:
            return super().history(run_id, after=after)
        return self._history(run_id or self.run_id, self.transaction, after)

    @property
    def task_token(self) -> str:
        position, attempt = self.position, self.attempt
        return TaskToken(self.app_name, self.run_id, position, attempt).encode()

    def complete_async(self) -> NoReturn:
        if not self.may_hand_off:
            raise ValidationError(
                f"step {self.step!r}: ctx.complete_async() is for the body of a step that is not "
                "transactional; a compensation, a reconcile function and a transactional step "
                "(its writes commit with its outcome) must return or raise"
            )
        raise CompleteAsync(f"step {self.step!r} (attempt {self.attempt}) handed off")

    def heartbeat(self, details: Any = None) -> None:
        self.last_beat = time.monotonic()
        self.details = details
        if self.abandoned:
            raise StepCancelled(
                f"step {self.step!r} ran past its timeout: the attempt was failed in doubt and "
                "its outcome will be dropped, so it should stop"
            )
        if self._beat is not None:
            self._beat(self)


_current: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "sagaloop_current_step", default=None
)


def current_step() -> StepContext | None:
    """The context of the step attempt whose code is running (its body, compensation or
    reconcile function, and any code they call on the same thread or task), or None outside
    one: how code that is not handed the context finds the attempt's ``idempotency_key``,
    ``attempt`` and ``in_doubt`` (a framework's function tool run as a step, say)."""
    return _current.get()


def _in_step(fn: Callable[..., Any], ctx: StepContext) -> Callable[..., Any]:
    """``fn`` with :func:`current_step` giving ``ctx`` while it runs (its coroutine too). An
    async ``fn`` is called inside its task, so that a coroutine closed before it started
    leaves nothing un-awaited behind."""

    async def within(coro: Any) -> Any:
        _current.set(ctx)  # in the task's own copy of the context
        return await coro

    async def call_async(*args: Any, **kwargs: Any) -> Any:
        _current.set(ctx)
        return await fn(*args, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        token = _current.set(ctx)
        try:
            result = fn(*args, **kwargs)
        finally:
            _current.reset(token)
        return within(result) if asyncio.iscoroutine(result) else result

    return call_async if inspect.iscoroutinefunction(fn) else call


def _code_of(step: StepDef[Any, Any]) -> set[CodeType]:
    """The code of the step's functions: where the traceback of an error they raise starts."""
    fns = (step.fn, step.compensation_fn, step.reconcile_fn)
    codes = (getattr(fn, "__code__", None) for fn in fns)
    return {code for code in codes if isinstance(code, CodeType)}


def _what(step: StepDef[Any, Any], direction: str) -> str:
    return f"step {step.name!r}" if direction == DO else f"compensation of step {step.name!r}"


def _attempt_of(step: StepDef[Any, Any], attempt: int) -> str:
    limit = step.retry.max_attempts
    return f"attempt {attempt} of {limit}" if limit is not None else f"attempt {attempt}, no limit"


def _error_of(step: StepDef[Any, Any], e: BaseException) -> ErrorInfo:
    """What a failed attempt's reply says of ``e``: a result that could not be stored or sent
    (the body ran, so the next attempt is in doubt); arguments or a result that do not match
    the step's types (not retryable); else whatever step code raised, with its traceback."""
    if isinstance(e, UnencodableError):
        info = ErrorInfo.from_exception(e)
        info.type = UNENCODABLE_RESULT
    elif isinstance(e, ValidationError):
        info = ErrorInfo.from_exception(e)
        info.non_retryable = True
    else:
        info = ErrorInfo.from_exception(e, with_traceback=True, called=_code_of(step))
        if not info.message:
            info.message = f"{info.type} raised by step {step.name!r}"
    return info


def _note(ctx: _StepContext, level: int, state: str, why: str) -> None:
    """One line on what an attempt in doubt does: ``run R: step 'S' <state> (attempt N): <why>``."""
    ctx.logger.log(
        level, "run %s: step %r %s (attempt %d): %s", ctx.run_id, ctx.step, state, ctx.attempt, why
    )


def _log_failure(
    ctx: _StepContext, step: StepDef[Any, Any], direction: str, info: ErrorInfo, e: BaseException
) -> None:
    """One line for a failed attempt; at DEBUG (``-v``) with the traceback. The exception goes
    on the attempt's span too."""
    tracing.failed(e)
    ctx.logger.warning(
        "run %s: %s failed (%s): %s%s",
        ctx.run_id,
        _what(step, direction),
        _attempt_of(step, ctx.attempt),
        info.describe(),
        "; not retryable" if info.non_retryable else "",
        exc_info=e if ctx.logger.isEnabledFor(logging.DEBUG) else None,
    )


def _invoke(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = fn(*args, **kwargs)
    if asyncio.iscoroutine(result):
        return _run_coroutine(result)
    return result


def _run_coroutine(coro: Any) -> Any:
    """Run an async step's coroutine on the process's step loop (:mod:`aio`: one long-lived
    loop, so that a client's connections outlive an attempt) and wait for it. Whatever it
    raises, ``CancelledError`` included, comes out here, with its own cause chain."""
    return aio.run(coro)


@contextlib.contextmanager
def _savepoint(
    conn: Connection | None, step: StepDef[Any, Any], ctx: _StepContext
) -> Iterator[None]:
    """For a transactional attempt (``conn`` given): a savepoint around the step's body and the
    conversion of its result, rolled back if either raises, so that a failed attempt leaves no
    write behind while its failure is still recorded. On PostgreSQL the step's ``timeout`` (or
    what is left of its ``schedule_to_close``) becomes the savepoint's ``statement_timeout``: a
    statement past it is cancelled and the attempt fails with ``StepTimeoutError``, not applied.
    (The body runs on the worker's thread: a Python loop that never queries is not bounded.)"""
    if conn is None:
        yield
        return
    limits = [step.timeout.total_seconds()] if step.timeout is not None else []
    if ctx.deadline is not None:
        limits.append(ctx.deadline - time.monotonic())
    timeout = conn.dialect.name == "postgresql" and bool(limits)
    try:
        with conn.begin_nested():
            if timeout:
                ms = str(max(1, round(min(limits) * 1000)))
                previous = conn.exec_driver_sql(
                    "SELECT current_setting('statement_timeout'), "
                    "set_config('statement_timeout', %(ms)s, true)",
                    {"ms": ms},
                ).scalar()
            yield
            if timeout:
                conn.exec_driver_sql(
                    "SELECT set_config('statement_timeout', %(previous)s, true)",
                    {"previous": previous},
                )
    except Exception as e:
        from sagaloop.store.connect import error_code  # loaded already: the store's

        if error_code(e) == "57014":  # query_canceled: the statement_timeout
            limit = step.timeout or "its schedule_to_close"
            raise StepTimeoutError(
                f"step {step.name!r} did not finish within {limit}: its statement was cancelled "
                "and its writes rolled back"
            ) from e
        raise


class StepRunner:
    """Runs the attempts of a step with a timeout on a pool of threads (:mod:`slots`), so that
    the timeout can be enforced and a stuck step never blocks its consumer. The timeout starts
    when the body starts (not while it waits for a thread). A timed-out attempt is failed *in
    doubt*: an async one is cancelled; a sync one is abandoned (its late outcome is dropped,
    its thread is replaced and reported by :meth:`abandoned` until it ends). Attempts of a
    step without a timeout run on the caller's thread (nothing to enforce).

    ``threads``: the pool's size; ``spare_threads`` (default: as many) more may replace the
    threads of abandoned attempts. When all are held by abandoned attempts, attempts wait for
    one and :meth:`problems` says so."""

    def __init__(
        self,
        app: App,
        *,
        threads: int = 8,
        spare_threads: int | None = None,
        worker: str = "worker",
        inline: bool = False,
        history: History | None = None,
        streams: Streams | None = None,
    ) -> None:
        self.app = app
        self.history = history
        self.streams = streams
        self.worker = worker
        self.inline = inline
        self._slots = Slots(threads, spare=spare_threads)

    def stop_starting(self) -> None:
        """Start no more attempts: those waiting for a thread raise :class:`AttemptNotStarted`
        (their messages are given back); running ones go on."""
        self._slots.close()

    close = stop_starting

    def waiting(self) -> int:
        """Attempts waiting for a thread."""
        return self._slots.waiting()

    def running(self) -> list[str]:
        """The attempts running on the pool and waited for (not abandoned), one line each."""
        return [job.describe() for job in self._slots.running()]

    def abandoned(self) -> list[dict[str, Any]]:
        """The attempts abandoned past their timeouts whose threads still run: ``step``,
        ``run_id``, ``position``, ``attempt`` and ``since`` (ISO time) each."""
        return [
            {**job.about, "since": job.started_at.isoformat() if job.started_at else None}
            for job in self._slots.abandoned()
        ]

    def problems(self) -> list[str]:
        """What is wrong: every thread of the pool held by an attempt past its timeout."""
        if not self._slots.saturated():
            return []
        jobs = self._slots.abandoned()
        return [
            f"all {self._slots.cap} step threads are held by attempts past their timeouts "
            f"({'; '.join(j.describe() for j in jobs)}); {self._slots.waiting()} attempt(s) "
            "wait for a thread. Fix the steps that ignore their timeout (docs/concepts/steps.md, "
            "'Timeouts and long steps'), then restart this process"
        ]

    def run(
        self,
        env: Envelope,
        *,
        redelivered: bool = False,
        inline: bool = False,
        beat: Beat | None = None,
        task: StepTask | None = None,
        transaction: Connection | None = None,
    ) -> StepReply:
        """Run one attempt of the step message ``env`` (``task``: its payload, if the caller
        parsed it already; a malformed one raises ``MessageError``) and return its reply, in
        the attempt's span (``sagaloop.step`` or ``sagaloop.compensation``: see ``tracing``).
        ``transaction``: for a transactional step, the open transaction that will record the
        reply; the attempt runs on this thread in a savepoint of it (see :func:`_savepoint`)."""
        task = task or StepTask.parse(env)
        step = self.app.get_step(task.step)
        if step is None:
            raise UnknownStepError(task.step)
        with tracing.step_attempt(env) as span:
            reply = self._attempt(env, task, step, redelivered, inline, beat, transaction)
            if span.recording:
                span.done(reply.to_payload())
        return reply

    def _attempt(
        self,
        env: Envelope,
        task: StepTask,
        step: StepDef[Any, Any],
        redelivered: bool,
        inline: bool,
        beat: Beat | None,
        transaction: Connection | None = None,
    ) -> StepReply:
        direction = task.direction
        # a transactional attempt whose outcome was not committed rolled its writes back
        in_doubt = (task.in_doubt or redelivered) and transaction is None
        inline = inline or self.inline or transaction is not None
        ctx = _StepContext(
            env, step, in_doubt, beat, self.history, self.streams, task.schedule_deadline
        )
        ctx.transaction = transaction
        ctx.app_name = self.app.name
        started = time.monotonic()
        try:
            args = step.signature.args_from_json(task.args, what=f"step {step.name!r}")
            with _savepoint(transaction, step, ctx):
                if direction == DO:
                    done = self._do(step, ctx, args, in_doubt, task.force, inline)
                else:
                    done = self._undo(step, ctx, args, task.result, in_doubt, inline)
        except (CrashPointRaised, AttemptNotStarted):
            raise  # a simulated death of the process (tests), or nothing ran: no reply
        except CompleteAsync:  # ctx.complete_async(): an outside system completes it
            ctx.logger.info(
                "run %s: step %r handed off (%s): waiting to be completed from outside",
                ctx.run_id,
                step.name,
                _attempt_of(step, ctx.attempt),
            )
            return StepReply(direction=direction, worker=self.worker, outcome=HANDED_OFF)
        except BaseException as e:  # step code's, whatever it raises: see the module's doc
            info = _error_of(step, e)
            if transaction is not None:
                info.not_applied = True  # its writes were rolled back with the savepoint
            _log_failure(ctx, step, direction, info, e)
            return StepReply(
                direction=direction, worker=self.worker, outcome=FAILED, error=info.to_json()
            )
        finally:
            if ctx.streamed and self.streams is not None:  # its items reach the run's readers
                self.streams.flush(STREAM_FLUSH)  # before its reply can finish the run
        # what the attempt itself took: a reconciled step's duration (the message may have
        # waited out a dead worker's lease first)
        took = time.monotonic() - started
        reply = StepReply(direction=direction, worker=self.worker, **done, took_s=round(took, 6))
        ctx.logger.debug(
            "run %s: %s %s (%s) in %.3f s",
            ctx.run_id,
            _what(step, direction),
            "skipped" if reply.skipped else reply.outcome,
            _attempt_of(step, ctx.attempt),
            took,
        )
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
                    why = "an earlier attempt took effect, so it was not run again"
                    _note(ctx, logging.INFO, "reconciled", why)
                    what = f"reconciled result of step {step.name!r}"
                    result = step.result.to_json(found, what=what)
                    return {"outcome": COMPLETED, "result": result, "reconciled": True}
                why = "its reconcile found no effect of an earlier attempt; running it"
                _note(ctx, logging.INFO, "in doubt", why)
            elif halts_in_doubt(step):  # no reconcile, and idempotent=False
                reason = (
                    f"step {step.name!r} is declared idempotent=False and has no reconcile; an "
                    f"earlier attempt may have taken effect, so attempt {ctx.attempt} was not "
                    "run. Check the effect by hand, then `sagaloop retry` the run."
                )
                why = "not run again, as it is idempotent=False without a reconcile"
                _note(ctx, logging.WARNING, "in doubt", why)
                return {"outcome": HALTED, "error": ErrorInfo("InDoubt", reason).to_json()}
            else:
                _note(ctx, logging.DEBUG, "in doubt", "idempotent, so run again")
        elif in_doubt:
            _note(ctx, logging.INFO, "run again although in doubt", "`sagaloop retry` forced it")
        ctx.may_hand_off = not step.transactional
        try:
            value = self._call(step, inline, step.fn, ctx, **args)
        finally:
            ctx.may_hand_off = False
        return {
            "outcome": COMPLETED,
            "result": step.result.to_json(value, what=f"result of step {step.name!r}"),
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
            result = step.result.from_json(result_json, what=f"result of step {step.name!r}")
        elif in_doubt and step.reconcile_fn is not None:
            # The step failed after an attempt whose outcome is unknown: undo only what happened.
            # The look-up is about the step's attempts, so it gets the step's own key.
            look_up = copy.copy(ctx)
            look_up.idempotency_key = idempotency_key(ctx.run_id, ctx.position, DO)
            result = self._call(step, inline, step.reconcile_fn, look_up, **args)
            if result is None:
                return {"outcome": COMPLETED, "result": None, "skipped": True}
        self._call(step, inline, step.compensation_fn, ctx, *args.values(), result)
        return {"outcome": COMPLETED, "result": None}

    def _call(
        self, step: StepDef[Any, Any], inline: bool, fn: Callable[..., Any], *a: Any, **kw: Any
    ) -> Any:
        ctx = next((x for x in a if isinstance(x, _StepContext)), None)
        if ctx is not None:
            fn = _in_step(fn, ctx)
        deadline = ctx.deadline if ctx is not None else None
        limits = step.timeout is not None or step.heartbeat_timeout is not None or deadline
        if inline or not limits:
            return _invoke(fn, *a, **kw)
        label = f"step {step.name!r}" + (f", run {ctx.run_id}" if ctx is not None else "")
        about: dict[str, Any] = {"step": step.name}
        if ctx is not None:
            about.update(run_id=ctx.run_id, position=ctx.position, attempt=ctx.attempt)
        job = self._slots.submit(fn, *a, label=label, about=about, **kw)
        if not self._slots.wait_started(job, deadline):
            if self._slots.closed:
                raise AttemptNotStarted(f"{label}: the process stops; not started")
            raise NotAppliedError(
                f"step {step.name!r} did not start before its schedule_to_close: every step "
                "thread of the process was busy",
                type="StepTimeoutError",
            )
        return self._wait(step, ctx, deadline, job)

    def _wait(
        self, step: StepDef[Any, Any], ctx: _StepContext | None, deadline: float | None, job: Job
    ) -> Any:
        """The outcome of ``job``, which started; at its first limit it is abandoned (async:
        cancelled) and the attempt fails in doubt."""
        assert job.started is not None
        started = job.started
        while True:
            ends = []  # (when, why) for each limit; the attempt fails in doubt at the first
            if step.timeout is not None:
                ends.append((started + step.timeout.total_seconds(), f"within {step.timeout}"))
            if step.heartbeat_timeout is not None and ctx is not None:
                silent = step.heartbeat_timeout
                last = max(ctx.last_beat, started)
                ends.append((last + silent.total_seconds(), f"a heartbeat in {silent}"))
            if deadline is not None:
                ends.append((deadline, "before its schedule_to_close"))
            end, why = min(ends)
            if self._slots.wait_done(job, end - time.monotonic()):
                return job.outcome()
            if time.monotonic() >= end:
                if ctx is not None:
                    ctx.abandoned = True
                if not self._slots.abandon(job):  # it ended just now
                    return job.outcome()
                raise StepTimeoutError(f"step {step.name!r} did not finish {why}")
