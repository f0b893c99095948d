"""Updates: a message that returns a value or an error to its sender (``Client.update``,
``ctx.on_update``; Temporal's ``@workflow.update``).

An ``update`` message reaches the engine (its id ``update:{run_id}:{update_id}``, so a
redelivery or a retry with the same ``update_id`` is the same message). :class:`Arrival`, its
trigger, judges it against the run's live saga code before anything is recorded: an update
already answered or in progress is ignored (its answer is, or will be, in the history); one the
run cannot take (no handler, data that does not fit the handler's model, a run that needs
attention, a validator that raises) is recorded as ``update_refused`` and nothing else happens;
otherwise ``update_accepted`` is recorded and fed to the handler, in history order, as an event
is to its ``ctx.on_event`` handler. When the handler returns or raises, the replayer records
``update_completed`` with its result or error. A replay feeds ``update_accepted`` to the handler
again and records nothing: the answer is in the history already (both were written by the
activation in which the handler ended).

The answers of the latest :data:`CARRIED` updates go into the next history of a run that
continues as new (its ``run_started``), so a retried update is still answered the same.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.errors import ErrorInfo, NonDeterminismError, ValidationError
from sagaloop.sagas.convert import ANY, Converter

if TYPE_CHECKING:
    from sagaloop.engine.replay import Replayer
    from sagaloop.engine.state import RunState

CARRIED = 1000
"""How many answers (the latest) a run that continues as new carries into its next history."""
REFUSED = "refused"
"""The key an answer has (True) when the update was refused, never applied."""


class _Update:
    __slots__ = ("converter", "fn", "name", "validator")

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        validator: Callable[..., Any] | None,
        converter: Converter | None,
    ) -> None:
        self.name, self.fn, self.validator, self.converter = name, fn, validator, converter


def refusal(error: ErrorInfo) -> dict[str, Any]:
    return {"error": error.to_json(), REFUSED: True}


class Updates:
    """The update handlers registered by one run's saga code."""

    def __init__(self, replayer: Replayer) -> None:
        self._r = replayer
        self.by_name: dict[str, _Update] = {}

    def register(
        self,
        name: str,
        fn: Callable[..., Any],
        validator: Callable[..., Any] | None,
        model: type[Any] | None,
    ) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= 200:
            raise ValidationError("ctx.on_update needs an update name of 1 to 200 characters")
        if not callable(fn):
            raise ValidationError(f"ctx.on_update({name!r}, ...) needs a function, not {fn!r:.60}")
        if validator is not None and (
            not callable(validator) or inspect.iscoroutinefunction(validator)
        ):
            raise ValidationError(
                f"the validator of update {name!r} is a plain (not async) function that raises "
                f"to refuse the update, not {validator!r:.60}"
            )
        if name in self.by_name:
            raise ValidationError(
                f"update {name!r} already has a handler: register one handler per update name"
            )
        converter = Converter(model) if model is not None else None
        self.by_name[name] = _Update(name, fn, validator, converter)

    def judge(self, name: str, data: Any) -> ErrorInfo | None:
        """Live, before anything is recorded: why the run refuses the update (None: it takes
        it). The validator runs here, on the run's state as it is now; a command it issues
        is taken back, and refuses the update."""
        update = self.by_name.get(name)
        if update is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            return ErrorInfo(
                "UpdateRefused",
                f"the run has no handler for update {name!r} (ctx.on_update; it has: {known})",
            )
        try:
            value = self._convert(update, data)
        except ValidationError as e:
            return ErrorInfo.from_exception(e)
        if update.validator is None:
            return None
        next_pos, issued = self._r.next_pos, len(self._r.new_commands)
        replaying, self._r.replaying = self._r.replaying, False
        try:
            with self._r.guarded():
                if self._r.context is not None:
                    self._r.context.run(update.validator, value)
                else:
                    update.validator(value)
        except Exception as e:
            return ErrorInfo.from_exception(e)
        finally:
            self._r.replaying = replaying
        if self._r.next_pos != next_pos or len(self._r.new_commands) != issued:
            self._r.next_pos = next_pos
            del self._r.new_commands[issued:]
            return ErrorInfo(
                "ValidationError",
                f"the validator of update {name!r} issued a command: a validator only reads "
                "the saga's state, and raises to refuse",
            )
        return None

    def _convert(self, update: _Update, data: Any) -> Any:
        if update.converter is None:
            return data
        return update.converter.from_json(data, what=f"update {update.name!r}")

    def deliver(self, name: str, update_id: str, data: Any) -> None:
        """Run the handler of the accepted update ``update_id`` in a task of its own."""
        update = self.by_name.get(name)
        if update is None:
            self._r.diverged(
                f"non-deterministic saga code: the history has update {name!r} accepted, but "
                "the saga code registers no handler for it (ctx.on_update)",
                self._r.next_pos,
            )
            return
        self._r.handlers.start_task(self._run(update, update_id, data), f"update:{name}")

    async def _run(self, update: _Update, update_id: str, data: Any) -> None:
        try:
            result = update.fn(self._convert(update, data))
            if inspect.isawaitable(result):
                result = await result
            answer: dict[str, Any] = {"result": ANY.to_json(result, what=f"update {update.name!r}")}
        except asyncio.CancelledError:
            raise
        except NonDeterminismError as e:
            self._r.handlers.fail(e)
            return
        except Exception as e:  # the update fails; the run goes on
            answer = {"error": ErrorInfo.from_exception(e).to_json()}
        except BaseException as e:  # continue_as_new...: as the main code's would
            self._r.handlers.fail(e)
            return
        if not self._r.replaying:  # a replay finds it recorded
            data = {"update_id": update_id, **answer}
            self._r.rejections.append(NewEvent(h.UPDATE_COMPLETED, None, update.name, data))


class Arrival:
    """The trigger of an ``update`` message: set :attr:`code` (the run's live saga code, or
    None) before calling it on the run's state."""

    def __init__(self, name: str, update_id: str, data: Any) -> None:
        self.name, self.update_id, self.data = name, update_id, data
        self.code: Replayer | None = None

    def __call__(self, st: RunState) -> list[NewEvent]:
        if self.update_id in st.updates:
            return []  # answered, or its handler runs: the answer is (or will be) recorded
        info = {"update_id": self.update_id}
        why: ErrorInfo | None
        if st.parked is not None:
            why = ErrorInfo("UpdateRefused", "the run needs attention: it takes no update")
        elif st.saga_done or st.failing or self.code is None or self.code.stopped:
            why = ErrorInfo(
                "UpdateRefused", "the run's code is not running (it has ended): it takes no update"
            )
        else:
            why = self.code.updates.judge(self.name, self.data)
        if why is not None:
            return [NewEvent(h.UPDATE_REFUSED, name=self.name, data={**info, **refusal(why)})]
        return [NewEvent(h.UPDATE_ACCEPTED, name=self.name, data={**info, "data": self.data})]


def carried(st: RunState) -> dict[str, Any]:
    """The answers a run that continues as new carries into its next history: the latest
    :data:`CARRIED`; an update whose handler had not finished is answered with an error."""
    answers: dict[str, Any] = {}
    for update_id, answer in list(st.updates.items())[-CARRIED:]:
        if answer is None:
            answer = {
                "error": ErrorInfo(
                    "UpdateAbandoned",
                    "the run continued as new before the update's handler finished",
                ).to_json()
            }
        answers[update_id] = answer
    return answers
