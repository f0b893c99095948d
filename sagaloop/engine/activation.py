"""The engine: one activation per message addressed to a run.

An activation has two halves. :meth:`Engine.prepare`, outside any transaction: read the run,
bring its state up to date (from the cache or by replaying the history), append the events the
message causes and let the saga code react, under the activation deadline. :meth:`Engine.apply`,
inside the caller's write transaction: record the message in the inbox, update the run only if
nobody else did since it was read (its ``last_seq``; else :class:`ActivationConflict`), and
write the events, timers and outgoing messages. Saga code never runs while a write lock is
held, and nothing of the run stays in memory but a bounded cache of committed state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from sagaloop.engine import gate, runlog, tracing
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO, UNDO, halts_in_doubt, idempotency_key, task_message_id
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import (
    CancelPayload,
    Envelope,
    EventPayload,
    StartPayload,
    derived_id,
    engine_queue,
    inbox_key,
    local_queue,
    parse_payload,
    step_queue,
)
from sagaloop.engine.ports import Clock, Outgoing, RunRecord, Store, SystemClock, Timer, Tx
from sagaloop.engine.replay import Replayer
from sagaloop.engine.state import RunState
from sagaloop.engine.watchdog import Watchdog
from sagaloop.errors import (
    ActivationDeadlineError,
    ErrorInfo,
    MessageError,
    NonDeterminismError,
    TransientStoreError,
    ValidationError,
)
from sagaloop.sagas.app import App
from sagaloop.sagas.approvals import call_id_of
from sagaloop.sagas.policy import RetryPolicy

logger = logging.getLogger(__name__)

ENGINE_CONSUMER = "engine"
Triggers = Callable[[RunState], list[NewEvent]]


class ActivationConflict(TransientStoreError):
    """The run changed (another engine activated it) between prepare and apply: prepare
    again."""


@dataclasses.dataclass
class _Live:
    """A run's state and, unless it cannot run, its suspended saga code."""

    state: RunState
    code: Replayer | None
    divergence: dict[str, Any] | None = None
    """A reason to park found while catching up (non-determinism, the deadline), not yet
    recorded as ``run_parked``."""
    record: RunRecord | None = None
    """The run's row as this engine last committed it (see :meth:`Engine.prepare`'s
    ``trust_cache``)."""

    def drop_code(self) -> None:
        """Forget the saga code, closing what it left suspended (see ``Replayer.close``)."""
        if self.code is not None:
            self.code.close()
            self.code = None


def _drop(live: _Live | None) -> None:
    if live is not None:
        live.drop_code()


@dataclasses.dataclass
class _Effects:
    """What an activation writes, all at once in :meth:`Engine.apply`."""

    at: datetime
    """When the activation happened: the time of all its events."""
    after_seq: int
    """The run's last stored event; ``events`` come after it."""
    events: list[NewEvent] = dataclasses.field(default_factory=list)
    messages: list[Outgoing] = dataclasses.field(default_factory=list)
    timers: list[Timer] = dataclasses.field(default_factory=list)
    clear_timers: bool = False
    restart: NewEvent | None = None
    """Continued as new: the history is deleted and starts again with this ``run_started``."""
    trace: dict[str, str] | None = None
    """The trace context the messages it sends carry (see ``tracing.activation``)."""

    def send(self, queue: str, **envelope: Any) -> None:
        """Queue a message, stamped with the activation's time and trace, for the outbox."""
        message = Envelope(created_at=self.at, trace=self.trace, **envelope)
        self.messages.append(Outgoing(queue, message))


@dataclasses.dataclass
class Plan:
    """What :meth:`Engine.prepare` decided for one message; :meth:`Engine.apply` writes it."""

    env: Envelope
    run: RunRecord | None = None
    """The run as it will be saved (None: the message changes no run)."""
    base_seq: int = 0
    """The run's ``last_seq`` when it was read: the update applies only if it is unchanged."""
    cached: bool = False
    """Decided on the engine's cached run, not read: even a plan that writes nothing checks,
    when applied, that the run is still at ``base_seq`` (else a result the cached state does
    not expect yet would be taken for a late one and dropped)."""
    effects: _Effects | None = None
    create: bool = False
    """The run does not exist yet: insert it (a start published without a client)."""
    rejected: str | None = None
    """The message was refused (the run records why); dead-letter it after the commit."""
    logs: list[runlog.Line] = dataclasses.field(default_factory=list)
    """The log lines of the events it appends, written once they are committed."""


