"""What saga code can do: the :class:`Context` a :class:`~sagaloop.engine.replay.Replayer`
gives it. Each method checks its arguments (a bad one raises ``ValidationError`` in the saga
code, before anything is recorded) and issues one command, or waits, through the replayer, which
numbers commands in issue order and matches them against the history. Nothing here touches the
store, the clock or the broker: ``now()``, ``uuid4()`` and ``random()`` come from the replayer,
so that a replay sees the same values.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from sagaloop.engine import history as h
from sagaloop.engine.handlers import CONDITION
from sagaloop.engine.messages import derived_id
from sagaloop.errors import ApprovalDenied, ChildTimeoutError, ValidationError
from sagaloop.sagas.app import SagaDef, StepDef, model_path
from sagaloop.sagas.approvals import Approval, OnTimeout, request_approval, schema_error
from sagaloop.sagas.context import Early, Received, SagaContext
from sagaloop.sagas.convert import ANY, Converter

if TYPE_CHECKING:
    from sagaloop.engine.replay import Replayer

logger = logging.getLogger("sagaloop.saga")


class SagaLogger(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, replayer: Replayer) -> None:
        super().__init__(logger, {"run_id": replayer.run_id, "saga": replayer.saga.name})
        self._replayer = replayer

    def isEnabledFor(self, level: int) -> bool:
        return not self._replayer.replaying and super().isEnabledFor(level)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}  # type: ignore[dict-item]
        return msg, kwargs


CALL_TIMEOUT = "call_timeout"
"""The name of the timer of ``ctx.call(saga, ..., timeout=...)`` (a sleep's is ``sleep``)."""


class ContinueAsNew(BaseException):
    """Raised by ``ctx.continue_as_new``; a BaseException so that ``except Exception`` in saga
    code does not catch it."""

    def __init__(self, input: Any) -> None:
        super().__init__("continue as new")
        self.input = input


@dataclasses.dataclass(frozen=True, slots=True)
class WaitSpec:
    """What a wait takes: events of these names, each validated with its model (if any)."""

    names: tuple[str, ...]
    models: dict[str, Any]
    any_of: bool
    """``wait_for_any``: the result is a ``Received(name, data)``, not the data alone."""
    refuse_early: bool = False
    """``early="refuse"``: events kept from before the wait began are refused, not taken."""
    key: str | None = None
    """Only published events of this key (``wait_for_event(name, key=...)``)."""
    match: Callable[[Any], object] | None = None
    """Only events whose JSON data this deterministic predicate is true for."""

    @property
    def routed(self) -> bool:
        """A wait on published events: the run is subscribed to its names while it waits."""
        return self.key is not None or self.match is not None


def _fits(edit: Any, *, schema: dict[str, Any], what: str) -> None:
    error = schema_error(edit, schema)
    if error is not None:
        raise ValidationError(f"{what}: {error}")


def _check_topic(what: str, name: Any, key: Any) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= 200 or "\x00" in name:
        raise ValidationError(f"{what} needs an event name of 1 to 200 characters")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 200 or "\x00" in key):
        raise ValidationError(f"{what}: a key is 1 to 200 characters, not {key!r:.60}")


def _early(early: Any) -> dict[str, Any]:
    """What a wait records of its ``early`` option (nothing for the default)."""
    if early not in ("keep", "refuse"):
        raise ValidationError(f"early is 'keep' or 'refuse', not {early!r:.40}")
    return {"early": "refuse"} if early == "refuse" else {}


