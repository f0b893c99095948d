"""Event handlers and conditions of saga code (``ctx.on_event``, ``ctx.wait_condition``).

A handler takes every event of its name as the replayer feeds it, in history order, whatever
the saga's main code awaits: each event runs the handler in a task of its own on the saga's
loop (a sync handler runs to its end at once; an async one may await commands). Events of the
name kept from before the registration are handled when it happens, oldest first.

A condition is resolved by the engine, never by a timer of asyncio: live, at the end of each
batch of events the run is fed (:meth:`Conditions.settle`, called when the engine takes the
code's new commands), so every handler of the batch has run when the code resumes; each
resolution is recorded as a ``condition_met`` command (named :data:`CONDITION`) at the next
position. A replay resolves the condition where the history records it
(:meth:`Conditions.replay_marker`): the code resumes at the same point, whatever the batches
of the replaying activation are.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.errors import ActivationDeadlineError, ValidationError
from sagaloop.sagas.convert import Converter

if TYPE_CHECKING:
    from sagaloop.engine.replay import Replayer

CONDITION = "wait_condition"
"""The name of the ``condition_met`` command recording that a ``ctx.wait_condition`` was
resolved, and of its timeout's timer."""


class _Handler:
    __slots__ = ("converter", "fn", "name")

    def __init__(self, name: str, fn: Callable[..., Any], converter: Converter | None):
        self.name, self.fn, self.converter = name, fn, converter


class _Condition:
    __slots__ = ("fn", "future", "number")

    def __init__(self, number: int, fn: Callable[[], object], future: asyncio.Future[None]):
        self.number, self.fn, self.future = number, fn, future


