"""The client: start runs, send events, cancel, retry, and read status. It needs no saga code
(pass a declared saga instead of its name to have the input validated before anything is
written). What it checks before writing is in ``checks``; :meth:`Client.fork` is carried out by
``fork``, an approval's answer by ``approvals``, :meth:`Client.update` by ``updates``, and
debounced starts, :meth:`Client.publish_event` and the check of an event by ``events``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from sagaloop import tracing
from sagaloop.client import completion, events, reading, updates
from sagaloop.client.admission import START_BACKLOG, limit_from_env
from sagaloop.client.approvals import answer_approval
from sagaloop.client.checks import check_message, check_text, same_json, to_json
from sagaloop.client.fork import fork_run
from sagaloop.client.polling import NOTHING, Pending, poll_until
from sagaloop.client.queries import QueryDef, ask
from sagaloop.client.serving import served
from sagaloop.client.timeline import Timeline, timeline
from sagaloop.engine import answers
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.event_fit import check_event
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.listing import RunOrder, run_order
from sagaloop.engine.messages import (
    Envelope,
    EventPayload,
    derived_id,
    engine_queue,
    start_queue,
)
from sagaloop.engine.ports import (
    Clock,
    Debounced,
    DebounceStore,
    Outgoing,
    RunRecord,
    Store,
    Streams,
    SystemClock,
)
from sagaloop.engine.state import RunState
from sagaloop.errors import ErrorInfo as _ErrorInfo
from sagaloop.errors import (
    OverloadedError,
    RunFinishedError,
    RunNotFoundError,
    RunStateError,
    SagaFailedError,
    ValidationError,
)
from sagaloop.sagas.app import App, SagaDef
from sagaloop.sagas.approvals import PendingApproval, call_id_of
from sagaloop.sagas.convert import ANY
from sagaloop.sagas.published import PublishedEvent

if TYPE_CHECKING:
    from sagaloop.client.schedules import Schedules

P = ParamSpec("P")
R = TypeVar("R")

LIVE = timedelta(seconds=15)
"""A process whose registry row was refreshed this recently runs (it refreshes every 5 s)."""


class Client:
    def __init__(
        self,
        store: Store,
        app: App | str | None = None,
        *,
        clock: Clock | None = None,
        streams: Streams | None = None,
        start_backlog: int | None = None,
    ) -> None:
        """``app`` (an App, or just its name) is needed to start runs; events, cancellation
        and retries go to the engine of the app that each run belongs to. ``streams``: the
        live channel that :meth:`stream` follows (none: the history only).

        ``start_backlog``: :meth:`start` refuses a new run (:class:`OverloadedError`) while
        this many runs of the app wait for an engine to take up their start; ``0``: no limit.
        Default: ``SAGALOOP_START_BACKLOG``, else :data:`START_BACKLOG`."""
        self.start_backlog = limit_from_env("SAGALOOP_START_BACKLOG", start_backlog, START_BACKLOG)
        self.store = store
        self.streams = streams
        self.app = app if isinstance(app, App) else None
        self.app_name = app.name if isinstance(app, App) else app
        self.clock = clock or SystemClock()
        self.own_app_only = False
        """Set by :meth:`scoped`: the runs of other apps are not found."""

    def start(
        self,
        saga: SagaDef[Any, Any] | str,
        input: Any = None,
        *,
        run_id: str | None = None,
        event: tuple[str, Any] | None = None,
        event_id: str | None = None,
    ) -> str:
        """Start a run and return its id. Idempotent per ``run_id``: starting an existing run
        id returns it without starting another. Refuses, before anything is written, what the
        engine would refuse (an invalid or empty id or name, NaN or Infinity, a lone surrogate,
        a message over the size limit), and a run id that a run of another app holds.

        With ``event=(name, data)``, the event is delivered to the run in the same transaction
        that starts it, or to the run already there (signal-with-start); ``event_id`` makes
        repeated calls deliver it once, as for :meth:`send_event`."""
        if isinstance(saga, str):
            check_text(saga, "saga name")
            definition = self.app.get_saga(saga) if self.app is not None else None
            if self.app is not None and definition is None:
                from sagaloop.errors import UnknownSagaError

                raise UnknownSagaError(saga, list(self.app.sagas))
        else:
            definition = saga
        name = definition.name if definition is not None else str(saga)
        if not self.app_name:
            raise ValidationError("Client(store, app) needs the app to start runs")
        if definition is not None and definition.debounce is not None:
            return events.debounce(self, definition, input, run_id=run_id, event=event)
        run_id = check_text(uuid.uuid4().hex if run_id is None else run_id, "run_id")
        converter = definition.input if definition is not None else ANY
        input_json = to_json(input, converter, f"input of saga {name!r}")
        now = self.clock.now()
        with tracing.start(run_id, name) as trace:  # the span sagaloop.start: the run's trace
            env = Envelope(
                type="start",
                message_id=derived_id("start", run_id),
                run_id=run_id,
                saga=name,
                payload={"input": input_json},
                created_at=now,
                trace=trace,
            )
            check_message(env)
            first = [] if event is None else [self._event(run_id, *event, event_id=event_id)]
            if first and definition is not None:  # what the saga declares it accepts
                state = RunState(run_id, saga=name)
                check_event(
                    state, first[0].payload["name"], first[0].payload["data"], definition.events
                )
            backlog = self._backlog()  # a run already there is not refused: idempotent
            if backlog is not None and self.store.get_run(run_id) is None:
                raise OverloadedError(self.app_name, backlog, self.start_backlog)
            with self.store.transaction() as tx:
                record = RunRecord(run_id, self.app_name, name, s.RUNNING, input_json, now, now, 1)
                if not self.store.create_run(tx, record):
                    existing = self.store.lock_run(tx, run_id)
                    if existing is not None and existing.app != self.app_name:
                        raise RunStateError(
                            f"run id {run_id!r} is taken by a run of app {existing.app!r} (apps "
                            "sharing a database share their run ids): choose another run id"
                        )
                    if existing is not None and existing.saga != name:
                        raise RunStateError(
                            f"run {run_id!r} already exists as a run of saga {existing.saga!r}"
                        )
                    if existing is not None and not same_json(existing.input, input_json):
                        raise RunStateError(
                            f"run id {run_id!r} is taken by a run of saga {name!r} with another "
                            "input: choose another run id (a start is idempotent only for the "
                            "same input)"
                        )
                    if first and existing is not None and existing.status in s.FINAL_STATUSES:
                        raise RunFinishedError(run_id, existing.status)
                    queue = engine_queue(self.app_name)  # a run in flight: its engine queue
                    self.store.enqueue(tx, [Outgoing(queue, e) for e in first], now)
                    return run_id
                self._begin(tx, env, definition, first, now)
            return run_id

    def _begin(
        self,
        tx: Any,
        env: Envelope,
        definition: SagaDef[Any, Any] | None,
        first: list[Envelope],
        now: datetime,
    ) -> None:
        """In ``tx``, where the run of the start message ``env`` was just created: its
        ``run_started`` and the start message (then ``first``) on the app's start queue."""
        trace = env.trace
        data = {"input": env.payload["input"], **({"trace": trace} if trace else {})}  # the run's
        if definition is not None and (events := definition.recorded_events()):
            data["events"] = events  # what it accepts, for clients without its code
        started = NewEvent(h.RUN_STARTED, name=env.saga, data=data)
        self.store.append_events(tx, env.run_id, 0, [started], now)
        queue = start_queue(str(self.app_name))  # behind the work of the runs in flight
        self.store.enqueue(tx, [Outgoing(queue, e) for e in [env, *first]], now)

    def pending(self, saga: str | None = None) -> list[Debounced]:
        """The debounced starts not yet started as a run (of ``saga``, if given), by due
        time: one per open window, with the run id it will start and the last start's input."""
        if not isinstance(self.store, DebounceStore):
            return []
        return self.store.pending_debounced(self.app_name or None, saga)

    def _backlog(self) -> int | None:
        """The app's start backlog when it is at the limit, else None."""
        if not self.start_backlog:
            return None
        app, limit = str(self.app_name), self.start_backlog
        backlog = self.store.count_running(app, started=False, at_most=limit)
        return backlog if backlog >= self.start_backlog else None

    def _event(
        self, run_id: str, name: str, data: Any = None, *, event_id: str | None = None
    ) -> Envelope:
        """The event message for ``run_id``, checked as the engine would check it."""
        check_text(name, "event name", EventPayload, "name")
        if event_id is not None:
            check_text(event_id, "event_id")
        payload = {"name": name, "data": to_json(data, ANY, "event data")}
        message_id = derived_id("event", run_id, event_id) if event_id else None
        return self._message("event", run_id, payload, message_id)

    def _send(self, env: Envelope, *, live: bool, run: RunRecord | None = None) -> None:
        """Queue ``env`` (checked already) for the engine of its run's app; ``live``: refuse
        a finished run. ``run``: the run as the caller just read it (else it is read)."""
        run = run or self.get(env.run_id)
        if live and run.status in s.FINAL_STATUSES:
            raise RunFinishedError(env.run_id, run.status)
        with self.store.transaction() as tx:
            self.store.enqueue(tx, [Outgoing(engine_queue(run.app), env)], self.clock.now())

    def _message(
        self, type: Any, run_id: str, payload: dict[str, Any], message_id: str | None = None
    ) -> Envelope:
        """A message to the engine, checked as the engine would check it."""
        env = Envelope(
            type=type,
            run_id=check_text(run_id, "run_id"),
            payload=payload,
            created_at=self.clock.now(),
            message_id=message_id or uuid.uuid4().hex,
            trace=tracing.current(),  # the caller's span, if any: the activation links to it
        )
        check_message(env)
        return env

    def send_event(
        self, run_id: str, name: str, data: Any = None, *, event_id: str | None = None
    ) -> None:
        """Deliver an event to a run; kept until the run waits for it if it arrives early.
        Sends with the same ``event_id`` are delivered once (safe to retry, also once the
        event ended the run: a send its run already took is not refused as too late).

        Refused (ValidationError, nothing sent) if the run would refuse it: a name its saga
        does not declare (``@app.saga(events=...)``), if it declares any, or data that does
        not fit the model of the wait open for it or, before that wait begins, the declared
        model. What a client cannot check (a model it cannot import) the engine records as
        refused when the wait takes it: ``status`` shows it, with the reason.

        An answer to an approval (``approval:{call_id}``) that names its ``request_id`` is
        checked and claims the request as :meth:`approve` does (ApprovalTakenError if another
        answer won); one that names none is sent as it is, and the engine records it as
        refused: an answer counts only if it was written knowing the request."""
        run = self.get(run_id)  # RunNotFoundError
        call_id = call_id_of(name) if isinstance(name, str) else None
        if call_id and isinstance(data, dict) and "request_id" in data:
            # an approval's answer: checked, and it claims the request
            return answer_approval(self, run_id, call_id, data, event_id=event_id)
        env = self._event(run_id, name, data, event_id=event_id)
        if event_id is not None and run.status in s.FINAL_STATUSES and events.taken(self, run, env):
            return  # a retry of a send that its run took before it ended
        events.check_fits(self, run, name, env.payload["data"])
        self._send(env, live=True, run=run)

    def cancel(self, run_id: str, reason: str | None = None, *, now: bool = False) -> None:
        """Cancel the run: ``asyncio.CancelledError`` is raised at the saga code's pending
        await, so that its ``finally``/``except`` may clean up within the saga's
        ``cancel_grace`` (the run is ``cancelling``); then its completed steps are compensated
        and it ends ``cancelled``. With ``cancel_grace=0``, the code is stopped where it waits.
        A second cancel changes nothing. ``now``: no cleanup, the code is stopped where it
        waits, also that of a run already ``cancelling`` (its cleanup is cut short)."""
        payload: dict[str, Any] = {"reason": reason, **({"now": True} if now else {})}
        self._send(self._message("cancel", run_id, payload), live=True)

    def complete_step(self, token: str, result: Any = None) -> None:
        """Complete the attempt a step handed off (``ctx.complete_async()``) by its
        ``ctx.task_token``: :func:`sagaloop.client.completion.complete`."""
        completion.complete(self, token, result)

    def fail_step(self, token: str, error: str, *, non_retryable: bool = False) -> None:
        """Fail a handed-off attempt: :func:`sagaloop.client.completion.fail`."""
        completion.fail(self, token, error, non_retryable=non_retryable)

    def heartbeat_step(self, token: str, details: Any = None) -> None:
        """A handed-off attempt is still worked on: :func:`sagaloop.client.completion.heartbeat`."""
        completion.heartbeat(self, token, details)

    def retry(self, run_id: str) -> None:
        """Resume a run in ``needs_attention`` once its cause is fixed."""
        run = self.get(run_id)
        if run.status != s.NEEDS_ATTENTION:
            raise RunStateError(f"run {run_id!r} is {run.status}, not needs_attention")
        self._send(self._message("retry", run_id, {}), live=False, run=run)

    def fork(self, source: str, /, at: int, *, run_id: str | None = None) -> str:
        """Start a new run whose history is run ``source``'s up to command position ``at``,
        and return its id. Nothing before the cut runs again: the new run gets a copy of every
        command at a position before ``at`` whose outcome the history records, with that
        outcome (:func:`~sagaloop.engine.fork.fork_history`); the rest (positions ``at`` and
        after, and the commands still outstanding) is dropped, and the saga code as it is now
        goes on from there, issuing again what it does next. The input is ``source``'s;
        ``run_started`` records ``forked_from: {run_id, position}``. The copied steps' effects
        stay ``source``'s: the fork never compensates them. Positions are those of ``sagaloop
        status`` (the ``#`` of a step) and of ``sagaloop export`` (``pos``, and its
        ``commands``).

        Needs the App (``Client(store, app)``): the history kept is replayed against the saga
        code first, and a fork that code could not continue is refused, as are a position
        outside the history, a run of another app or of a saga the app does not declare, and a
        ``run_id`` taken by another run (forking again with the same ``run_id``, source and
        position returns it)."""
        return fork_run(self, source, at, run_id)

    # --- approvals (``ctx.approval``; the rules are in ``answers``) ------------------------------

    def approvals(
        self, run_id: str | None = None, *, after: str | None = None, limit: int = 50
    ) -> list[PendingApproval]:
        """The approvals that runs wait for (pending or escalated), oldest request first, a
        page of at most ``limit``: of ``run_id``, or of every unfinished run (of this
        client's app, if it has one). ``after``: the ``cursor`` of the last approval of the
        page before. Read from the approvals index, page by page."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= 1000:
            raise ValidationError(f"a page holds 1 to 1000 approvals, not {limit!r:.20}")
        if run_id is not None:
            self.get(run_id)  # RunNotFoundError
        rows = self.store.open_approvals(
            app=self.app_name,
            run_id=run_id,
            after=None if after is None else answers.read_cursor(after),
            limit=limit,
        )
        return [p for p in map(answers.pending, rows) if p is not None]

    def approve(
        self, run_id: str, call_id: str, *, args: Any = None, by: str | None = None
    ) -> None:
        """Approve the approval ``call_id`` that run ``run_id`` waits for; with ``args``,
        approve these arguments in place of those asked about (checked against the action's
        schema, when the run published one). Refused (ValidationError) unless the approval
        is pending or escalated; ApprovalTakenError if another answer won it first."""
        data: dict[str, Any] = {"approved": True, "by": by}
        if args is not None:
            data["args"] = args
        answer_approval(self, run_id, call_id, data, hashed=False)

    def deny(self, run_id: str, call_id: str, *, reason: str, by: str | None = None) -> None:
        """Deny the approval ``call_id`` that run ``run_id`` waits for, saying why. Refused
        (ValidationError) unless the approval is pending or escalated; ApprovalTakenError if
        another answer won it first."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValidationError("a denial needs a reason: say why (--reason TEXT)")
        answer_approval(
            self, run_id, call_id, {"approved": False, "reason": reason, "by": by}, hashed=False
        )

    def _published(self, run_id: str) -> dict[str, Any]:
        """The latest value of each key the run published, from its history."""
        state = RunState(run_id)
        for event in self.store.load_history(None, run_id):
            state.apply(event)
        return state.published

    # --- reading -----------------------------------------------------------------------------

    @overload
    def query(
        self, run_id: str, query: QueryDef[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...
    @overload
    def query(self, run_id: str, query: str, /, *args: Any, **kwargs: Any) -> Any: ...
    def query(self, run_id: str, query: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Compute the query ``query`` (declared with ``@query(saga)``, or its name) of run
        ``run_id`` with these arguments, over what the run recorded (its record, published
        values and history, as they are now), and return its answer. No saga code runs and
        the run is not changed; no engine needs to run.

        Needs the App that declares the run's saga (``Client(store, app)``). Refused
        (ValidationError) for a query its saga does not declare and for arguments that do
        not fit the query's parameters (they are converted to the declared types, as JSON
        would bring them). An exception the query raises reaches the caller as it is."""
        return ask(self, run_id, query, args, kwargs)

    def get(self, run_id: str) -> RunRecord:
        """The run; RunNotFoundError if there is none (saying so when it is a debounced start
        whose window is not due yet: :meth:`pending`)."""
        run = self.store.get_run(check_text(run_id, "run_id"))
        if run is None or (self.own_app_only and run.app != self.app_name):
            window = events.window(self, run_id) if run is None else None
            raise RunNotFoundError(
                run_id, None if window is None else events.debounced_text(window)
            )
        return run

    def scoped(self) -> Client:
        """This client, knowing only the runs of its app: another app's run is not found,
        whatever is asked of it (the console and the MCP server are scoped so, on a database
        that apps share)."""
        if not self.app_name:
            raise ValidationError("a scoped client needs its app: Client(store, app)")
        client = Client(
            self.store,
            self.app or self.app_name,
            clock=self.clock,
            streams=self.streams,
            start_backlog=self.start_backlog,
        )
        client.own_app_only = True
        return client

    @property
    def schedules(self) -> Schedules:
        """The app's schedules: create, describe, pause, trigger, backfill... (``schedules``)."""
        from sagaloop.client.schedules import Schedules

        return Schedules(self)

    def history(self, run_id: str) -> list[Event]:
        self.get(run_id)
        return self.store.load_history(None, run_id)

    def get_published(self, run_id: str, key: str, default: Any = None) -> Any:
        """The latest value the run published under ``key`` (``ctx.publish``), or
        ``default`` if it published none."""
        self.get(run_id)  # RunNotFoundError
        return self._published(run_id).get(key, default)

    def status(self, run_id: str) -> Timeline:
        run = self.get(run_id)
        now = self.clock.now()
        found = timeline(run, self.store.load_history(None, run_id), now)
        found.abandoned = self.store.abandoned_attempts(run_id, seen_after=now - LIVE)
        return served(found, run.app, self.store, now)  # a queue nobody consumes; no engine

    def list(
        self,
        *,
        status: str | None = None,
        saga: str | None = None,
        limit: int = 100,
        id_prefix: str | None = None,
        input_text: str | None = None,
        updated_since: datetime | None = None,
        order: RunOrder | str = RunOrder.UPDATED_DESC,
        after: str | None = None,
    ) -> list[RunRecord]:
        """Up to ``limit`` runs matching the filters, most recently updated first (see
        ``RunQueries.list_runs`` for each filter, the orders and what keyset paging
        guarantees). The next page: ``after=sagaloop.run_cursor(runs[-1], order)`` when the page
        was full; ``order``: a :class:`sagaloop.RunOrder` or its value (``"-created"``...)."""
        if saga is not None:
            check_text(saga, "saga name")
        app = self.app_name if self.own_app_only else None
        return self.store.list_runs(
            status=status,
            saga=saga,
            app=app,
            limit=limit,
            id_prefix=id_prefix or None,
            input_text=input_text or None,
            updated_since=updated_since,
            order=run_order(order),
            after=after or None,
        )

    def count(self, *, saga: str | None = None) -> dict[str, int]:
        """How many runs (of ``saga``, if given) there are in each status."""
        app = self.app_name if self.own_app_only else None
        return self.store.count_runs(saga=saga, app=app)

    def stream(
        self, run_id: str, *, follow: bool = True, poll: float = 0.2, timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Follow a run: first what its history holds (``{"source": "history", "seq", "at",
        "position", "kind", "name", "data"}``; ``position``: the command's, or None), then,
        while ``follow`` and until the run finishes, its new history events and what its
        steps stream live (``{"source": "live", "step", "position", "attempt", "data"}``: an
        agent's model tokens, say; never recorded, so a reader that was not listening gets
        the recorded result from the history only)."""
        return reading.stream(self, run_id, follow=follow, poll=poll, timeout=timeout)

    def result(
        self, run_id: str, *, timeout: float | timedelta | None = None, poll: float = 0.05
    ) -> Any:
        """Wait for the run to finish; return its output or raise SagaFailedError.

        The output is of the type the saga declares (a pydantic model, a dataclass...) when
        this client has the App that declares it (``Client(store, app)``); else it is the JSON
        that was stored (``get(run_id).output``). An output that no longer fits the declared
        type (changed since the run finished) raises ValidationError. TimeoutError after
        ``timeout`` seconds (``0``: read once; ``None``: wait for ever); the store is read
        every ``poll`` seconds at first, then less often (:func:`~.polling.poll_until`)."""

        def read() -> Any:
            try:
                run = self.get(run_id)
            except RunNotFoundError as e:
                if self.store.get_run(run_id) is None and events.window(self, run_id) is not None:
                    return Pending(str(e))  # a debounced start: its run starts when due
                raise
            if run.status == s.COMPLETED:
                return self._output(run)
            if run.status in s.FINAL_STATUSES:
                error = _ErrorInfo.from_json(run.error) if run.error else None
                raise SagaFailedError(run_id, run.status, error)
            return Pending(f"run {run_id!r} is still {run.status}")

        return poll_until(read, timeout=timeout, poll=poll)

    def _output(self, run: RunRecord) -> Any:
        """The output of a completed run, of the type its saga declares when this client has
        the App that declares it."""
        saga = self.app.get_saga(run.saga) if self.app is not None else None
        if saga is None or run.app != self.app_name:
            return run.output
        try:
            return saga.output.from_json(run.output, what=f"the output of run {run.run_id!r}")
        except ValidationError as e:
            raise ValidationError(
                f"{e} (saga {run.saga!r} declares another type now): read the stored "
                "JSON with Client.get(run_id).output"
            ) from e

    def wait_published(
        self,
        run_id: str,
        key: str,
        *,
        timeout: float | timedelta | None,
        after: Any = NOTHING,
        poll: float = 0.05,
    ) -> Any:
        """The value run ``run_id`` published under ``key`` (``ctx.publish``), as soon as it
        has published one: the latest, read from its history. With ``after``, a value other
        than ``after`` (compared as JSON: pass the value this method returned last, to wait for
        the next one; a value published again unchanged is not a new one).

        TimeoutError after ``timeout`` seconds (a float or a timedelta; ``0``: read once, now;
        ``None``: wait for ever); :class:`NotPublishedError` (a RunFinishedError) if the run
        ended without publishing such a value; RunNotFoundError for no such run. The store is
        read as :meth:`result` reads it: every ``poll`` seconds at first, then less often.

        In a test, a :class:`~sagaloop.testing.Harness` does the run's work only when it is
        stepped, on the test's thread: read with ``timeout=0`` after ``run_until_idle`` or
        ``advance``, or call ``Harness.wait_published``, which steps the harness until the
        value is there."""
        return reading.wait_published(self, run_id, key, timeout=timeout, after=after, poll=poll)

    def publish_event(
        self, name: str, data: Any = None, *, key: str | None = None, event_id: str | None = None
    ) -> PublishedEvent:
        """Publish the event ``name`` (JSON ``data``, an optional ``key``) to this client's
        app: its engine delivers it, in one transaction, to every run subscribed to it or
        waiting on it (``ctx.subscribe``, ``ctx.wait_for_event(name, key=..., match=...)``)
        and starts a run of each saga declared with ``@app.saga(on_event=name)``. Each such
        run receives it once. ``event_id`` (default: a new uuid) makes it safe to retry:
        publishes with the same id are fanned out once. Runs that subscribe after the engine
        fanned it out never receive it."""
        return events.publish(self, name, data, key=key, event_id=event_id)

    def update(
        self,
        run_id: str,
        name: str,
        data: Any = None,
        *,
        update_id: str | None = None,
        timeout: float | timedelta | None = None,
        poll: float = 0.05,
    ) -> Any:
        """Send the update ``name`` with ``data`` (JSON) to run ``run_id`` and return what its
        handler (``ctx.on_update``) returned. ``UpdateRefusedError`` if the run refused it
        before recording it (its validator raised, it has no handler for ``name``, the data
        does not fit, the run ended or needs attention): nothing was applied.
        ``UpdateFailedError`` if the handler raised (``.error``: its type and message).

        ``update_id`` (default: a new one) makes a retry safe: the update is applied at most
        once per ``update_id`` and every send of it gets the same answer, also after the run
        continued as new (the latest 1,000 answers are carried). TimeoutError after
        ``timeout`` seconds (``None``: wait for ever): the update may still be applied; send
        it again with the same ``update_id`` to read its answer. The store is read as
        :meth:`result` reads it."""
        return updates.update(
            self, run_id, name, data, update_id=update_id, timeout=timeout, poll=poll
        )