class Context(SagaContext):
    """The ``ctx`` saga code receives: each method checks its arguments and issues one
    command through the replayer (:meth:`Replayer.command`, :meth:`Replayer.wait`), which
    numbers it and matches it against the history."""

    def __init__(self, replayer: Replayer) -> None:
        self._r = replayer
        self.run_id = replayer.run_id
        self.saga = replayer.saga.name
        self.logger = SagaLogger(replayer)
        self._approvals: set[str] = set()  # call ids used in this history

    async def call(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(step, SagaDef):
            return await self._child(step, *args, **kwargs)
        if not isinstance(step, StepDef):
            raise TypeError(f"ctx.call takes a step or saga declared on the app, not {step!r}")
        if self._r.app.get_step(step.name) is not step:
            raise ValidationError(
                f"step {step.name!r} is not registered in app {self._r.app.name!r}"
            )
        args_json = step.signature.args_to_json(args, kwargs, what=f"step {step.name!r}")
        if step.approval:
            what = f"step {step.name!r} (edited arguments)"
            decision = await request_approval(
                self,
                str(self._r.peek_pos()),
                step.name,
                args_json,
                timeout=step.approval_timeout,
                on_timeout="deny",
                reason=None,
                taken=self._approvals,
                args_schema=step.signature.args_schema(),
                check=lambda edit: step.signature.args_from_json(edit, what=what),
            )
            if not decision.approved:
                raise ApprovalDenied(step.name, decision.reason)
            if decision.edited:  # the approver's arguments, checked as the caller's were
                edited = step.signature.args_from_json(decision.args, what=what)
                args_json = step.signature.args_to_json((), edited, what=what)
        data = {"args": args_json, "queue": step.queue}
        _, future = self._r.command(h.STEP_SCHEDULED, step.name, data, step.result)
        return await future

    async def _child(
        self,
        saga: SagaDef[Any, Any],
        *args: Any,
        run_id: str | None = None,
        timeout: timedelta | None = None,
    ) -> Any:
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
            raise ValidationError(
                f"the timeout of a call of saga {saga.name!r} is a positive timedelta, "
                f"not {timeout!r:.60}"
            )
        if self._r.app.get_saga(saga.name) is not saga:
            raise ValidationError(
                f"saga {saga.name!r} is not registered in app {self._r.app.name!r}"
            )
        if not saga.has_input and args == (None,):  # as Client.start(saga, None) accepts
            args = ()
        if len(args) > 1 or (len(args) == 1 and not saga.has_input):
            raise ValidationError(f"saga {saga.name!r} takes {int(saga.has_input)} input")
        value = saga.input.to_json(args[0] if args else None, what=f"input of saga {saga.name!r}")
        child = run_id or derived_id("child", self.run_id, self._r.peek_pos())
        if not isinstance(child, str) or len(child) > 200:
            raise ValidationError("a child run id must be 1 to 200 characters")
        data = {"run_id": child, "input": value}
        pos, future = self._r.command(h.CHILD_STARTED, saga.name, data, saga.output)
        if timeout is None:
            return await future
        fire_at = (self.now() + timeout).isoformat()  # a durable timer raced against the child
        timing = {"fire_at": fire_at, "child": pos}  # the child settled: the timer is moot
        _, timer = self._r.command(h.TIMER_STARTED, CALL_TIMEOUT, timing)
        try:
            await asyncio.wait((future, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the loser stops waiting: a cancelled child await cancels the child run
            timer.cancel()
            if not future.done():
                future.cancel()
        if future.cancelled():
            raise ChildTimeoutError(saga.name, child, timeout)
        return future.result()

    async def gather(self, *aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
        return await asyncio.gather(*aws, return_exceptions=return_exceptions)

    async def sleep(self, duration: timedelta) -> None:
        if duration <= timedelta(0):
            return
        fire_at = self.now() + duration
        _, future = self._r.command(h.TIMER_STARTED, "sleep", {"fire_at": fire_at.isoformat()})
        await future

    async def wait_for_event(
        self,
        name: str,
        *,
        timeout: timedelta | None = None,
        model: type[Any] | None = None,
        prompt: Any = None,
        early: Early = "keep",
        key: str | None = None,
        match: Callable[[Any], object] | None = None,
    ) -> Any:
        data: dict[str, Any] = _early(early)
        if prompt is not None:
            data["prompt"] = ANY.to_json(prompt, what=f"the prompt of wait_for_event({name!r})")
        if timeout is not None:
            data["timeout_at"] = (self.now() + timeout).isoformat()
        if model is None:  # the model the saga declares for it (@app.saga(events=...))
            model = self._r.saga.events.get(name)
        if (path := model_path(model)) is not None:  # a client checks events with it
            data["model"] = path
        self._r.handlers.refuse_wait((name,))
        spec = WaitSpec((name,), {name: model}, False, early == "refuse", key, match)
        data.update(self._routing(spec, name))
        return await self._r.wait(spec, name, data)

    async def wait_for_any(
        self,
        names: Sequence[str],
        *,
        timeout: timedelta | None = None,
        models: Mapping[str, type[Any]] | None = None,
        prompt: Any = None,
        early: Early = "keep",
        key: str | None = None,
        match: Callable[[Any], object] | None = None,
    ) -> Received:
        names = tuple(dict.fromkeys(names))
        label = "|".join(names)
        if not names or not all(isinstance(n, str) and n for n in names) or len(label) > 200:
            raise ValidationError(
                "wait_for_any takes event names, at most 200 characters joined with '|'"
            )
        self._r.handlers.refuse_wait(names)
        data: dict[str, Any] = {"names": list(names), **_early(early)}
        if prompt is not None:
            data["prompt"] = ANY.to_json(prompt, what=f"the prompt of wait_for_any({label!r})")
        if timeout is not None:
            data["timeout_at"] = (self.now() + timeout).isoformat()
        given, declared = models or {}, self._r.saga.events  # declared: unless given here
        checked = {n: m for n in names if (m := given.get(n, declared.get(n))) is not None}
        found = {n: path for n, m in checked.items() if (path := model_path(m)) is not None}
        if found:
            data["models"] = found
        spec = WaitSpec(names, checked, True, early == "refuse", key, match)
        data.update(self._routing(spec, label))
        result: Received = await self._r.wait(spec, label, data)
        return result

    def _routing(self, spec: WaitSpec, label: str) -> dict[str, Any]:
        """What a wait on published events records (nothing for another wait): the run is
        subscribed to its names and key while it waits."""
        if spec.key is not None and (not isinstance(spec.key, str) or not 0 < len(spec.key) <= 200):
            raise ValidationError(f"the key of a wait for {label!r} is 1 to 200 characters")
        if spec.match is not None and not callable(spec.match):
            raise ValidationError(
                f"match of a wait for {label!r} is a function, not {spec.match!r:.60}"
            )
        if not spec.routed:
            return {}
        self._r.routes = True
        return {"subscribe": True, **({"key": spec.key} if spec.key is not None else {})}

    def subscribe(self, name: str, key: str | None = None) -> None:
        _check_topic("ctx.subscribe", name, key)
        self._r.routes = True
        self._r.command(h.SUBSCRIBED, name, {"key": key} if key is not None else {})

    def unsubscribe(self, name: str, key: str | None = None) -> None:
        _check_topic("ctx.unsubscribe", name, key)
        self._r.command(h.UNSUBSCRIBED, name, {"key": key} if key is not None else {})

    def publish_event(self, name: str, data: Any = None, *, key: str | None = None) -> str:
        _check_topic("ctx.publish_event", name, key)
        value = ANY.to_json(data, what=f"the data of event {name!r}")
        event_id = derived_id("published", self.run_id, self._r.peek_pos())
        recorded: dict[str, Any] = {"event_id": event_id, "data": value}
        if key is not None:
            recorded["key"] = key
        self._r.command(h.EVENT_PUBLISHED, name, recorded)
        return event_id

    def on_event(
        self, name: str, handler: Callable[[Any], Any], *, model: type[Any] | None = None
    ) -> None:
        self._r.handlers.register(name, handler, model)

    async def wait_condition(
        self, fn: Callable[[], object], *, timeout: timedelta | None = None
    ) -> None:
        if not callable(fn):
            raise ValidationError(f"ctx.wait_condition needs a function, not {fn!r:.60}")
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
            raise ValidationError(
                f"the timeout of ctx.wait_condition is a positive timedelta, not {timeout!r:.60}"
            )
        if fn():  # true already: nothing to wait for, nothing recorded
            return
        condition = self._r.conditions.add(fn)
        if timeout is None:
            await condition
            return
        fire_at = (self.now() + timeout).isoformat()  # a durable timer raced against it
        _, timer = self._r.command(h.TIMER_STARTED, CONDITION, {"fire_at": fire_at})
        try:
            await asyncio.wait((condition, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the loser stops waiting
            timer.cancel()
            if not condition.done():
                condition.cancel()
        if not condition.cancelled():
            condition.result()  # what the condition raised, if it did
            return
        if fn():  # true when the timer fired: the condition won
            return
        raise TimeoutError(f"ctx.wait_condition: the condition was still false after {timeout}")

    def all_handlers_finished(self) -> bool:
        return self._r.handlers.all_finished()

    def send_event(self, run_id: str, name: str, data: Any = None) -> None:
        if not isinstance(run_id, str) or not 0 < len(run_id) <= 200:
            raise ValidationError("ctx.send_event needs a run id of 1 to 200 characters")
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValidationError("ctx.send_event needs an event name of 1 to 200 characters")
        value = ANY.to_json(data, what=f"the data of event {name!r}")
        self._r.command(h.EVENT_SENT, name, {"run_id": run_id, "data": value})

    def start(
        self, saga: SagaDef[Any, Any] | str, input: Any = None, *, run_id: str | None = None
    ) -> str:
        definition = self._r.app.get_saga(saga if isinstance(saga, str) else saga.name)
        if definition is None:
            raise ValidationError(f"ctx.start: no saga {saga!r} in app {self._r.app.name!r}")
        value = definition.input.to_json(input, what=f"input of saga {definition.name!r}")
        pos = self._r.peek_pos()
        child = derived_id("spawned", self.run_id, pos) if run_id is None else run_id
        if not isinstance(child, str) or not 0 < len(child) <= 200:
            raise ValidationError("ctx.start needs a run id of 1 to 200 characters")
        self._r.command(h.RUN_SPAWNED, definition.name, {"run_id": child, "input": value})
        return child

    def continue_as_new(self, input: Any = None) -> NoReturn:
        saga = self._r.saga
        value = saga.input.to_json(input, what=f"input of saga {saga.name!r}")
        raise ContinueAsNew(value)

    async def compensate(self) -> None:
        _, future = self._r.command(h.COMPENSATE_REQUESTED, "compensate", {})
        await future

    def publish(self, key: str, value: Any) -> None:
        if not isinstance(key, str) or not key or len(key) > 200:
            raise ValidationError("ctx.publish needs a key of 1 to 200 characters")
        data = {"value": ANY.to_json(value, what=f"the value published as {key!r}")}
        self._r.command(h.PUBLISHED, key, data)

    async def approval(
        self,
        action: str,
        args: Any = None,
        *,
        call_id: str | None = None,
        timeout: timedelta | None = None,
        on_timeout: OnTimeout = "deny",
        reason: str | None = None,
        args_type: Any = None,
        args_schema: dict[str, Any] | None = None,
    ) -> Approval:
        what = f"the edited arguments of approval {action!r}"
        schema, check = args_schema, None
        if args_type is not None:
            converter = Converter(args_type)
            schema = converter.json_schema() if schema is None else schema
            check = lambda edit: converter.from_json(edit, what=what)  # noqa: E731
        elif schema is not None:
            check = functools.partial(_fits, schema=schema, what=what)
        return await request_approval(
            self,
            str(self._r.peek_pos()) if call_id is None else call_id,
            action,
            args,
            timeout=timeout,
            on_timeout=on_timeout,
            reason=reason,
            taken=self._approvals,
            args_schema=schema,
            check=check,
        )

    def now(self) -> datetime:
        return self._r.now()

    def uuid4(self) -> uuid.UUID:
        return uuid.UUID(int=self._r.rng.getrandbits(128), version=4)

    def random(self) -> float:
        return self._r.rng.random()

    def patched(self, change_id: str) -> bool:
        recorded = self._r.recorded.get(self._r.peek_pos())
        if recorded is not None:
            if recorded.kind == h.MARKER and recorded.name == change_id:
                self._r.command(h.MARKER, change_id, {})
                return True
            return False  # the run passed here with code that did not have the change
        self._r.command(h.MARKER, change_id, {})
        return True

    def deprecate_patch(self, change_id: str) -> None:
        if not isinstance(change_id, str) or not change_id or len(change_id) > 200:
            raise ValidationError("a change id is a string of 1 to 200 characters")
        self._r.deprecated.add(change_id)  # its recorded markers are skipped from here on
        self._r.skip_deprecated()

    @property
    def started_by(self) -> str | None:
        return self._r.started_by

    @property
    def history_length(self) -> int:
        return self._r.last_seq

    @property
    def is_replaying(self) -> bool:
        return self._r.replaying

    def on_update(
        self,
        name: str,
        handler: Callable[[Any], Any],
        *,
        validator: Callable[[Any], object] | None = None,
        model: type[Any] | None = None,
    ) -> None:
        self._r.updates.register(name, handler, validator, model)
