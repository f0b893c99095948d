"""Replaying saga code against a run's history on the deterministic loop.

A :class:`Replayer` holds one suspended saga coroutine. Feeding it history events resolves the
futures its code awaits; the commands the code issues are numbered in issue order and checked
against the commands the history recorded at the same positions. Commands beyond the recorded
ones are *new*: the engine appends them to the history and acts on them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import hashlib
import logging
import random as _random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.commands import Context, ContinueAsNew, WaitSpec
from sagaloop.engine.handlers import Conditions, Handlers
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.loop import DeterministicLoop, refuse_threads_in_saga_code
from sagaloop.engine.updates import Updates
from sagaloop.engine.watchdog import Watchdog
from sagaloop.errors import (
    ActivationDeadlineError,
    ErrorInfo,
    EventTimeoutError,
    NonDeterminismError,
    StepFailedError,
    ValidationError,
)
from sagaloop.sagas.app import App, SagaDef
from sagaloop.sagas.context import Received, _current
from sagaloop.sagas.convert import Converter

logger = logging.getLogger("sagaloop.saga")

# Events whose arrival is fed to saga code (everything else is engine bookkeeping).
FED_KINDS = frozenset(
    {
        h.STEP_COMPLETED,
        h.STEP_FAILED,
        h.TIMER_FIRED,
        h.EVENT_ARRIVED,
        h.CANCEL_REQUESTED,
        h.CANCEL_DELIVERED,
        h.COMPENSATE_DONE,
        h.CHILD_COMPLETED,
        h.CHILD_FAILED,
        h.UPDATE_ACCEPTED,
    }
)


def seed_for(run_id: str, epoch: int = 0) -> int:
    """The seed of ``ctx.uuid4()`` and ``ctx.random()`` in the history ``epoch`` of a run (how
    many times it continued as new before): a function of the history, so a replay draws what
    the first execution drew, and different in each history of a continue-as-new chain."""
    text = run_id if epoch == 0 else f"{run_id}\x00{epoch}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def started_by(data: dict[str, Any]) -> str | None:
    """The run that started a run, from its ``run_started`` data: ``started_by`` (a run's
    ``ctx.start``), else its parent's (a child run of ``ctx.call``)."""
    by = data.get("started_by") or (data.get("parent") or {}).get("run_id")
    return by if isinstance(by, str) else None


class _Pending:
    __slots__ = ("future", "kind", "model", "name")

    def __init__(self, kind: str, name: str, future: asyncio.Future[Any], model: Any) -> None:
        self.kind, self.name, self.future, self.model = kind, name, future, model


EARLY: dict[str, Any] = {
    "reason": "it arrived before the wait began, and this wait takes only the events sent "
    "while it waits (early='refuse')"
}