class Handlers:
    """The event handlers registered by one run's saga code."""

    def __init__(self, replayer: Replayer) -> None:
        self._r = replayer
        self.by_name: dict[str, _Handler] = {}
        self.running: set[asyncio.Task[None]] = set()
        self.failure: BaseException | None = None
        """What a handler raised: it ends the run as if the main code had raised it."""

    def register(self, name: str, fn: Callable[..., Any], model: type[Any] | None) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValidationError("ctx.on_event needs an event name of 1 to 200 characters")
        if not callable(fn):
            raise ValidationError(f"ctx.on_event({name!r}, ...) needs a function, not {fn!r:.60}")
        if name in self.by_name:
            raise ValidationError(
                f"event {name!r} already has a handler: register one handler per event name"
            )
        if any(pos in self._r.pending for pos in self._r.waiters.get(name, ())):
            raise ValidationError(
                f"the saga already waits for event {name!r} with wait_for_event or wait_for_any: "
                "an event name is handled or awaited, not both"
            )
        if model is None:  # the model the saga declares for it (@app.saga(events=...))
            model = self._r.saga.events.get(name)
        converter = Converter(model) if model is not None else None
        self.by_name[name] = _Handler(name, fn, converter)
        for seq, data in self._r.buffered.pop(name, ()):  # kept: handled now, oldest first
            self._r.taken_by_handler(name, seq)
            self.handle(name, data, now=True)

    def refuse_wait(self, names: tuple[str, ...]) -> None:
        handled = [n for n in names if n in self.by_name]
        if handled:
            raise ValidationError(
                f"event {handled[0]!r} has a handler (ctx.on_event): it is handled as it "
                "arrives, so it cannot be awaited; wait with ctx.wait_condition on the state "
                "the handler updates"
            )

    def handle(self, name: str, data: Any, *, now: bool = False) -> bool:
        """Start the handler of ``name`` on ``data`` (False: no handler takes ``name``): in a
        task, or ``now`` in the calling code. Data that does not fit its model is refused
        (recorded as ``event_rejected``)."""
        handler = self.by_name.get(name)
        if handler is None:
            return False
        if handler.converter is not None:
            try:
                data = handler.converter.from_json(data, what=f"event {name!r}")
            except ValidationError as e:
                reason = str(e)[:2000]
                if not self._r.replaying:
                    self._r.rejections.append(
                        NewEvent(h.EVENT_REJECTED, None, name, {"reason": reason})
                    )
                self._r.ctx.logger.warning("event %r refused: %s", name, reason)
                return True
        if now:  # at registration, in the code that registers: a sync handler ends first
            try:
                result = handler.fn(data)
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                self._fail(e)
                return True
            if inspect.isawaitable(result):
                self._task(self._finish(result), name)
            return True
        self._task(self._call(handler, data), name)
        return True

    def _task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        context = self._r.context.copy() if self._r.context is not None else None
        task = self._r.loop.create_task(coro, name=f"handler:{name}", context=context)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def _call(self, handler: _Handler, data: Any) -> None:
        try:
            result = handler.fn(data)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # ends the run, as the main code's would
            self._fail(e)
            return
        if inspect.isawaitable(result):
            await self._finish(result)

    async def _finish(self, result: Awaitable[Any]) -> None:
        try:
            await result
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # ends the run, as the main code's would
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = e
            main = self._r.main
            if main is not None and not main.done():
                main.cancel()

    def all_finished(self) -> bool:
        return not self.running

    def start_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` (an update's handler) as a handler: ``all_finished`` waits for it."""
        self._task(coro, name)

    def fail(self, e: BaseException) -> None:
        """End the run with ``e``, as an exception of the main code would."""
        self._fail(e)


class Conditions:
    """The ``ctx.wait_condition`` calls pending in one run's saga code, in call order."""

    def __init__(self, replayer: Replayer) -> None:
        self._r = replayer
        self.pending: collections.deque[_Condition] = collections.deque()
        self.count = 0

    def add(self, fn: Callable[[], object]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = self._r.loop.create_future()
        self.count += 1
        self.pending.append(_Condition(self.count, fn, future))
        return future

    def _first_true(self) -> tuple[_Condition, BaseException | None] | None:
        with self._r.guarded():  # a condition is saga code: under the deadline
            return self._find()

    def _find(self) -> tuple[_Condition, BaseException | None] | None:
        for cond in list(self.pending):
            if cond.future.done():  # cancelled: its await lost a race or timed out
                self.pending.remove(cond)
                continue
            try:
                if cond.fn():
                    return cond, None
            except Exception as e:  # raised at the await, as the code's own exception
                return cond, e
        return None

    def _resolve(self, cond: _Condition, error: BaseException | None) -> None:
        self.pending.remove(cond)
        self._r.command(h.CONDITION_MET, CONDITION, {"condition": cond.number})
        if error is None:
            cond.future.set_result(None)
        else:
            cond.future.set_exception(error)

    def settle(self) -> None:
        """Live: resolve, one at a time in call order, the conditions now true, recording a
        marker for each, and run the code after each."""
        while not self._r.stopped and self._r.nondeterminism is None:
            found = self._first_true()  # one that overruns fails the activation: retried,
            if found is None:  # then the run is parked
                return
            self._r.replaying = False
            self._resolve(*found)
            try:
                self._r.run_code()
            except ActivationDeadlineError as e:  # the engine parks the run as it feeds the
                self._r.overran = e  # commands issued (the marker at least)
                return

    def replay_marker(self, pos: int, data: dict[str, Any]) -> bool:
        """Replay: the history records a condition resumed at ``pos``; resolve the one the code
        waits on, or note the divergence (False: the code issued this marker already)."""
        if pos < self._r.peek_pos():
            return False  # issued already
        found = self._first_true() if pos == self._r.peek_pos() else None
        if found is None or found[0].number != data.get("condition"):
            self._r.diverged(
                f"non-deterministic saga code: the history has wait_condition "
                f"#{data.get('condition')} resumed at position {pos}, but the saga code waits "
                "on no condition that is true there",
                pos,
            )
            return True
        self._resolve(*found)
        self._r.run_code()
        return True
