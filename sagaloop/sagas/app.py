"""The declaration API: an ``App`` registry with ``saga`` and ``step`` decorators. No I/O."""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar, get_origin, overload

from sagaloop.errors import DeclarationError, InvalidRateLimit
from sagaloop.sagas.approvals import KEY_PREFIX
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.sagas.context import SagaContext
from sagaloop.sagas.convert import ANY, Converter, Signature
from sagaloop.sagas.debounce import Debounce
from sagaloop.sagas.policy import RateLimit, RetryPolicy, check_rate_key
from sagaloop.sagas.published import PublishedEvent
from sagaloop.sagas.schedules import InvalidSchedule, ScheduleDef, check_catch_up, make_spec

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
I = TypeVar("I")  # noqa: E741
O = TypeVar("O")  # noqa: E741

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$")
DEFAULT_QUEUE = "default"
DEFAULT_CANCEL_GRACE = timedelta(minutes=5)
"""How long saga code may clean up after a cancel by default (``@app.saga(cancel_grace=)``)."""


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise DeclarationError(
            f"invalid {kind} name {name!r}: use letters, digits and '_.:-', at most 200 chars"
        )
    return name


class StepDef(Generic[P, R_co]):
    """A declared step. Call it through ``ctx.call(step, ...)`` inside a saga; calling it directly
    runs the plain function (handy in unit tests)."""

    def __init__(
        self,
        fn: Callable[P, R_co],
        *,
        name: str,
        queue: str,
        retry: RetryPolicy,
        timeout: timedelta | None,
        local: bool,
        idempotent: bool,
        aliases: Sequence[str],
        heartbeat_timeout: timedelta | None = None,
        schedule_to_close: timedelta | None = None,
        approval: bool = False,
        approval_timeout: timedelta | None = None,
        rate_limit: RateLimit | None = None,
        transactional: bool = False,
    ) -> None:
        self.fn = fn
        self.approval = approval
        self.approval_timeout = approval_timeout
        self.name = _check_name("step", name)
        self.queue = _check_name("queue", queue)
        self.retry = retry
        if timeout is not None and timeout <= timedelta(0):
            raise DeclarationError(f"step {name!r}: timeout must be positive")
        self.timeout = timeout
        for what, value in (
            ("heartbeat_timeout", heartbeat_timeout),
            ("schedule_to_close", schedule_to_close),
        ):
            if value is not None and value <= timedelta(0):
                raise DeclarationError(f"step {name!r}: {what} must be positive")
        self.heartbeat_timeout = heartbeat_timeout
        self.schedule_to_close = schedule_to_close
        self.local = local
        self.rate_limit = rate_limit
        self.idempotent = idempotent
        self.aliases = tuple(_check_name("step", a) for a in aliases)
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = Signature(fn, what=f"step {name!r}")
        self.compensation_fn: Callable[..., Any] | None = None
        self.reconcile_fn: Callable[..., Any] | None = None
        self.transactional = transactional
        if transactional:
            _check_transactional(self, fn, "step")
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<step {self.name!r} queue={self.queue!r}>"

    @property
    def result(self) -> Converter:
        return self.signature.result

    def compensation(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Declare the undo of this step: ``fn(ctx, *step_args, result)``. It runs as a durable
        step of its own (same queue and retry policy) when the saga fails or is cancelled."""
        if self.compensation_fn is not None:
            raise DeclarationError(f"step {self.name!r} already has a compensation")
        self._check_arity(fn, extra=1, what="compensation")
        if self.transactional:
            _check_transactional(self, fn, "compensation")
        self.compensation_fn = fn
        return fn

    def reconcile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Declare the look-up ``fn(ctx, *step_args) -> result | None`` that tells whether an
        in-doubt attempt took effect. A found result is recorded without running the step."""
        if self.reconcile_fn is not None:
            raise DeclarationError(f"step {self.name!r} already has a reconcile function")
        if self.transactional:
            raise DeclarationError(
                f"step {self.name!r} is transactional: it needs no reconcile, as an attempt "
                "whose outcome was not committed rolled its writes back (it is never in doubt)"
            )
        self._check_arity(fn, extra=0, what="reconcile")
        self.reconcile_fn = fn
        return fn

    def _check_arity(self, fn: Callable[..., Any], *, extra: int, what: str) -> None:
        if inspect.iscoroutinefunction(fn) and not self.is_async:
            pass  # allowed: each function is driven according to its own kind
        params = list(inspect.signature(fn).parameters.values())
        expected = 1 + len(self.signature.params) + extra
        if len(params) != expected:
            raise DeclarationError(
                f"{what} of step {self.name!r} must take {expected} parameters "
                f"(ctx, the step's arguments{', result' if extra else ''}), not {len(params)}"
            )


def _check_transactional(step: StepDef[Any, Any], fn: Callable[..., Any], what: str) -> None:
    """Refuse what a transactional step cannot be: its body runs on the worker's thread inside
    a synchronous database transaction, and is never in doubt (its writes commit with its
    outcome)."""
    name = f"step {step.name!r} is transactional"
    if inspect.iscoroutinefunction(fn):
        raise DeclarationError(
            f"{name}: its {what} must be a plain `def`, not `async def` (ctx.transaction is a "
            "synchronous SQLAlchemy Connection, used on the worker's thread)"
        )
    refused = {
        "local=True": (
            step.local,
            "in-process steps run on the engine outside any transaction; drop local=True",
        ),
        "idempotent=False": (
            not step.idempotent,
            "an attempt whose outcome was not committed rolled its writes back, so it is never "
            "in doubt and runs again safely",
        ),
        "heartbeat_timeout": (
            step.heartbeat_timeout is not None,
            "it runs inside the transaction on the worker's thread and cannot be abandoned; "
            "use timeout (on PostgreSQL, the transaction's statement_timeout)",
        ),
    }
    for option, (given, why) in refused.items():
        if given:
            raise DeclarationError(f"{name}: {option} makes no sense: {why}")


def model_path(model: Any) -> str | None:
    """``module:qualname`` of a type that another process can import (where a client finds
    it to check an event before sending it); None for a type defined inside a function."""
    if isinstance(model, type) and "<locals>" not in model.__qualname__:
        return f"{model.__module__}:{model.__qualname__}"
    return None


def _check_events(saga: str, events: Mapping[str, Any] | None) -> dict[str, Any]:
    """The events a saga declares it accepts: ``{name: model or None}`` (None: any data)."""
    found: dict[str, Any] = {}
    for event, model in (events or {}).items():
        what = f"saga {saga!r}: event name {event!r}"
        if not isinstance(event, str) or not 0 < len(event) <= 200 or "\x00" in event:
            raise DeclarationError(f"{what} must be 1 to 200 characters, without NUL")
        if event.startswith(KEY_PREFIX):
            raise DeclarationError(
                f"{what}: approval answers ({KEY_PREFIX}...) have their own rules; declare "
                "only the events the saga waits for with wait_for_event or wait_for_any"
            )
        if model is not None and not isinstance(model, type) and get_origin(model) is None:
            raise DeclarationError(
                f"{what}: the model is a type (a pydantic model, a dataclass...) or None for "
                f"any data, not {model!r:.60}"
            )
        found[event] = model
    return found


def _check_grace(name: str, grace: Any) -> timedelta:
    if isinstance(grace, bool) or not isinstance(grace, (timedelta, int, float)):
        raise DeclarationError(
            f"saga {name!r}: cancel_grace= takes a timedelta or seconds, not {type(grace).__name__}"
        )
    try:
        value = grace if isinstance(grace, timedelta) else timedelta(seconds=grace)
    except (ValueError, OverflowError) as e:  # NaN, infinite
        raise DeclarationError(f"saga {name!r}: cancel_grace={grace!r}: {e}") from None
    if value < timedelta(0):
        raise DeclarationError(f"saga {name!r}: cancel_grace= must not be negative")
    return value


class SagaDef(Generic[I, O]):
    """A declared saga: an ``async def f(ctx, input) -> output``."""

    def __init__(
        self,
        fn: Callable[..., Awaitable[O]],
        *,
        name: str,
        aliases: Sequence[str],
        events: Mapping[str, Any] | None = None,
        concurrency: Concurrency | None = None,
        on_event: str | None = None,
        run_id: Callable[[PublishedEvent], str] | None = None,
        debounce: Debounce | None = None,
        cancel_grace: timedelta | float = DEFAULT_CANCEL_GRACE,
    ) -> None:
        if not inspect.iscoroutinefunction(fn):
            raise DeclarationError(f"saga {name!r} must be an `async def` function")
        if on_event is not None and (
            not isinstance(on_event, str) or not 0 < len(on_event) <= 200 or "\x00" in on_event
        ):
            raise DeclarationError(
                f"saga {name!r}: on_event is an event name of 1 to 200 characters"
            )
        if run_id is not None and (on_event is None or not callable(run_id)):
            raise DeclarationError(
                f"saga {name!r}: run_id= is a function of the event, with on_event= only"
            )
        self.on_event = on_event
        """The name of the published events that start a run of this saga (None: none do)."""
        self.run_id_of = run_id
        """What names the run a published event starts (None: one derived from its id)."""
        if concurrency is not None and not isinstance(concurrency, Concurrency):
            raise DeclarationError(
                f"saga {name!r}: concurrency= takes a sagaloop.Concurrency(limit=..., key=..., "
                f"at_limit=...), not {type(concurrency).__name__}"
            )
        self.concurrency = concurrency
        """At most ``limit`` runs at once per key (None: no limit)."""
        if debounce is not None and not isinstance(debounce, Debounce):
            raise DeclarationError(
                f"saga {name!r}: debounce= takes a sagaloop.Debounce(period, key=..., "
                f"max_wait=...), not {type(debounce).__name__}"
            )
        self.debounce = debounce
        """Starts of one key within ``period`` make one run (None: every start runs)."""
        self.cancel_grace = _check_grace(name, cancel_grace)
        """How long the saga code may clean up after a cancel delivered into it (zero: a
        cancel stops the code where it waits, as before ``cancel_grace`` existed)."""
        self.fn = fn
        self.name = _check_name("saga", name)
        self.aliases = tuple(_check_name("saga", a) for a in aliases)
        self.events: dict[str, Any] = _check_events(name, events)
        self.queries: dict[str, Any] = {}
        """Its queries by name (``sagaloop.client.query``): computed from the run's recorded
        state on the client, never by running saga code."""
        """The events the saga accepts, ``{name: model or None}``; empty: it declares none
        (any name, any data until a wait checks it)."""
        sig = Signature(fn, what=f"saga {name!r}")
        if len(sig.params) > 1:
            raise DeclarationError(f"saga {name!r} must take (ctx) or (ctx, input)")
        self.has_input = bool(sig.params)
        self.input: Converter = sig.converters[sig.params[0].name] if sig.params else ANY
        self.output: Converter = sig.result
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<saga {self.name!r}>"

    def recorded_events(self) -> dict[str, str | None] | None:
        """What a run's ``run_started`` records of the declaration, for clients without the
        saga's code: ``{name: "module:qualname" or None}``; None if it declares nothing."""
        if not self.events:
            return None
        return {event: model_path(model) for event, model in self.events.items()}


class App:
    """The registry of an application's sagas and steps. No global state: create as many as you
    like (tests do)."""

    def __init__(self, name: str) -> None:
        self.name = _check_name("app", name)
        self.sagas: dict[str, SagaDef[Any, Any]] = {}
        self.steps: dict[str, StepDef[Any, Any]] = {}
        self._saga_aliases: dict[str, str] = {}
        self._step_aliases: dict[str, str] = {}
        self._rate_keys: dict[str, tuple[str, RateLimit]] = {}
        self.schedules: dict[str, ScheduleDef] = {}

    def __repr__(self) -> str:
        return f"App({self.name!r}, sagas={sorted(self.sagas)}, steps={sorted(self.steps)})"

    # --- declaration -------------------------------------------------------------------------

    @overload
    def saga(self, fn: Callable[[SagaContext, I], Awaitable[O]], /) -> SagaDef[I, O]: ...

    @overload
    def saga(
        self,
        *,
        name: str | None = None,
        aliases: Sequence[str] = (),
        events: Mapping[str, type[Any] | None] | None = None,
        concurrency: Concurrency | None = None,
        on_event: str | None = None,
        run_id: Callable[[PublishedEvent], str] | None = None,
        debounce: Debounce | None = None,
        cancel_grace: timedelta | float = DEFAULT_CANCEL_GRACE,
    ) -> Callable[[Callable[[SagaContext, I], Awaitable[O]]], SagaDef[I, O]]: ...

    def saga(
        self,
        fn: Callable[..., Awaitable[Any]] | None = None,
        *,
        name: str | None = None,
        aliases: Sequence[str] = (),
        events: Mapping[str, type[Any] | None] | None = None,
        concurrency: Concurrency | None = None,
        on_event: str | None = None,
        run_id: Callable[[PublishedEvent], str] | None = None,
        debounce: Debounce | None = None,
        cancel_grace: timedelta | float = DEFAULT_CANCEL_GRACE,
    ) -> Any:
        """Declare a saga. ``name`` is what runs store: set it explicitly to keep in-flight runs
        resolvable across renames of the function (or list old names in ``aliases``).

        ``events``: the events the saga accepts, ``{name: model}`` (a pydantic model, a
        dataclass..., or None for any data). Clients then refuse, before anything is sent, an
        event of another name or whose data does not fit its model, even before the wait for
        it begins; ``ctx.wait_for_event(name)`` validates with the declared model unless given
        another. Approval answers are not declared: they have their own rules.

        ``concurrency``: at most ``limit`` runs at once per key, and what a start does at the
        limit (see :class:`~sagaloop.sagas.concurrency.Concurrency`).

        ``on_event``: each event of that name published (``Client.publish_event``) starts a
        run of the saga with the event's data as its input, named ``run_id(event)`` (a
        :class:`~sagaloop.PublishedEvent`; by default derived from the saga and the event's
        id): a publish redelivered or repeated starts no second run.

        ``debounce``: the starts of a key within ``period`` of each other make one run, with
        the last start's input (see :class:`~sagaloop.sagas.debounce.Debounce`).

        ``cancel_grace`` (a timedelta or seconds; default 5 minutes): a cancel raises
        ``asyncio.CancelledError`` at the saga code's pending await, and the code has this long
        to clean up (its ``finally``/``except`` may call steps) before the run is cancelled
        regardless; either way the run ends ``cancelled`` and its completed steps are
        compensated. ``0``: the code is stopped where it waits, with no chance to clean up."""

        def register(f: Callable[..., Awaitable[Any]]) -> SagaDef[Any, Any]:
            definition: SagaDef[Any, Any] = SagaDef(
                f,
                name=name or f.__name__,
                aliases=aliases,
                events=events,
                concurrency=concurrency,
                on_event=on_event,
                run_id=run_id,
                debounce=debounce,
                cancel_grace=cancel_grace,
            )
            self._register(definition, self.sagas, self._saga_aliases, "saga")
            return definition

        return register(fn) if fn is not None else register

    @overload
    def step(self, fn: Callable[P, R], /) -> StepDef[P, R]: ...

    @overload
    def step(
        self,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        retry: RetryPolicy | None = None,
        timeout: timedelta | None = None,
        local: bool = False,
        idempotent: bool = True,
        aliases: Sequence[str] = (),
        heartbeat_timeout: timedelta | None = None,
        schedule_to_close: timedelta | None = None,
        approval: bool = False,
        approval_timeout: timedelta | None = None,
        rate_limit: str | None = None,
        rate_key: str | None = None,
        transactional: bool = False,
    ) -> Callable[[Callable[P, R]], StepDef[P, R]]: ...

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        queue: str = DEFAULT_QUEUE,
        retry: RetryPolicy | None = None,
        timeout: timedelta | None = None,
        local: bool = False,
        idempotent: bool = True,
        aliases: Sequence[str] = (),
        heartbeat_timeout: timedelta | None = None,
        schedule_to_close: timedelta | None = None,
        approval: bool = False,
        approval_timeout: timedelta | None = None,
        rate_limit: str | None = None,
        rate_key: str | None = None,
        transactional: bool = False,
    ) -> Any:
        """Declare a step ``fn(ctx: StepContext, ...) -> result`` (sync or async).

        - ``queue``: the queue its messages go to; workers consume queues.
        - ``retry``: a :class:`RetryPolicy` (default: 5 attempts, 1 s doubling to 60 s).
        - ``timeout``: start-to-close limit of one attempt; a timed-out attempt is in doubt.
        - ``local=True``: an in-process step: the engine's processes run it (``sagaloop engine
          --concurrency``), with no broker hop, outside any transaction, then checkpoint its
          outcome in the transaction that goes on with the run. The same rules as on a worker
          (retries, timeouts, in doubt, reconcile, idempotency key, rate limit); see
          docs/concepts/steps.md, "In-process steps".
        - ``idempotent=False``: the step has external effects that must not happen twice and
          that the downstream cannot deduplicate. Without a ``reconcile`` such a step is never
          re-attempted when in doubt: the run halts in ``needs_attention`` instead.
        - ``heartbeat_timeout``: an attempt that does not call ``ctx.heartbeat()`` that often
          fails (in doubt) early, instead of waiting for ``timeout`` or the lease.
        - ``schedule_to_close``: bounds all attempts together, from the first scheduling: no
          attempt runs past it and no retry starts after it.
        - ``approval=True``: each ``ctx.call`` first asks a person (``ctx.approval`` with the
          step's name and arguments, waiting at most ``approval_timeout``); the approved, maybe
          edited, arguments are used; a denial raises ``ApprovalDenied`` in the saga.
        - ``rate_limit``: ``"10/s"``, ``"600/m"``, ``"2/h"``: attempts of the step (and of its
          compensation) start at most that often, spread evenly, across every worker process
          of the database. Steps with the same ``rate_key`` share one quota (an LLM
          provider's, say; a key is shared by every app of the database); by default the
          step has its own. A wrong value raises :class:`InvalidRateLimit` (a ``ValueError``).
        - ``transactional=True``: the step (a ``def``) writes to the app's own tables in the
          store's database through ``ctx.transaction``, a SQLAlchemy Connection in the
          transaction that records its outcome: its writes commit with its completion or not
          at all, and are rolled back when it raises. Not with ``local``, ``idempotent=False``,
          ``heartbeat_timeout`` or a reconcile; see docs/concepts/steps.md, "Transactional
          steps".
        """

        def register(f: Callable[..., Any]) -> StepDef[Any, Any]:
            step_name = name or f.__name__
            limit = self._rate_limit(step_name, rate_limit, rate_key)
            definition: StepDef[Any, Any] = StepDef(
                f,
                name=step_name,
                queue=queue,
                retry=retry or RetryPolicy(),
                timeout=timeout,
                local=local,
                idempotent=idempotent,
                aliases=aliases,
                heartbeat_timeout=heartbeat_timeout,
                schedule_to_close=schedule_to_close,
                approval=approval,
                approval_timeout=approval_timeout,
                rate_limit=limit,
                transactional=transactional,
            )
            self._register(definition, self.steps, self._step_aliases, "step")
            if limit is not None:
                self._rate_keys.setdefault(limit.key, (definition.name, limit))
            return definition

        return register(fn) if fn is not None else register

    def _rate_limit(self, step: str, rate: str | None, key: str | None) -> RateLimit | None:
        """The step's limit; steps of this app that share a key must share its rate."""
        what = f"step {step!r}"
        if rate is None:
            if key is not None:
                raise InvalidRateLimit(f"{what}: rate_key {key!r} needs a rate_limit")
            return None
        key = f"{self.name}/{step}" if key is None else check_rate_key(key, what)
        limit = RateLimit.parse(rate, key=key, what=what)
        other = self._rate_keys.get(limit.key)
        if other is not None and other[1].per_second != limit.per_second:
            raise InvalidRateLimit(
                f"{what}: rate_key {limit.key!r} is already limited to {other[1].rate!r} by "
                f"step {other[0]!r}, not {rate!r}: steps that share a quota declare one rate"
            )
        return limit

    def _register(
        self,
        definition: Any,
        table: dict[str, Any],
        aliases: dict[str, str],
        kind: str,
    ) -> None:
        for n in (definition.name, *definition.aliases):
            if n in table or n in aliases:
                raise DeclarationError(f"{kind} {n!r} is already registered in app {self.name!r}")
        table[definition.name] = definition
        for a in definition.aliases:
            aliases[a] = definition.name

    def schedule(
        self,
        cron: str | None = None,
        *,
        every: timedelta | None = None,
        name: str | None = None,
        input: Any = None,
        catch_up: str = "latest",
    ) -> Callable[[SagaDef[I, O]], SagaDef[I, O]]:
        """Start the saga below on a schedule: ``cron`` (5 fields, in UTC: ``"*/5 * * * *"``)
        or ``every=timedelta(...)`` (whole seconds, ticks at its multiples since 1970 UTC).
        Put it above ``@app.saga``; the saga is returned unchanged::

            @app.schedule("0 6 * * mon-fri", input={"report": "daily"})
            @app.saga
            async def report(ctx, input): ...

        Each tick starts one run of id ``schedule:<app>:<name>:<tick>``, however many engines
        fire it. ``name``: the schedule's stored name (default: the saga's; a second schedule
        of a saga needs its own). ``catch_up``: what an engine that was down does with the
        ticks it missed: ``"latest"`` starts one run for the latest, ``"all"`` one for each
        (the latest 100 at most), ``"skip"`` none (a tick more than 60 s late is missed).
        A bad expression, interval, input or policy raises :class:`InvalidSchedule`."""
        spec = make_spec(cron, every)
        policy = check_catch_up(catch_up)

        def register(saga: SagaDef[I, O]) -> SagaDef[I, O]:
            if not isinstance(saga, SagaDef) or self.sagas.get(saga.name) is not saga:
                raise InvalidSchedule(
                    f"@app.schedule goes above @app.saga of app {self.name!r}, not on {saga!r:.60}"
                )
            schedule = _check_name("schedule", name or saga.name)
            if schedule in self.schedules:
                raise InvalidSchedule(
                    f"schedule {schedule!r} is already declared in app {self.name!r}: give the "
                    "other one a name="
                )
            try:
                data = saga.input.to_json(input, what=f"input of schedule {schedule!r}")
            except Exception as e:
                raise InvalidSchedule(str(e)) from e
            self.schedules[schedule] = ScheduleDef(schedule, saga.name, spec, data, policy)
            return saga

        return register

    # --- look-up -----------------------------------------------------------------------------

    def get_saga(self, name: str) -> SagaDef[Any, Any] | None:
        return self.sagas.get(self._saga_aliases.get(name, name))

    def get_step(self, name: str) -> StepDef[Any, Any] | None:
        return self.steps.get(self._step_aliases.get(name, name))

    @property
    def queues(self) -> list[str]:
        """The step queues used by this app's remote steps."""
        return sorted({s.queue for s in self.steps.values() if not s.local})