class Replayer:
    """One saga coroutine, driven by history events."""

    def __init__(
        self,
        app: App,
        saga: SagaDef[Any, Any],
        run_id: str,
        *,
        watchdog: Watchdog | None = None,
    ) -> None:
        refuse_threads_in_saga_code()
        self.app = app
        self.watchdog = watchdog
        self.saga = saga
        self.run_id = run_id
        self.loop = DeterministicLoop()  # type: ignore[abstract]
        self.loop.timers = self._durable_timer  # asyncio.sleep, wait_for, timeout: ctx.sleep
        self.replaying = True
        self.next_pos = 0
        self.last_seq = 0
        self.recorded: dict[int, Event] = {}  # command events of the history, by position
        self.new_commands: list[NewEvent] = []
        self.pending: dict[int, _Pending] = {}
        self.slot_start: Event | None = None
        """The ``run_started`` of a run whose code waits for its ``slot_claimed``."""
        self.waiters: dict[str, collections.deque[int]] = collections.defaultdict(collections.deque)
        self.buffered: dict[str, collections.deque[tuple[int, Any]]] = collections.defaultdict(
            collections.deque
        )
        self.event_keys: dict[int, str] = {}
        """The key of each kept event that has one (published events), by its ``seq``."""
        self.taken: dict[int, Any] = {}
        """What the history says each wait on published events took (``event_taken``): the
        seq of the event, None if it took none. A replay that takes another diverged."""
        self.routes = False
        """The code subscribed or waited on published events in this history: from then on,
        which wait takes an arrived event is recorded (``event_taken``), as ``RunState``
        expects."""
        self.stopped = False  # cancelled or finished: the code is no longer fed
        self.main: asyncio.Task[Any] | None = None
        self.context: contextvars.Context | None = None  # the saga code's, current_saga() set
        self.outcome: dict[str, Any] | None = None  # {"output": ...} or {"error": ...}
        self.nondeterminism: NonDeterminismError | None = None
        self.rejections: list[NewEvent] = []
        """Events refused by the wait they reached (bad data), and the saga's declared events
        when the engine started the run: bookkeeping for the engine to record, never fed."""
        self.rng = _random.Random(seed_for(run_id))
        self.started_by: str | None = None
        """The run that started this one (``ctx.started_by``), from ``run_started``."""
        self.deprecated: set[str] = set()
        """Change ids saga code passed to ``ctx.deprecate_patch``: their markers are skipped."""
        self.handlers = Handlers(self)
        """``ctx.on_event``: the handlers that take events of their name as they arrive."""
        self.updates = Updates(self)
        """``ctx.on_update``: the handlers of updates, and their validators."""
        self.conditions = Conditions(self)
        """``ctx.wait_condition``: resolved live in :meth:`take_new_commands`, on replay where
        the history recorded it."""
        self.overran: ActivationDeadlineError | None = None
        """Code resumed from a ``wait_condition`` in :meth:`take_new_commands` that ran past
        the activation deadline: raised by the next :meth:`feed` (of the commands it issued),
        where the engine parks the run as for any code that never yields."""
        self.ctx = Context(self)

    def close(self) -> None:
        """Unwind the saga code left suspended (a run that waits, dropped between activations)
        as ``asyncio.run`` does at its end: cancel its tasks and run them on this loop until
        they finish or block. ``finally`` blocks, ``async with`` exits and async generators then
        close inside their own task and context (a framework that resets a context variable
        there, as the OpenAI Agents SDK and anyio do, finds the one it set), not wherever the
        garbage collector happens to run. What the code issues while unwinding is not
        recorded: this object is being dropped, the run's state is its history."""
        self.stopped = True  # fed nothing more
        tasks = [task for task, _ in self.loop.suspended_tasks()]
        if not tasks or self.loop.is_closed():
            return
        self.replaying = True  # silent
        for task in tasks:
            task.cancel()
        try:
            self.loop.run_until_blocked()
        except BaseException:  # raised by saga code while it unwinds: its own, harmless here
            logger.debug("unwinding the saga code of run %r", self.run_id, exc_info=True)
        self.loop.close()

    # --- feeding -----------------------------------------------------------------------------

    def feed(self, events: list[Event], *, replaying: bool) -> None:
        """Apply history events in order; raise NonDeterminismError on a divergence."""
        if self.overran is not None:  # code resumed by a condition ran past the deadline
            overran, self.overran = self.overran, None
            raise overran
        for ev in events:
            if ev.kind in h.COMMAND_KINDS and ev.pos is not None:
                self.recorded[ev.pos] = ev
            elif ev.kind == h.EVENT_TAKEN and ev.pos is not None:
                self.taken[ev.pos] = ev.data.get("seq")
        for ev in events:
            self.replaying = replaying
            self.last_seq = ev.seq  # what the code sees as the history's length when it runs
            if ev.kind == h.RUN_STARTED and self._waits_for_slot(ev):
                self.slot_start = ev  # its code starts when it claims its slot
            elif ev.kind == h.RUN_STARTED:
                self._start(ev)
            elif ev.kind == h.SLOT_CLAIMED and self.slot_start is not None:
                start, self.slot_start = self.slot_start, None
                self._start(start, at=ev.at)
            elif ev.kind in h.COMMAND_KINDS and not self.is_deprecated(ev):
                if self.slot_start is not None:  # recorded before slots were: started at once
                    start, self.slot_start = self.slot_start, None
                    self._start(start)
                if (
                    ev.kind == h.CONDITION_MET
                    and ev.pos is not None
                    and not self.stopped
                    and self.conditions.replay_marker(ev.pos, ev.data)
                ):
                    pass  # the code resumed from its wait_condition, as recorded
                elif ev.pos is not None and ev.pos >= self.next_pos and not self.stopped:
                    self._diverged(
                        f"the history has {ev.describe()} but the saga code no longer issues it",
                        ev.pos,
                    )
            elif ev.kind in FED_KINDS and not self.stopped:
                self._deliver(ev)
            self._raise_divergence()

    def _waits_for_slot(self, ev: Event) -> bool:
        """Whether the run's code starts at its ``slot_claimed`` rather than here: a first
        history (not a continued one, which keeps its slot) of a saga with a concurrency
        limit."""
        return self.saga.concurrency is not None and not ev.data.get("epoch")

    def _start(self, ev: Event, *, at: datetime | None = None) -> None:
        self.loop.set_time((at or ev.at).timestamp())
        declared = self.saga.recorded_events()
        if declared and "events" not in ev.data and not self.replaying:  # the engine's start
            self.rejections.append(NewEvent(h.EVENTS_DECLARED, data={"events": declared}))
        self.next_pos = int(ev.data.get("first_pos", 0))  # continued: positions go on
        self.started_by = started_by(ev.data)
        if epoch := int(ev.data.get("epoch", 0)):
            self.rng.seed(seed_for(self.run_id, epoch))
        input_json = ev.data.get("input")
        args: tuple[Any, ...] = ()
        if self.saga.has_input:
            try:
                args = (self.saga.input.from_json(input_json, what=f"input of {self.saga.name!r}"),)
            except ValidationError as e:
                self.stopped = True
                self.outcome = {"error": ErrorInfo.from_exception(e).to_json()}
                return
        coro = self.saga.fn(self.ctx, *args)
        context = contextvars.copy_context()
        context.run(_current.set, self.ctx)  # current_saga(), in every task the saga creates
        self.context = context.copy()  # for the tasks of event handlers
        self.main = self.loop.create_task(coro, name=f"saga:{self.run_id}", context=context)
        self._run()

    def _deliver(self, ev: Event) -> None:
        self.loop.set_time(ev.at.timestamp())
        if ev.kind == h.CANCEL_REQUESTED:  # the code is fed no more: unwind it now, on its
            self.close()  # own loop, rather than leave it to the garbage collector
            return
        if ev.kind == h.CANCEL_DELIVERED:  # CancelledError at the code's pending await: its
            if self.main is not None and not self.main.done():  # finally/except clean up
                self.main.cancel()
            self._run()
            return
        if ev.kind == h.EVENT_ARRIVED:
            name = str(ev.name)
            data, key = ev.data.get("data"), ev.data.get("key")
            waiting = self.waiters.get(name)
            while waiting and waiting[0] not in self.pending:
                waiting.popleft()
            taker = next((p for p in list(waiting or ()) if self._takes(p, key, data)), None)
            if taker is not None:
                self._resolve_wait(taker, name, data, ev.seq)
            elif self.handlers.handle(name, data):  # its handler runs now, in history order
                self.taken_by_handler(name, ev.seq)
            else:  # kept, with its place in the arrival order, for a later wait
                self.buffered[name].append((ev.seq, data))
                if isinstance(key, str):
                    self.event_keys[ev.seq] = key
        elif ev.kind == h.UPDATE_ACCEPTED:
            self.updates.deliver(str(ev.name), str(ev.data.get("update_id")), ev.data.get("data"))
        else:
            assert ev.pos is not None
            pending = self.pending.pop(ev.pos, None)
            if pending is None or pending.future.done():
                return  # stale: a timeout after its event, a late duplicate, a cancelled await
            if ev.kind in (h.STEP_COMPLETED, h.CHILD_COMPLETED):
                conv: Converter = pending.model
                try:
                    pending.future.set_result(
                        conv.from_json(ev.data.get("result"), what=f"result of {pending.name!r}")
                    )
                except ValidationError as e:
                    pending.future.set_exception(e)
            elif ev.kind in (h.STEP_FAILED, h.CHILD_FAILED):
                error = ErrorInfo.from_json(ev.data["error"])
                pending.future.set_exception(StepFailedError(pending.name, error))
            elif pending.kind == h.EVENT_WAITING:  # the wait's timeout fired
                self._forget_wait(ev.pos, pending.model)
                pending.future.set_exception(EventTimeoutError(pending.name))
            else:
                pending.future.set_result(None)
        self._run()

    def taken_by_handler(self, name: str, seq: int) -> None:
        """An ``on_event`` handler took the event at ``seq``: once the run routes events, say
        so (``event_taken`` without a position), as ``RunState`` keeps it until told."""
        self.event_keys.pop(seq, None)
        if self.routes and not self.replaying:
            self.rejections.append(NewEvent(h.EVENT_TAKEN, None, name, {"seq": seq}))

    def _takes(self, pos: int, key: Any, data: Any) -> bool:
        """Whether the wait at ``pos`` takes an event of its names with ``key`` and ``data``:
        any, unless it waits on a key (the event's must be it) or a predicate (``match``,
        saga code: true for the data). A predicate that raises ends the wait with its
        exception (raised at the await); the event goes on to the other waits."""
        pending = self.pending.get(pos)
        if pending is None or pending.future.done():
            return False
        spec: WaitSpec = pending.model
        if spec.key is not None and key != spec.key:
            return False
        if spec.match is None:
            return True
        try:
            if self.loop.is_running():  # called from saga code: under its deadline already
                return bool(spec.match(data))
            with self.guarded():  # the watchdog's guard does not nest
                return bool(spec.match(data))
        except Exception as e:  # the wait ends with it; the event goes on to the others
            del self.pending[pos]
            self._forget_wait(pos, spec)
            if not self.replaying:
                self.rejections.append(NewEvent(h.EVENT_TAKEN, pos, pending.name, {}))
            pending.future.set_exception(e)
            return False

    def _resolve_wait(self, pos: int, name: str, data: Any, seq: int) -> None:
        """Give the event ``name`` (that arrived at ``seq``) to the wait at ``pos`` (the first
        that takes it). Data that does not fit the wait's model is refused (recorded as
        ``event_rejected``) and consumed: the wait goes on."""
        pending = self.pending[pos]
        spec: WaitSpec = pending.model
        self.event_keys.pop(seq, None)
        if self.replaying and pos in self.taken and self.taken[pos] != seq:
            self._diverged(
                f"non-deterministic saga code: the wait at position {pos} took the event at "
                f"seq {self.taken[pos]}, the code now takes the one at seq {seq} (its key or "
                "match= changed?)",
                pos,
            )
        if self.routes and not self.replaying:  # which event this wait took
            self.rejections.append(NewEvent(h.EVENT_TAKEN, pos, name, {"seq": seq}))
        model = spec.models.get(name)
        if model is not None:
            try:
                data = Converter(model).from_json(data, what=f"event {name!r}")
            except ValidationError as e:
                reason = str(e)[:2000]
                if not self.replaying:
                    self.rejections.append(
                        NewEvent(h.EVENT_REJECTED, pos, name, {"reason": reason})
                    )
                self.ctx.logger.warning("event %r refused: %s", name, reason)
                return
        del self.pending[pos]
        self._forget_wait(pos, spec)
        pending.future.set_result(Received(name, data) if spec.any_of else data)

    def _forget_wait(self, pos: int, spec: WaitSpec) -> None:
        for name in spec.names:
            waiting = self.waiters.get(name)
            if waiting is not None and pos in waiting:
                waiting.remove(pos)

    def wait(self, spec: WaitSpec, label: str, data: dict[str, Any]) -> asyncio.Future[Any]:
        """Issue the wait; if events it takes were kept, give it the earliest to arrive."""
        if spec.refuse_early:
            for name in spec.names:
                for _ in self.buffered.pop(name, ()):
                    if not self.replaying:
                        self.rejections.append(NewEvent(h.EVENT_REJECTED, None, name, EARLY))
        pos, future = self.command(h.EVENT_WAITING, label, data, spec)
        if pos in self.pending:
            for name in spec.names:
                self.waiters[name].append(pos)
            while pos in self.pending and not future.done():
                kept = sorted(
                    (seq, n, value)
                    for n in spec.names
                    for seq, value in self.buffered.get(n, ())
                    if self._takes(pos, self.event_keys.get(seq), value)
                )
                if not kept:
                    break
                seq, name, value = kept[0]
                self.buffered[name].remove((seq, value))
                self._resolve_wait(pos, name, value, seq)
        return future

    def _on_done(self, pos: int, future: asyncio.Future[Any]) -> None:
        """An await that saga code cancelled (it lost a race in ``asyncio.wait``, say) stops
        waiting: its later result, timer or event goes elsewhere or nowhere. The child run of
        a cancelled ``ctx.call`` is asked to cancel, a cancelled timer is recorded as such
        (each once, when it happens)."""
        if future.cancelled():
            pending = self.pending.pop(pos, None)
            if pending is not None and pending.kind == h.EVENT_WAITING:
                self._forget_wait(pos, pending.model)
                if pending.model.routed and not self.replaying:  # its subscription ends
                    self.rejections.append(NewEvent(h.EVENT_TAKEN, pos, pending.name, {}))
            elif pending is not None and pending.kind == h.CHILD_STARTED and not self.replaying:
                self.rejections.append(NewEvent(h.CHILD_CANCEL_REQUESTED, pos, pending.name, {}))
            elif pending is not None and pending.kind == h.TIMER_STARTED and not self.replaying:
                self.rejections.append(NewEvent(h.TIMER_CANCELLED, pos, pending.name, {}))

    def take_rejections(self) -> list[NewEvent]:
        rejections, self.rejections = self.rejections, []
        return rejections

    def run_code(self) -> None:
        """Run the saga code (its main task, handlers and other tasks) until it blocks."""
        self._run()

    def guarded(self) -> contextlib.AbstractContextManager[None]:
        """Saga code runs under the activation deadline (when there is a watchdog)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.guard(f"saga {self.saga.name!r} (run {self.run_id!r})")

    def _run(self) -> None:
        with self.guarded():
            self.loop.run_until_blocked()
        if self.main is not None and self.main.done() and self.outcome is None:
            self._finish(self.main)

    def _finish(self, task: asyncio.Task[Any]) -> None:
        self.stopped = True
        failure = self.handlers.failure  # an event handler raised: the run ends with it
        if failure is None and task.cancelled():
            self.outcome = {
                "error": ErrorInfo("CancelledError", "the saga was cancelled").to_json(),
                "cancelled": True,  # the code let CancelledError out (see decide)
            }
            return
        exc = failure if failure is not None else task.exception()
        if exc is None:
            try:
                output = self.saga.output.to_json(task.result(), what=f"saga {self.saga.name!r}")
                self.outcome = {"output": output}
            except ValidationError as e:
                self.outcome = {"error": ErrorInfo.from_exception(e).to_json()}
        elif isinstance(exc, NonDeterminismError):
            self.nondeterminism = exc
        elif isinstance(exc, ContinueAsNew):
            self.outcome = {"continue_as_new": exc.input, "next_pos": self.next_pos}
        else:
            error = ErrorInfo.from_exception(exc, with_traceback=True)  # where saga code raised
            self.outcome = {"error": error.to_json()}

    # --- commands ----------------------------------------------------------------------------

    def diverged(self, message: str, pos: int) -> None:
        """Note a divergence of the code from the history (raised by :meth:`feed`)."""
        self._diverged(message, pos)

    def _diverged(self, message: str, pos: int) -> None:
        if self.nondeterminism is None:
            self.nondeterminism = NonDeterminismError(
                f"run {self.run_id!r}: {message}",
                run_id=self.run_id,
                position=pos,
                fix=fix_for(self.run_id, pos),
            )

    def _raise_divergence(self) -> None:
        if self.nondeterminism is not None:
            raise self.nondeterminism

    def is_deprecated(self, ev: Event) -> bool:
        """A marker of a change that saga code deprecated (``ctx.deprecate_patch``)."""
        return ev.kind == h.MARKER and ev.name in self.deprecated

    def skip_deprecated(self) -> None:
        """Step over the deprecated markers recorded at the next positions: the code that
        recorded them called ``patched`` there, the code now does not."""
        while (ev := self.recorded.get(self.next_pos)) is not None and self.is_deprecated(ev):
            self.next_pos += 1

    def peek_pos(self) -> int:
        """The position the next command will take (deprecated markers skipped)."""
        self.skip_deprecated()
        return self.next_pos

    def command(
        self, kind: str, name: str, data: dict[str, Any], model: Any = None
    ) -> tuple[int, asyncio.Future[Any]]:
        pos = self.peek_pos()
        self.next_pos += 1
        future: asyncio.Future[Any] = self.loop.create_future()
        if self.stopped:  # issued while unwinding (see close): never recorded, never resolved
            return pos, future
        recorded = self.recorded.get(pos)
        issued = NewEvent(kind, pos, name, data)
        if recorded is not None:
            if recorded.kind != kind or not self._same_name(kind, recorded.name, name):
                self._diverged(
                    f"non-deterministic saga code: the history has {recorded.describe()}, the "
                    f"code now issues {Event(0, kind, recorded.at, pos, name).describe()}",
                    pos,
                )
                return pos, future  # never resolves; the activation parks the run
        else:
            self.new_commands.append(issued)
        if kind not in h.INSTANT_KINDS:
            self.pending[pos] = _Pending(kind, name, future, model)
            future.add_done_callback(functools.partial(self._on_done, pos))
        return pos, future

    def _same_name(self, kind: str, recorded: str | None, issued: str) -> bool:
        if recorded == issued:
            return True
        if kind == h.STEP_SCHEDULED and recorded is not None:
            step = self.app.get_step(recorded)
            return step is not None and step.name == issued
        return False

    def take_new_commands(self) -> list[NewEvent]:
        """The commands the code issued since the last call. The engine calls this at the end
        of each batch of events it fed: the conditions that are true now are resolved first
        (every handler of the batch has run), and the code goes on."""
        if not self.stopped and self.main is not None:
            self.conditions.settle()
        commands, self.new_commands = self.new_commands, []
        return commands

    def _durable_timer(self, seconds: float) -> asyncio.Future[Any]:
        """The timer of an asyncio timer (``call_later``): the command ``ctx.sleep`` issues."""
        fire_at = self.now() + timedelta(seconds=seconds)
        _, future = self.command(h.TIMER_STARTED, "sleep", {"fire_at": fire_at.isoformat()})
        return future

    def is_pending(self, pos: int) -> bool:
        return pos in self.pending

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.loop.time(), UTC)


def check_replay(
    app: App, saga: SagaDef[Any, Any], run_id: str, events: Sequence[Event], *, whole: bool
) -> None:
    """Replay ``events`` (in ``seq`` order) against the saga code as it is now, and raise
    NonDeterminismError at the first divergence: a recorded command the code no longer issues
    or issues otherwise; with ``whole`` (the history is a run's, not a part of it kept by a
    fork), a command the code issues beyond the history too. ActivationDeadlineError for saga
    code that runs on without yielding. The engine would park the run for either."""
    code = Replayer(app, saga, run_id, watchdog=Watchdog())
    try:
        code.feed(list(events), replaying=True)
        recorded = [e for e in events if e.kind in h.COMMAND_KINDS and e.pos is not None]
        gone = sorted(
            (
                e
                for e in recorded
                if e.pos is not None and e.pos >= code.next_pos and not code.is_deprecated(e)
            ),
            key=lambda e: e.pos or 0,
        )
        if gone:
            message = f"the history has {gone[0].describe()} but the saga code no longer issues it"
            raise _diverged(run_id, gone[0].pos, message)
        new = code.take_new_commands() if whole else []
        if new:
            issued = Event(0, new[0].kind, events[-1].at, new[0].pos, new[0].name)
            message = f"the history ends at event {events[-1].seq}, the code now issues "
            raise _diverged(run_id, new[0].pos, message + issued.describe())
    finally:
        code.close()


def _diverged(run_id: str, pos: int | None, message: str) -> NonDeterminismError:
    return NonDeterminismError(
        f"run {run_id!r}: non-deterministic saga code: {message}",
        run_id=run_id,
        position=-1 if pos is None else pos,
        fix=fix_for(run_id, pos),
    )


def fix_for(run_id: str, pos: int | None) -> str:
    """What to do about a divergence at ``pos``: the words that end a non-determinism's
    message (``NonDeterminismError.fix``)."""
    where = "there" if pos is None or pos < 0 else f"at position {pos}"
    return (
        f"to fix: make the saga code issue the recorded command {where} again for runs that "
        "recorded it (keep the old code path, or branch on ctx.patched('change-id') so runs "
        "that passed there with the old code take it: docs/concepts/versioning.md), deploy "
        f"it, then `sagaloop retry {run_id}` resumes a parked run where it was"
    )
