"""The contexts handed to saga and step code. Their implementations live in ``sagaloop.engine``."""

from __future__ import annotations

import abc
import contextvars
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Literal,
    NamedTuple,
    NoReturn,
    ParamSpec,
    TypeVar,
    overload,
)

from sagaloop.errors import ValidationError

if TYPE_CHECKING:
    from sagaloop.sagas.app import SagaDef, StepDef
    from sagaloop.sagas.approvals import Approval

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
SUGGESTED_HISTORY = 4096
"""The history length past which ``ctx.continue_as_new_suggested`` is True."""
Early = Literal["keep", "refuse"]
"""What a wait does with the events of its names that arrived before it began."""


class Received(NamedTuple):
    """An event a run received: its name and its data (``ctx.wait_for_any``)."""

    name: str
    data: Any


class SagaContext(abc.ABC):
    """What saga code may use. Everything here is recorded or derived from the history, so
    that replaying the code reproduces the same decisions."""

    run_id: str
    saga: str
    logger: logging.LoggerAdapter[logging.Logger]
    """A logger that stays silent while the run replays what already happened."""

    @overload
    async def call(
        self,
        step: StepDef[Concatenate[StepContext, P], Awaitable[R]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R: ...

    @overload
    async def call(
        self, step: StepDef[Concatenate[StepContext, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    @overload
    async def call(
        self,
        step: SagaDef[Any, R],
        *args: Any,
        run_id: str | None = None,
        timeout: timedelta | None = None,
    ) -> R: ...

    @abc.abstractmethod
    async def call(self, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``step`` durably and return its result; raise ``StepFailedError`` if it failed
        for good. Given a saga of the app, run it as a child run (its id ``run_id``, or derived
        from this run's and the call's position, so no replay starts a second one) and return
        its output; its failure raises ``StepFailedError``, and cancelling this run cancels
        it. With ``timeout`` (a child run only), a durable timer races the child: when it
        fires first the child run is cancelled and ``ChildTimeoutError`` (a ``TimeoutError``)
        is raised here."""

    @abc.abstractmethod
    async def gather(self, *aws: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
        """Await several calls concurrently (``asyncio.gather`` works too)."""

    @abc.abstractmethod
    async def sleep(self, duration: timedelta) -> None:
        """A durable timer: no process holds the run while it sleeps."""

    @overload
    async def wait_for_event(
        self,
        name: str,
        *,
        timeout: timedelta | None = None,
        model: None = None,
        prompt: Any = None,
        early: Early = "keep",
        key: str | None = None,
        match: Callable[[Any], object] | None = None,
    ) -> Any: ...

    @overload
    async def wait_for_event(
        self,
        name: str,
        *,
        timeout: timedelta | None = None,
        model: type[T],
        prompt: Any = None,
        early: Early = "keep",
        key: str | None = None,
        match: Callable[[Any], object] | None = None,
    ) -> T: ...

    @abc.abstractmethod
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
        """Wait for an event addressed to this run; raise ``EventTimeoutError`` on timeout.
        Events that arrived before the call are kept and returned at once, oldest first;
        with ``early="refuse"`` they are refused instead (recorded as rejected, never
        returned): for an answer that counts only if it was sent to this very wait, such as
        the raise of a budget that was reached. ``prompt`` (JSON: the question asked of a
        person, say) is shown by ``sagaloop status`` while the run waits. Data that does not
        fit ``model`` is recorded as rejected, and the wait goes on.

        ``key`` or ``match`` make it a wait on published events (``Client.publish_event``,
        ``ctx.publish_event``): while it waits, the run is subscribed to ``(name, key)`` (with
        no key: to every key of the name), and it takes only an event of that key whose JSON
        data ``match(data)`` (saga code: deterministic) is true for; the others are kept for
        later waits. A ``match`` that raises ends the wait with its exception. Events
        published before the wait began (and the run subscribed) never reach it."""

    @abc.abstractmethod
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
        """Wait for the first event, by arrival order, of any of ``names`` (``approve``,
        ``reject``, ``edit``...) and return it as ``Received(name, data)``; raise
        ``EventTimeoutError`` on timeout. Kept events of these names count, oldest first
        (``early="refuse"``: they are refused, as for ``wait_for_event``); events of other
        names keep their place. ``models`` validates the data per name. ``key`` and ``match``
        as for :meth:`wait_for_event`, for every name."""

    @overload
    def on_event(
        self, name: str, handler: Callable[[Any], object], *, model: None = None
    ) -> None: ...

    @overload
    def on_event(self, name: str, handler: Callable[[T], object], *, model: type[T]) -> None: ...

    @abc.abstractmethod
    def on_event(
        self, name: str, handler: Callable[[Any], object], *, model: type[Any] | None = None
    ) -> None:
        """Handle every event ``name`` as it arrives, whatever the saga awaits (Temporal's
        signal handler): ``handler(data)`` runs on the saga's loop for each event, in history
        order; a sync handler runs to its end at once, an async one may await commands
        (``ctx.call``...) while the saga goes on. Events of that name that arrived before this
        call are handled now, oldest first. Data that does not fit ``model`` (or the model
        the saga declares for the event) is recorded as rejected and not handled. An
        exception raised by a handler fails the run. One handler per name, and a handled
        name cannot also be awaited with ``wait_for_event``: wait with :meth:`wait_condition`
        on the state the handler updates."""

    @abc.abstractmethod
    async def wait_condition(
        self, fn: Callable[[], object], *, timeout: timedelta | None = None
    ) -> None:
        """Return when ``fn()`` is true (at once if it is now). ``fn`` is checked again after
        each batch of events, results and timers the run is fed, once every event handler of
        the batch has run; the resumption is recorded in the history, so a replay resumes at
        the same point. ``fn`` must only read the saga's own state; an exception it raises
        is raised here. With ``timeout``, a durable timer races the condition:
        ``TimeoutError`` if it fires while ``fn()`` is still false."""

    @abc.abstractmethod
    def all_handlers_finished(self) -> bool:
        """True when no async event handler is still running: ``await
        ctx.wait_condition(ctx.all_handlers_finished)`` before returning lets them end."""

    @abc.abstractmethod
    def send_event(self, run_id: str, name: str, data: Any = None) -> None:
        """Send the event ``name`` to the run ``run_id`` (of this app or another), once: it is
        recorded in the history and sent through the outbox with the transaction that recorded
        it, so a replay never sends it again. Fire-and-forget: an event for a run that does not
        exist is dead-lettered by its engine, after about 10 s (``NOT_STARTED_TRIES``
        deliveries): a run started just before, by ``ctx.start`` in the same activation say,
        may have its start processed after the event."""

    @abc.abstractmethod
    def start(
        self, saga: SagaDef[Any, Any] | str, input: Any = None, *, run_id: str | None = None
    ) -> str:
        """Start a run of ``saga`` (of this app), fire-and-forget, and return its run id:
        ``run_id``, or one derived from this run and this call's position (the same on every
        replay, so no replay starts a second run). A run id that exists starts nothing."""

    @abc.abstractmethod
    def continue_as_new(self, input: Any = None) -> NoReturn:
        """End this run's history and go on in a fresh one, under the same run id, with
        ``input``: a loop that runs for months keeps a bounded history. Steps still in flight
        are abandoned (their results are ignored) and the steps completed so far are no longer
        compensated if the run fails later. Positions go on counting, so idempotency keys never
        repeat."""

    @abc.abstractmethod
    async def compensate(self) -> None:
        """Undo the steps completed so far that have a compensation, newest first, one at a
        time and durably, as a failed run does; then go on. The saga may then return a result
        (a trip booking that undoes its bookings and answers ``{"status": "failure"}``). Steps
        in flight settle first; a compensation that fails for good parks the run."""

    @abc.abstractmethod
    def publish(self, key: str, value: Any) -> None:
        """Record ``value`` (JSON) under ``key`` in the history, for readers outside the run:
        ``Client.get_published(run_id, key)`` and ``sagaloop status`` show the latest value of
        each key (a progress figure, a draft awaiting approval, an interim answer)."""

    @abc.abstractmethod
    async def approval(
        self,
        action: str,
        args: Any = None,
        *,
        call_id: str | None = None,
        timeout: timedelta | None = None,
        on_timeout: Literal["deny", "escalate"] = "deny",
        reason: str | None = None,
        args_type: Any = None,
        args_schema: dict[str, Any] | None = None,
    ) -> Approval:
        """Ask a person to approve ``action`` with ``args`` (JSON) and wait for the answer
        (``Client.approve``/``deny``, ``sagaloop approve``/``deny``). The request is published
        under ``approval:{call_id}`` and the run waits for the event of that name; an answer
        counts only if it names the hash of these exact arguments, and only once. ``call_id``
        defaults to this call's position in the history. ``reason`` (why it is asked) is shown
        to the approver. When ``timeout`` passes, ``on_timeout="deny"`` returns a denial
        (reason ``"deadline passed"``); ``"escalate"`` marks the request escalated and waits
        on without a deadline. Returns the decision and the arguments to use (the approver
        may have edited them). ``args_type`` (a pydantic model, dataclass, TypedDict...):
        edited arguments must validate as it; its JSON Schema is published with the request,
        so that ``approve --args`` refuses a bad edit before sending it, and an edit that
        does not fit is refused as an answer (the approval keeps waiting), never a failure
        of the run. ``args_schema``: the same with a JSON Schema instead of a type (an
        agent's tool's, say). The answer rules are in docs/concepts/approvals.md."""

    @abc.abstractmethod
    def now(self) -> datetime:
        """The time of the history event being processed (UTC), the same on every replay."""

    @abc.abstractmethod
    def uuid4(self) -> uuid.UUID:
        """A random UUID that is the same on every replay."""

    @abc.abstractmethod
    def random(self) -> float:
        """A random float in [0, 1) that is the same on every replay."""

    @abc.abstractmethod
    def patched(self, change_id: str) -> bool:
        """True when this run reaches this point with code that has the change ``change_id``;
        False for runs that already passed here with older code."""

    @abc.abstractmethod
    def deprecate_patch(self, change_id: str) -> None:
        """Temporal's ``deprecate_patch``: every run that took the path before the change
        ``change_id`` has finished, so its ``patched(change_id)`` call and old branch are gone
        from the code. Runs that recorded the change's marker still replay: from here on,
        its markers are skipped. Records nothing; see the versioning docs for the stages."""

    @property
    @abc.abstractmethod
    def started_by(self) -> str | None:
        """The id of the run that started this one: the parent of a child run (``await
        ctx.call(saga, ...)``), or the run whose ``ctx.start`` started it when its
        ``run_started`` records it; None for a run a client started. The same in every
        history of a continue-as-new chain."""

    @property
    @abc.abstractmethod
    def is_replaying(self) -> bool:
        """True while the code re-executes what the history already recorded."""

    @property
    @abc.abstractmethod
    def history_length(self) -> int:
        """How many events the run's current history holds up to the one that woke the code
        (the same on every replay). A history that continued as new starts again from 1."""

    @property
    def continue_as_new_suggested(self) -> bool:
        """True once the current history holds ``SUGGESTED_HISTORY`` events (4,096): a loop
        that runs for long should then ``continue_as_new`` at its next clean point, so that
        each activation's replay and the history's storage stay bounded."""
        return self.history_length >= SUGGESTED_HISTORY

    @abc.abstractmethod
    def subscribe(self, name: str, key: str | None = None) -> None:
        """Subscribe this run to the events ``name`` published with ``key`` (None: with any
        key) from now on (``Client.publish_event``, ``ctx.publish_event``): each is delivered
        once, recorded in the history, and kept until a wait takes it or an ``on_event``
        handler handles it. Recorded, so a replay subscribes nothing again; it lasts until
        :meth:`unsubscribe`, the run's end or ``continue_as_new``."""

    @abc.abstractmethod
    def unsubscribe(self, name: str, key: str | None = None) -> None:
        """End the subscription :meth:`subscribe` made with the same ``name`` and ``key``."""

    @abc.abstractmethod
    def publish_event(self, name: str, data: Any = None, *, key: str | None = None) -> str:
        """Publish the event ``name`` (with JSON ``data`` and an optional ``key``) to every
        run subscribed to or waiting on it, and start the runs of the sagas declared with
        ``on_event=name``, once: recorded, and sent through the outbox with the transaction
        that recorded it. Returns the event's id (derived from this run and the call's
        position: the same on every replay)."""

    @overload
    def on_update(
        self,
        name: str,
        handler: Callable[[Any], object],
        *,
        validator: Callable[[Any], object] | None = None,
        model: None = None,
    ) -> None: ...

    @overload
    def on_update(
        self,
        name: str,
        handler: Callable[[T], object],
        *,
        validator: Callable[[T], object] | None = None,
        model: type[T],
    ) -> None: ...

    def on_update(
        self,
        name: str,
        handler: Callable[[Any], object],
        *,
        validator: Callable[[Any], object] | None = None,
        model: type[Any] | None = None,
    ) -> None:
        """Answer every update ``name`` sent to this run (``Client.update``; Temporal's
        ``@workflow.update``): ``handler(data)`` runs on the saga's loop, in history order,
        whatever the saga awaits; what it returns (JSON) is answered to the sender, what it
        raises is answered as an ``UpdateFailedError`` and the run goes on. A sync handler
        runs to its end at once, an async one may await commands (``ctx.call``...).
        ``validator(data)``, a plain function, runs first, on the run's state as it is when
        the update arrives, before anything is recorded: it refuses the update by raising
        (the sender gets an ``UpdateRefusedError``, nothing else happens). It must only read
        the saga's state: a command it issues refuses the update. ``model``: the type the
        data is converted to (data that does not fit refuses the update). One handler per
        update name; an update that arrives when the run has no handler for it is refused.
        :meth:`all_handlers_finished` counts update handlers too."""
        raise NotImplementedError


_current: contextvars.ContextVar[SagaContext | None] = contextvars.ContextVar(
    "sagaloop_current_saga", default=None
)


def current_saga() -> SagaContext | None:
    """The context of the saga whose code is running (in any task it created), or None outside
    saga code: how a library called from a saga (an agent adapter, say) finds the run."""
    return _current.get()


class StepContext(abc.ABC):
    """What a step, its compensation and its reconcile function receive."""

    run_id: str
    saga: str
    step: str
    position: int
    attempt: int
    """1 for the first attempt; counts every attempt, in doubt or not."""
    in_doubt: bool
    """True when an earlier attempt may have taken effect although no success was recorded."""
    idempotency_key: str
    """Stable across retries, redeliveries and restarts; distinct for the compensation."""
    logger: logging.LoggerAdapter[logging.Logger]
    transaction: Any = None
    """In a step declared ``transactional=True`` (and its compensation), run by a worker: a
    SQLAlchemy ``Connection`` on the store's database, inside the transaction that records the
    attempt's outcome (in a savepoint: rolled back if the step raises). None otherwise."""

    @abc.abstractmethod
    def stream(self, data: Any) -> None:
        """Send ``data`` (JSON: a model's token, a progress figure) to whoever follows the run
        live (``Client.stream``, ``sagaloop tail``). Best effort and never recorded: the step's
        result is what the history keeps."""

    @abc.abstractmethod
    def heartbeat(self, details: Any = None) -> None:
        """Say the step is alive (a long step should, more often than its
        ``heartbeat_timeout``). Raises ``StepCancelled`` when the run is being cancelled or
        undone, or the attempt was superseded: stop then (``finally`` runs). Cheap: it looks
        at the run at most once a second."""

    @property
    def task_token(self) -> str:
        """The opaque token of this attempt (URL-safe text): give it to the outside system that
        will complete the attempt after :meth:`complete_async` (``Client.complete_step``,
        ``Client.fail_step``, ``sagaloop complete-step``). Each attempt has its own: a token of
        an attempt that timed out and was retried is refused."""
        raise ValidationError(
            f"step {self.step!r} has no task token here: only a step run by a worker (or the "
            "in-process lane) can be completed from outside"
        )

    def complete_async(self) -> NoReturn:
        """Hand this attempt to an outside system and end the body without a result: raises
        ``CompleteAsync`` (let it propagate). The attempt stays in flight until completed or
        failed through the client with :attr:`task_token`, or until the step's ``timeout``
        (from the attempt's start) or ``heartbeat_timeout`` (from the hand-off or the last
        ``Client.heartbeat_step``) fails it in doubt. Refused (``ValidationError``) in a
        compensation, a reconcile function and a ``transactional=True`` step."""
        raise ValidationError(
            f"step {self.step!r} cannot be completed from outside here: only a step run by a "
            "worker (or the in-process lane) can"
        )

    def history(self, run_id: str | None = None, *, after: int = 0) -> list[Any]:
        """The events recorded so far of this step's run, or of the run ``run_id`` (a child's,
        say), oldest first, read from the store when called: ``sagaloop.engine.history.Event``
        records; with ``after``, only those after the event of that ``seq`` (what was added
        since a previous read). How a step finds what earlier steps of its run were given (an
        agent's model step rebuilds the transcript it extends) or what another run published.
        Raises ``ValidationError`` where no store is at hand (a step function called in-process,
        outside any saga)."""
        raise ValidationError(
            f"step {self.step!r} cannot read a run's history here: only a step run by a worker "
            "(or the in-process lane) has the store at hand"
        )