class Engine:
    """Processes the messages of the engine queue. Thread-compatible, not thread-safe: give each
    thread its own Engine (they may share the store), or share one under a lock (as
    ``EngineConsumer.lock`` does for the engine's and the in-process steps' threads)."""

    def __init__(
        self,
        app: App,
        store: Store,
        *,
        clock: Clock | None = None,
        cache_size: int = 1024,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.clock = clock or SystemClock()
        self.cache_size = cache_size
        self.watchdog = watchdog or Watchdog()
        self._cache: collections.OrderedDict[str, _Live] = collections.OrderedDict()
        self._staged: dict[str, _Live] = {}
        self._staged_runs: dict[str, RunRecord] = {}
        self._restarted: set[str] = set()
        """Runs whose history a staged plan restarts: not activated again before it commits."""
        self._distrust_until = 0.0
        """``time.monotonic()`` until which :meth:`prepare` does not trust the cache."""
        self._logs: list[runlog.Line] = []
        """The log lines of the plans applied in the open transaction (see ``runlog``)."""
        self.queue = engine_queue(app.name)

    # --- messages ----------------------------------------------------------------------------

    def prepare(self, env: Envelope, *, trust_cache: bool = False) -> Plan:
        """Decide what ``env`` does, outside any transaction: the saga code runs here. Raises
        MessageError for a message that can never be processed (the consumer dead-letters it).

        Call :meth:`committed` or :meth:`rolled_back` once the plan's transaction ended, so that
        the cache only ever holds committed state. With ``trust_cache``, a run this engine
        activated last is not read again: if another engine changed it since, :meth:`apply`
        raises ActivationConflict (its update names the ``last_seq`` it started from)."""
        if env.type == "start":
            return self._on_start(env)
        if env.type == "child_start":
            return self._on_child_start(env)
        triggers = _TRIGGERS.get(env.type)
        if triggers is None:
            raise MessageError(f"message type {env.type!r} is not for the engine")
        cached = self._cached_record(env.run_id) if trust_cache and self.trusts_cache else None
        run = cached or self._read_run(env.run_id)
        plan = self._activate(env, run, triggers(self, env, run))
        plan.cached = cached is not None
        return plan

    @property
    def trusts_cache(self) -> bool:
        """Whether ``prepare(trust_cache=True)`` uses the cache now: not for ``DISTRUST``
        seconds after a plan from the cache met a run another engine had moved (several
        engines share this app's runs: reading costs less than preparing twice)."""
        return time.monotonic() >= self._distrust_until

    def _distrust(self) -> None:
        if self.trusts_cache:
            logger.debug("another engine moved a cached run: reading runs for %.0f s", DISTRUST)
        self._distrust_until = time.monotonic() + DISTRUST

    def _cached_record(self, run_id: str) -> RunRecord | None:
        live = self._cache.get(run_id)
        if live is None or run_id in self._staged or run_id in self._restarted:
            return None
        record = live.record
        return record if record is not None and record.last_seq == live.state.last_seq else None

    def apply(self, tx: Tx, plan: Plan, *, inbox: bool = True) -> None:
        """Write the plan in ``tx``. A duplicate message writes nothing; a run changed since
        :meth:`prepare` read it raises ActivationConflict (roll back and prepare again).
        ``inbox=False``: the message needs no inbox row, because it is never delivered (the
        reply of an in-process step, applied in the transaction that stores it)."""
        now = self.clock.now()
        key = inbox_key(self.app.name, plan.env)
        if inbox and not self.store.inbox_put(tx, ENGINE_CONSUMER, key, None, now):
            logger.debug("duplicate message %s ignored", plan.env.message_id)
            run_id = plan.env.run_id  # what prepare staged for it did not happen
            _drop(self._staged.pop(run_id, None))
            self._staged_runs.pop(run_id, None)
            return
        run, effects = plan.run, plan.effects
        if run is None or effects is None:
            if plan.cached:
                current = self.store.lock_run(tx, plan.env.run_id)
                if current is None or current.last_seq != plan.base_seq:
                    self._distrust()
                    raise ActivationConflict(f"run {plan.env.run_id!r} changed meanwhile")
            return
        if plan.create and not self.store.create_run(tx, dataclasses.replace(run, last_seq=0)):
            raise ActivationConflict(f"run {run.run_id!r} was created meanwhile")
        if not self.store.save_run(tx, run, if_last_seq=plan.base_seq):
            if plan.cached:
                self._distrust()
            raise ActivationConflict(f"run {run.run_id!r} changed meanwhile")
        if effects.restart is not None:
            self.store.delete_history(tx, run.run_id)
            self.store.append_events(tx, run.run_id, 0, [effects.restart], effects.at)
        elif effects.events:
            self.store.append_events(tx, run.run_id, effects.after_seq, effects.events, effects.at)
        self._index_approvals(tx, plan.env, run, effects)
        if effects.clear_timers:
            self.store.delete_timers(tx, run.run_id)
        for timer in effects.timers:
            self.store.add_timer(tx, timer)
        self.store.enqueue(tx, effects.messages, now)
        self._logs.extend(plan.logs)

    def _index_approvals(self, tx: Tx, env: Envelope, run: RunRecord, effects: _Effects) -> None:
        if effects.restart is not None:  # continued as new: its approvals were the old run's
            self.store.end_approvals(tx, run.run_id)
            return
        live = self._staged.get(run.run_id)
        asked = live is None or any(call_id_of(k) for k in live.state.published)
        try:
            gate.index(
                self.store,
                tx,
                run,
                effects.events,
                at=effects.at,
                message_id=env.message_id,
                asked=asked,
            )
        except gate.AnsweredMeanwhile as e:
            raise ActivationConflict(str(e)) from e

    def park(self, env: Envelope, error: ErrorInfo, failures: int) -> Plan:
        """A plan that parks the run of ``env`` in ``needs_attention`` without running saga
        code: ``env`` failed ``failures`` times. The message is kept with the run, and
        ``sagaloop retry`` processes it again."""
        run = self._read_run(env.run_id)
        reason = (
            f"the engine failed {failures} times on a {env.type} message of this run: "
            f"{error.type}: {error.message}"
        )
        data = {
            "reason": reason,
            "error": error.to_json(),
            "message": env.model_dump(mode="json", exclude_none=True),
        }

        def triggers(st: RunState) -> list[NewEvent]:
            return [] if st.finished else [NewEvent(h.RUN_PARKED, data=data)]

        _drop(self._cache.pop(run.run_id, None))  # its state may be what failed: start afresh
        _drop(self._staged.pop(run.run_id, None))
        return self._activate(env, run, [triggers], run_code=False)

    def _read_run(self, run_id: str) -> RunRecord:
        if run_id in self._restarted:
            raise ActivationConflict(f"run {run_id!r} continues as new in this transaction")
        return self._own(run_id, self._staged_runs.get(run_id) or self.store.get_run(run_id))

    def _own(self, run_id: str, run: RunRecord | None) -> RunRecord:
        """``run``, if it exists and belongs to this engine's app; else MessageError."""
        if run is None:
            raise MessageError(f"no run with id {run_id!r}")
        if run.app != self.app.name:
            raise MessageError(
                f"run {run_id!r} belongs to app {run.app!r}, not {self.app.name!r}: a message "
                "for it reached the wrong engine queue"
            )
        return run

    def _on_start(self, env: Envelope) -> Plan:
        if env.run_id in self._restarted:
            raise ActivationConflict(f"run {env.run_id!r} continues as new in this transaction")
        run = self._staged_runs.get(env.run_id) or self.store.get_run(env.run_id)
        try:
            payload: StartPayload = parse_payload(StartPayload, env)
            saga = self.app.get_saga(env.saga or "")
            if saga is None:
                raise MessageError(f"unknown saga {env.saga!r} in app {self.app.name!r}")
            what = f"input of saga {saga.name!r}"
            try:
                value = saga.input.from_json(payload.input, what=what)
                input_json = saga.input.to_json(value, what=what)
            except ValidationError as e:
                raise MessageError(str(e)) from e
        except MessageError as e:
            return self._reject_start(env, run, e.reason)
        if run is not None:  # a duplicate start, or one whose run a Client already created
            return self._activate(env, self._own(env.run_id, run), [lambda st: []])
        now = self.clock.now()
        name = saga.name
        record = RunRecord(env.run_id, self.app.name, name, s.RUNNING, input_json, now, now)

        def started(st: RunState) -> list[NewEvent]:  # in the activation's span: its trace
            data = {"input": input_json, **tracing.run_trace(env.trace)}
            return [NewEvent(h.RUN_STARTED, name=name, data=data)]

        plan = self._activate(env, record, [started])
        plan.create = True
        return plan

    def _on_child_start(self, env: Envelope) -> Plan:
        """Start a child run for the parent's ``ctx.call(saga, ...)``, linked to the parent's
        call; if its run id is taken by another run, fail the parent's call instead."""
        parent_id, pos = env.payload.get("parent"), env.position
        saga = self.app.get_saga(env.saga or "")
        if not isinstance(parent_id, str) or pos is None or saga is None:
            raise MessageError("invalid child_start: needs a known saga, parent and position")
        link = {"run_id": parent_id, "position": pos}
        run = self._staged_runs.get(env.run_id) or self.store.get_run(env.run_id)
        if run is None:
            now = self.clock.now()
            value = env.payload.get("input")
            record = RunRecord(env.run_id, self.app.name, saga.name, s.RUNNING, value, now, now)
            data = {"input": value, "parent": link, **tracing.run_trace(env.trace)}
            started = NewEvent(h.RUN_STARTED, name=saga.name, data=data)
            plan = self._activate(env, record, [lambda st: [started]])
            plan.create = True
            return plan
        first = self.store.load_history(None, run.run_id)[:1]
        if run.app == self.app.name and first and first[0].data.get("parent") == link:
            return self._activate(env, run, [lambda st: []])  # a duplicate: it runs already
        reason = f"the child run id {env.run_id!r} is taken by another run"
        error = ErrorInfo("ChildRunIdTaken", reason, non_retryable=True).to_json()
        outcome = {"child": env.run_id, "status": s.FAILED, "error": error}
        return self._activate(
            env, self._read_run(parent_id), [lambda st: self._child_outcome(st, pos, outcome)]
        )

    def _on_child_result(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        pos = env.position
        if pos is None or not isinstance(env.payload.get("child"), str):
            raise MessageError("child_result needs a position and the child's run id")
        return [lambda st: self._child_outcome(st, pos, env.payload)]

    def _on_undo_run(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        """The parent compensates: undo this completed child run as a whole (its steps'
        compensations, newest first), then tell the parent. Only its parent may ask."""
        link = {"run_id": env.payload.get("parent"), "position": env.payload.get("position")}

        def triggers(st: RunState) -> list[NewEvent]:
            if st.finished != s.COMPLETED or st.undoing or st.parent != link:
                return []
            return [NewEvent(h.UNDO_REQUESTED, data={"parent": link})]

        return [triggers]

    def _child_outcome(self, st: RunState, pos: int, outcome: dict[str, Any]) -> list[NewEvent]:
        """The event that settles the parent's call at ``pos`` with its child's outcome; none
        if the call does not await that child (any more)."""
        child = st.children.get(pos)
        undone = st.steps.get(pos)
        if child is None and undone is not None and undone.child == outcome.get("child"):
            if undone.comp_status in s.IN_FLIGHT:  # the child run was undone as a whole
                return [NewEvent(h.COMPENSATION_COMPLETED, pos, undone.name, {})]
            return []
        if child is None or child[0] != outcome.get("child"):
            return []
        run_id, name = child
        if outcome.get("status") == s.COMPLETED:
            return [NewEvent(h.CHILD_COMPLETED, pos, name, {"result": outcome.get("output")})]
        error = outcome.get("error")
        if not isinstance(error, dict):
            error = {"type": "ChildRunFailed", "message": f"child run {run_id!r} ended"}
        error = {
            **error,
            "message": f"child run {run_id!r} {outcome.get('status')}: {error.get('message', '')}",
        }
        return [
            NewEvent(h.CHILD_FAILED, pos, name, {"error": error, "status": outcome.get("status")})
        ]

    def _reject_start(self, env: Envelope, run: RunRecord | None, reason: str) -> Plan:
        """A start the engine refuses fails its run with the reason (creating it if no client
        did), unless the run already went further: then it is someone else's run, left alone.
        Either way the message is dead-lettered."""
        if run is not None and (run.processed_seq > 0 or run.app != self.app.name):
            raise MessageError(reason)
        error = ErrorInfo("RejectedStart", f"the engine refused the start: {reason}").to_json()
        finish = [
            NewEvent(h.SAGA_FINISHED, data={"error": error}),
            NewEvent(h.RUN_FINISHED, data={"status": s.FAILED}),
        ]
        if run is None:
            now = self.clock.now()
            saga = (env.saga or "?")[:200]
            run = RunRecord(env.run_id, self.app.name, saga, s.RUNNING, None, now, now)
            started = NewEvent(h.RUN_STARTED, name=saga, data={"input": None})
            plan = self._activate(env, run, [lambda st: [started, *finish]], run_code=False)
            plan.create = True
        else:
            plan = self._activate(env, run, [lambda st: finish], run_code=False)
        plan.rejected = reason  # its run_finished line says why (see runlog)
        return plan

    def _on_event(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        payload: EventPayload = parse_payload(EventPayload, env)
        name, data = payload.name, payload.data
        if call_id_of(name) is not None:  # an answer to an approval: judged as recorded
            return [gate.answer_trigger(self.store, env.run_id, env.message_id, name, data)]
        event = NewEvent(h.EVENT_ARRIVED, name=name, data={"data": data})
        return [lambda st: [event]]

    def _on_cancel(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        payload: CancelPayload = parse_payload(CancelPayload, env)

        def triggers(st: RunState) -> list[NewEvent]:
            if st.cancel_reason is not None or st.saga_done:
                return []
            return [NewEvent(h.CANCEL_REQUESTED, data={"reason": payload.reason or "cancelled"})]

        return [triggers]

    def _on_retry(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        kept: list[Triggers] = []

        def triggers(st: RunState) -> list[NewEvent]:
            if st.parked is None:
                logger.info("retry of run %s ignored: it does not need attention", env.run_id)
                return []
            message = st.parked.get("message")
            if message is not None:  # the message the run was parked on: process it again
                again = Envelope.model_validate(message)
                if again.type != "start":
                    kept.extend(_TRIGGERS[again.type](self, again, run))
            return [NewEvent(h.RUN_RESUMED, data={"reason": st.parked.get("reason")})]

        def then(st: RunState) -> list[NewEvent]:
            return [event for trigger in kept for event in trigger(st)]

        return [triggers, then]

    def _on_step_result(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        pos, attempt, reply = env.position, env.attempt, env.payload
        if pos is None or attempt is None:
            raise MessageError("step_result needs position and attempt")
        error = reply.get("error")
        if not isinstance(error, dict | None) or (
            reply.get("outcome") == "halted" and not isinstance(error, dict)
        ):
            raise MessageError("invalid step_result payload: error must be an object")
        return [lambda st: self._result_events(st, pos, attempt, reply)]

    def _on_timer(self, env: Envelope, run: RunRecord) -> list[Triggers]:
        pos, kind = env.position, env.payload.get("kind")
        if pos is None:
            raise MessageError("timer needs position")
        attempt = env.attempt or 0

        def triggers(st: RunState) -> list[NewEvent]:
            step = st.steps.get(pos)
            if kind == "sleep" and pos in st.sleeps:
                return [NewEvent(h.TIMER_FIRED, pos)]
            wait = st.waits.get(pos)
            if kind == "wait" and wait is not None and not wait.resolved:
                return [NewEvent(h.TIMER_FIRED, pos, wait.name)]
            if (
                kind == "retry"
                and step
                and step.status == s.RETRYING
                and step.attempt + 1 == attempt
            ):
                data = {"attempt": attempt, "in_doubt": step.in_doubt}
                return [NewEvent(h.STEP_DISPATCHED, pos, step.name, data)]
            if (
                kind == "undo_retry"
                and step
                and step.comp_status == s.RETRYING
                and step.comp_attempt + 1 == attempt
            ):
                data = {"attempt": attempt, "in_doubt": step.comp_in_doubt}
                return [NewEvent(h.COMPENSATION_SCHEDULED, pos, step.name, data)]
            return []  # stale: what the timer was for has already happened

        return [triggers]

    def committed(self) -> None:
        """Keep the runs activated in the transaction that just committed in the cache."""
        for run_id, live in self._staged.items():
            self._cache[run_id] = live
            self._cache.move_to_end(run_id)
        self._staged.clear()
        self._staged_runs.clear()
        self._restarted.clear()
        while len(self._cache) > self.cache_size:
            _drop(self._cache.popitem(last=False)[1])
        logs, self._logs = self._logs, []
        runlog.emit(logs)

    def rolled_back(self) -> None:
        """Forget what the failed transaction's plans did to in-memory state."""
        for live in self._staged.values():
            live.drop_code()
        self._staged.clear()
        self._staged_runs.clear()
        self._restarted.clear()
        self._logs.clear()

    # --- activation --------------------------------------------------------------------------

    def _activate(
        self, env: Envelope, run: RunRecord, triggers: Sequence[Triggers], *, run_code: bool = True
    ) -> Plan:
        run_id = run.run_id
        plan = Plan(env, base_seq=run.last_seq)
        began = tracing.now_ns()
        try:
            live = self._load(run, run_code=run_code)
            with tracing.activation(env, live.state.trace, run.saga, began) as trace:
                if not live.state.finished or env.type == "undo_run":
                    effects = _Effects(self.clock.now(), live.state.last_seq, trace=trace)
                    reacted = False
                    for trigger in triggers:
                        pending = trigger(live.state)
                        if (
                            pending
                            or run.processed_seq < run.last_seq
                            or live.divergence is not None
                        ):
                            self._react(live, pending, effects)
                            reacted = True
                    if reacted:
                        plan.run = self._updated(run, live.state)
                        plan.effects = effects
                        first = run.processed_seq == 0
                        plan.logs = runlog.lines(live.state, effects.events, first=first)
                        if effects.restart is not None:  # the run's state starts again too
                            plan.run = dataclasses.replace(
                                plan.run, status=s.RUNNING, last_seq=1, processed_seq=0, reason=None
                            )
        except BaseException:
            _drop(self._staged.pop(run_id, None))
            self._staged_runs.pop(run_id, None)
            raise
        if plan.effects is not None and plan.effects.restart is not None:
            _drop(self._staged.pop(run_id, None))  # the next activation replays the fresh history
            self._restarted.add(run_id)
        else:
            live.record = plan.run or run  # in the cache once committed
            self._staged[run_id] = live
        if plan.run is not None:
            self._staged_runs[run_id] = plan.run
        return plan

    def _updated(self, run: RunRecord, st: RunState) -> RunRecord:
        return dataclasses.replace(
            run,
            status=st.status(),
            last_seq=st.last_seq,
            processed_seq=st.last_seq,
            updated_at=self.clock.now(),
            output=st.saga_output,
            error=st.saga_error,
            reason=(st.parked or {}).get("reason"),
        )

    def _load(self, run: RunRecord, *, run_code: bool = True) -> _Live:
        live = self._staged.get(run.run_id) or self._cache.pop(run.run_id, None)
        if live is not None and live.state.last_seq <= run.last_seq:
            if live.state.last_seq < run.last_seq:  # another engine appended since
                newer = self.store.load_history(None, run.run_id, after_seq=live.state.last_seq)
                newer = [e for e in newer if e.seq <= run.last_seq]  # as of the run row read
                self._catch_up(live, newer, run.processed_seq)
            return live
        _drop(live)  # newer than the run row read: this transaction lost a race
        events = self.store.load_history(None, run.run_id)
        events = [e for e in events if e.seq <= run.last_seq]  # as of the run row read
        live = _Live(RunState(run.run_id), None)
        for ev in events:
            live.state.apply(ev)
        st = live.state
        if run_code and not (st.finished or st.saga_done or st.failing or _code_stopped(st.parked)):
            live.code = self._new_code(live, run.saga)
            self._catch_up(live, events, run.processed_seq, fold=False)
        return live

    def _new_code(self, live: _Live, saga_name: str) -> Replayer | None:
        saga = self.app.get_saga(saga_name)
        if saga is None:
            return None
        return Replayer(self.app, saga, live.state.run_id, watchdog=self.watchdog)

    def _catch_up(
        self, live: _Live, events: list[Event], processed_seq: int, *, fold: bool = True
    ) -> None:
        if fold:
            for ev in events:
                live.state.apply(ev)
        if live.code is None or not events:
            return
        try:
            replayed = [e for e in events if e.seq <= processed_seq]
            live.code.feed(replayed, replaying=True)
            live.code.feed([e for e in events if e.seq > processed_seq], replaying=False)
            live.code.take_rejections()  # recorded when they happened
        except (NonDeterminismError, ActivationDeadlineError) as e:
            live.drop_code()
            live.divergence = _park_data(e)

    def _react(self, live: _Live, pending: list[NewEvent], effects: _Effects) -> None:
        st = live.state
        if live.divergence is not None:  # found on load: record it first
            pending = [NewEvent(h.RUN_PARKED, data=live.divergence), *pending]
            live.divergence = None
        while True:
            if pending:
                events = h.number(st.last_seq, pending, effects.at)
                effects.events.extend(pending)
                pending = []
                for ev in events:
                    st.apply(ev)
                    if live.code is not None:
                        try:
                            live.code.feed([ev], replaying=False)
                        except (NonDeterminismError, ActivationDeadlineError) as e:
                            live.drop_code()
                            pending.append(NewEvent(h.RUN_PARKED, data=_park_data(e)))
                        else:
                            pending.extend(live.code.take_rejections())
                    pending.extend(self._effects_of(ev, live, effects))
            pending.extend(self._decide(live))
            if not pending:
                return

    # --- what the engine does next ------------------------------------------------------------

    def _decide(self, live: _Live) -> list[NewEvent]:
        st, code = live.state, live.code
        if st.finished or st.parked is not None:
            return []
        if code is not None:
            commands = code.take_new_commands()
            if commands:
                return commands
            if code.outcome is not None and "continue_as_new" in code.outcome:
                if st.continued is None:
                    data = {"input": code.outcome["continue_as_new"]}
                    return [NewEvent(h.RUN_CONTINUED, data={**data, **code.outcome})]
                return []
            if code.outcome is not None and not st.saga_done:
                return [NewEvent(h.SAGA_FINISHED, data=code.outcome)]
        elif not st.saga_done and not st.failing:
            saga = self.app.get_saga(st.saga)
            if saga is None:
                reason = f"saga {st.saga!r} is not registered in app {self.app.name!r}"
                return [NewEvent(h.RUN_PARKED, data={"reason": reason})]
        if not st.failing:
            if st.undo_requested is not None:  # ctx.compensate: undo, then let the code go on
                undo = self._next_undo(st)
                return [NewEvent(h.COMPENSATE_DONE, st.undo_requested)] if undo is None else undo
            if st.saga_done:
                return [NewEvent(h.RUN_FINISHED, data={"status": s.COMPLETED})]
            return []
        undo = self._next_undo(st)
        if undo is not None:
            return undo
        if st.cancel_reason is not None:
            status = s.CANCELLED
        elif any(x.comp_status == s.DONE for x in st.steps.values()):
            status = s.COMPENSATED
        else:
            status = s.FAILED
        return [NewEvent(h.RUN_FINISHED, data={"status": status})]

    def _cancel_children(self, st: RunState, effects: _Effects) -> None:
        """Cancel the child runs still in flight: their parent is cancelled or has ended."""
        for pos, (child, _) in st.children.items():
            effects.send(
                self.queue,
                type="cancel",
                message_id=derived_id("cancel-child", st.run_id, pos),
                run_id=child,
                payload={"reason": f"its parent run {st.run_id!r} was cancelled or ended"},
            )

    def _engine_queue_of(self, run_id: str) -> str:
        """The engine queue of the app that ``run_id`` belongs to (this app's if none does
        yet: its engine dead-letters the message, or it is a run this app starts)."""
        run = self.store.get_run(run_id)
        return engine_queue(run.app) if run is not None else self.queue

    def _next_undo(self, st: RunState) -> list[NewEvent] | None:
        """The next compensation to schedule, newest completed step first; ``[]`` while a
        step or compensation is in flight (undo only once they settled); None: none left."""
        if st.in_flight() or st.compensations_in_flight():
            return []
        for step_state in st.to_compensate():
            step = self.app.get_step(step_state.name)
            if step_state.child is not None or (step is not None and step.compensation_fn):
                data = {"attempt": 1, "in_doubt": step_state.status != s.DONE}
                return [NewEvent(h.COMPENSATION_SCHEDULED, step_state.pos, step_state.name, data)]
        return None

    def _effects_of(self, ev: Event, live: _Live, effects: _Effects) -> list[NewEvent]:
        st = live.state
        kind = ev.kind
        if kind in (h.STEP_SCHEDULED, h.STEP_DISPATCHED, h.COMPENSATION_SCHEDULED):
            assert ev.pos is not None
            direction = UNDO if kind == h.COMPENSATION_SCHEDULED else DO
            attempt, force = ev.data.get("attempt", 1), bool(ev.data.get("force"))
            return self._dispatch(live, ev.pos, direction, attempt, force, effects)
        if kind == h.TIMER_STARTED:
            assert ev.pos is not None
            effects.timers.append(Timer(st.run_id, ev.pos, "sleep", st.sleeps[ev.pos]))
        elif kind == h.EVENT_WAITING:
            assert ev.pos is not None
            wait = st.waits[ev.pos]
            if wait.until is not None and not wait.resolved:
                effects.timers.append(Timer(st.run_id, ev.pos, "wait", wait.until))
        elif kind in (h.STEP_RETRYING, h.COMPENSATION_RETRYING):
            assert ev.pos is not None
            step_state = st.steps[ev.pos]
            if kind == h.STEP_RETRYING:
                timer_kind, attempt = "retry", step_state.attempt + 1
                fire_at = step_state.retry_at
            else:
                timer_kind, attempt = "undo_retry", step_state.comp_attempt + 1
                fire_at = step_state.comp_retry_at
            assert fire_at is not None
            effects.timers.append(Timer(st.run_id, ev.pos, timer_kind, fire_at, attempt))
        elif kind == h.EVENT_SENT:
            assert ev.pos is not None and ev.name is not None
            target = str(ev.data["run_id"])
            effects.send(
                self._engine_queue_of(target),
                type="event",
                message_id=derived_id("sent", st.run_id, ev.pos),
                run_id=target,
                payload={"name": ev.name, "data": ev.data.get("data")},
            )
        elif kind == h.RUN_SPAWNED:
            assert ev.pos is not None and ev.name is not None
            effects.send(
                self.queue,
                type="start",
                message_id=derived_id("spawned", st.run_id, ev.pos),
                run_id=str(ev.data["run_id"]),
                saga=ev.name,
                payload={"input": ev.data.get("input")},
            )
        elif kind == h.EVENT_REJECTED:  # the wait goes on: so does its timeout
            rejected = st.waits.get(ev.pos) if ev.pos is not None else None
            if rejected is not None and rejected.until is not None and not rejected.resolved:
                effects.timers.append(Timer(st.run_id, rejected.pos, "wait", rejected.until))
        elif kind == h.RUN_CONTINUED:  # a fresh history; a start message activates it
            effects.clear_timers = True
            data = {
                "input": ev.data.get("input"),
                "first_pos": ev.data.get("next_pos", 0),
                "epoch": st.epoch + 1,
                **({"trace": st.trace} if st.trace else {}),  # the same run: the same trace
            }
            effects.restart = NewEvent(h.RUN_STARTED, name=st.saga, data=data)
            effects.send(
                self.queue,
                type="start",
                message_id=derived_id("continued", st.run_id, st.epoch + 1),
                run_id=st.run_id,
                saga=st.saga,
                payload={"input": ev.data.get("input")},
            )
            self._cancel_children(st, effects)
        elif kind == h.CHILD_STARTED:
            assert ev.pos is not None and ev.name is not None
            effects.send(
                self.queue,
                type="child_start",
                message_id=derived_id("child", st.run_id, ev.pos),
                run_id=str(ev.data["run_id"]),
                saga=ev.name,
                position=ev.pos,
                payload={"input": ev.data.get("input"), "parent": st.run_id},
            )
        elif kind == h.CANCEL_REQUESTED:
            self._cancel_children(st, effects)
        elif kind == h.RUN_FINISHED:
            effects.clear_timers = True
            self._cancel_children(st, effects)
            if st.parent is not None:  # tell the parent's call how its child ended
                outcome = {
                    "child": st.run_id,
                    "status": ev.data.get("status"),
                    "output": st.saga_output,
                    "error": st.saga_error,
                }
                effects.send(
                    self.queue,
                    type="child_result",
                    message_id=derived_id("child-result", st.run_id, ev.data.get("status")),
                    run_id=str(st.parent["run_id"]),
                    position=int(st.parent["position"]),
                    payload=outcome,
                )
        elif kind == h.RUN_RESUMED:
            return self._resume(live, effects)
        return []

    def _resume(self, live: _Live, effects: _Effects) -> list[NewEvent]:
        st = live.state
        if live.code is None and not st.saga_done and not st.failing:
            # Replay from the start with the code now deployed; it may park the run again.
            code = self._new_code(live, st.saga)
            live.code = code
            if code is not None:
                stored = self.store.load_history(None, st.run_id)
                history = [e for e in stored if e.seq <= effects.after_seq]
                history += h.number(effects.after_seq, effects.events, effects.at)
                self._catch_up(live, history, st.last_seq, fold=False)
                if live.divergence is not None:
                    parked, live.divergence = live.divergence, None
                    return [NewEvent(h.RUN_PARKED, data=parked)]
        events: list[NewEvent] = []
        for x in st.steps.values():
            if x.status == s.HALTED:  # in doubt, or parked by a failure a person fixed
                data = {"attempt": x.attempt + 1, "in_doubt": x.in_doubt, "force": True}
                events.append(NewEvent(h.STEP_DISPATCHED, x.pos, x.name, data))
            if x.comp_status == s.GAVE_UP:
                data = {"attempt": x.comp_attempt + 1, "in_doubt": True}
                events.append(NewEvent(h.COMPENSATION_SCHEDULED, x.pos, x.name, data))
        return events

    def _dispatch(
        self,
        live: _Live,
        pos: int,
        direction: str,
        attempt: int,
        force: bool,
        effects: _Effects,
    ) -> list[NewEvent]:
        st = live.state
        step_state = st.steps[pos]
        if step_state.child is not None:  # undo the child run as a whole
            effects.send(
                self.queue,
                type="undo_run",
                message_id=derived_id("undo-child", st.run_id, pos, attempt),
                run_id=step_state.child,
                payload={"parent": st.run_id, "position": pos},
            )
            return []
        step = self.app.get_step(step_state.name)
        if step is None:
            reason = f"step {step_state.name!r} is not registered in app {self.app.name!r}"
            return [NewEvent(h.RUN_PARKED, data={"reason": reason})]
        in_doubt = step_state.in_doubt if direction == DO else step_state.comp_in_doubt
        payload: dict[str, Any] = {
            "step": step.name,
            "direction": direction,
            "args": step_state.args,
            "in_doubt": in_doubt,
        }
        if direction == UNDO:
            payload["result"] = step_state.result if step_state.status == s.DONE else None
        elif step.schedule_to_close is not None:
            deadline = step_state.scheduled_at + step.schedule_to_close
            payload["schedule_deadline"] = deadline.isoformat()
        if force:
            payload["force"] = True
        task = Envelope(
            type="step",
            message_id=task_message_id(st.run_id, pos, direction, attempt),
            run_id=st.run_id,
            saga=st.saga,
            position=pos,
            attempt=attempt,
            idempotency_key=idempotency_key(st.run_id, pos, direction),
            payload=payload,
            created_at=self.clock.now(),
            trace=effects.trace,
        )
        queue = local_queue(self.app.name) if step.local else step_queue(self.app.name, step.queue)
        effects.messages.append(Outgoing(queue, task))
        return []

    def _result_events(
        self, st: RunState, pos: int, attempt: int, reply: dict[str, Any]
    ) -> list[NewEvent]:
        step_state = st.steps.get(pos)
        if step_state is None:
            return []
        direction, outcome = reply.get("direction", DO), reply.get("outcome")
        worker = {"worker": reply.get("worker")}
        name = step_state.name
        if direction == DO:
            if step_state.status not in s.IN_FLIGHT or step_state.attempt != attempt:
                return []  # a late or duplicate reply
            if outcome == "completed":
                data = {"result": reply.get("result"), "reconciled": bool(reply.get("reconciled"))}
                took = reply.get("took_s")
                if data["reconciled"] and isinstance(took, int | float):  # the attempt's time
                    data["took_s"] = took  # (not the lease a dead worker's message waited)
                return [NewEvent(h.STEP_COMPLETED, pos, name, {**data, **worker})]
            if outcome == "halted":
                reason = str(reply["error"].get("message"))
                return [
                    NewEvent(h.STEP_HALTED, pos, name, {"error": reply["error"], **worker}),
                    NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
                ]
        else:
            if step_state.comp_status not in s.IN_FLIGHT or step_state.comp_attempt != attempt:
                return []
            if outcome == "completed":
                return [NewEvent(h.COMPENSATION_COMPLETED, pos, name, {**worker})]
            if outcome == "halted":  # the worker gave up on the message: `retry` undoes again
                reason = f"compensation of step {name!r}: {reply['error'].get('message')}"
                return [
                    NewEvent(h.COMPENSATION_FAILED, pos, name, {"error": reply["error"], **worker}),
                    NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
                ]
        error = ErrorInfo.from_json(reply.get("error") or {"type": "Error", "message": "?"})
        cancelling = st.cancel_reason is not None
        return self._failure_events(step_state, direction, attempt, error, worker, cancelling)

    def _failure_events(
        self,
        step_state: s.StepState,
        direction: str,
        attempt: int,
        error: ErrorInfo,
        extra: dict[str, Any],
        cancelling: bool = False,
    ) -> list[NewEvent]:
        pos, name = step_state.pos, step_state.name
        step = self.app.get_step(name)
        policy = step.retry if step is not None else None
        in_doubt = not (error.not_applied or error.non_retryable or error.needs_attention)
        retryable = (
            policy is not None
            and not error.non_retryable
            and not error.needs_attention  # a person must fix it first: no attempt helps
            and policy.is_retryable(error.type)
            and policy.allows(attempt)
            # the run is cancelled: no new attempt of a step; undo what it may have done
            and not (cancelling and direction == DO)
        )
        if retryable and direction == DO and step is not None and step.schedule_to_close:
            assert policy is not None
            retry_at = self.clock.now() + _delay(policy, attempt, error)
            if retry_at >= step_state.scheduled_at + step.schedule_to_close:
                retryable = False  # no attempt would start before the schedule_to_close
        data = {"error": error.to_json(), "in_doubt": in_doubt, **extra}
        if direction == UNDO:
            if retryable:
                assert policy is not None
                data["retry_at"] = (self.clock.now() + _delay(policy, attempt, error)).isoformat()
                return [NewEvent(h.COMPENSATION_RETRYING, pos, name, data)]
            reason = f"compensation of step {name!r} failed for good: {error.type}: {error.message}"
            return [
                NewEvent(h.COMPENSATION_FAILED, pos, name, data),
                NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
            ]
        if retryable and in_doubt and step is not None and halts_in_doubt(step):
            reason = (
                f"step {name!r} (idempotent=False, no reconcile) failed in doubt with "
                f"{error.type}: {error.message}; it was not re-attempted. Check the effect, "
                "then `sagaloop retry` the run."
            )
            return [
                NewEvent(h.STEP_HALTED, pos, name, data),
                NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
            ]
        if retryable:
            assert policy is not None
            data["retry_at"] = (self.clock.now() + _delay(policy, attempt, error)).isoformat()
            return [NewEvent(h.STEP_RETRYING, pos, name, data)]
        if not cancelling and (error.needs_attention or (policy and policy.give_up == "park")):
            why = "needs a person" if error.needs_attention else "failed for good"
            reason = (
                f"step {name!r} {why}: {error.describe()}; nothing was undone. Fix the cause, "
                "then `sagaloop retry` the run: the step runs again."
            )
            return [
                NewEvent(h.STEP_HALTED, pos, name, data),
                NewEvent(h.RUN_PARKED, pos, name, {"reason": reason}),
            ]
        return [NewEvent(h.STEP_FAILED, pos, name, data)]


def _delay(policy: RetryPolicy, attempt: int, error: ErrorInfo) -> timedelta:
    """The wait before the attempt after ``attempt``: the policy's, or longer when the error
    asks it (a provider's ``Retry-After``)."""
    delay = policy.delay(attempt)
    if error.retry_after is not None:
        delay = max(delay, timedelta(seconds=error.retry_after))
    return delay


def _park_data(e: NonDeterminismError | ActivationDeadlineError) -> dict[str, Any]:
    """The ``run_parked`` data for saga code that cannot go on: it is not run again (until a
    retry replays it with the code then deployed)."""
    if isinstance(e, ActivationDeadlineError):
        return {"reason": str(e), "deadline": True, "stack": e.stack}
    return {"reason": str(e), "nondeterminism": True}


def _code_stopped(parked: dict[str, Any] | None) -> bool:
    return bool(parked and (parked.get("nondeterminism") or parked.get("deadline")))


_TRIGGERS: dict[str, Callable[[Engine, Envelope, RunRecord], list[Triggers]]] = {
    "event": Engine._on_event,
    "cancel": Engine._on_cancel,
    "retry": Engine._on_retry,
    "step_result": Engine._on_step_result,
    "child_result": Engine._on_child_result,
    "undo_run": Engine._on_undo_run,
    "timer": Engine._on_timer,
}

DEFAULT_LEASE = timedelta(seconds=60)
DISTRUST = 30.0
"""Seconds an engine reads every run after a plan from its cache met a run moved by another
engine (see :attr:`Engine.trusts_cache`)."""
