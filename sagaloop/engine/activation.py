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
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timedelta
from typing import NoReturn

from sagaloop import tracing
from sagaloop.engine import (
    aftermath,
    cancelling,
    concurrency,
    decide,
    fanout,
    intake,
    runlog,
    updates,
)
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import ENGINE_CONSUMER as ENGINE_CONSUMER
from sagaloop.engine.messages import (
    ChildStart,
    Envelope,
    PublishPayload,
    StartPayload,
    derived_id,
    engine_queue,
    inbox_key,
    parse_payload,
)
from sagaloop.engine.plan import ActivationConflict as ActivationConflict
from sagaloop.engine.plan import Live, Plan, Stage, Stages, drop
from sagaloop.engine.ports import (
    Checkpoint,
    Clock,
    RunRecord,
    Store,
    SubscriptionStore,
    SystemClock,
    Tx,
    Written,
)
from sagaloop.engine.records import InboxRow
from sagaloop.engine.replay import Replayer
from sagaloop.engine.state import RunState
from sagaloop.engine.watchdog import Watchdog
from sagaloop.errors import (
    ActivationDeadlineError,
    ErrorInfo,
    MessageError,
    NonDeterminismError,
    RunNotStartedError,
    ValidationError,
)
from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)

Triggers = intake.Triggers
Started = Callable[[], list[NewEvent]]


class Engine:
    """Processes the messages of the engine queue. Thread-compatible, not thread-safe: give each
    thread its own Engine (they may share the store), or share one under a lock (as
    ``EngineConsumer.lock`` does for the engine's and the in-process steps' threads); there,
    transactions overlap if each prepares in a :class:`Stage` of its own (:meth:`stage`) and
    applies its plans outside the lock."""

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
        self._cache: collections.OrderedDict[str, Live] = collections.OrderedDict()
        self._stages = Stages()
        self._distrust_until = 0.0
        """``time.monotonic()`` until which :meth:`prepare` does not trust the cache."""
        self.on_timers: Callable[[datetime], None] | None = None
        """Called after a commit that set timers, with the earliest one's due time: the timer
        scheduler of this process then knows about it without looking at the database."""
        self.queue = engine_queue(app.name)

    # --- messages ----------------------------------------------------------------------------

    def stage(self) -> Stage:
        """A new stage for a transaction's plans (see the class); end it with :meth:`committed`
        or :meth:`rolled_back`."""
        return self._stages.new()

    def holds(self, run_ids: Collection[str]) -> bool:
        """Whether an open stage holds any of ``run_ids``: preparing one in another stage now
        raises ActivationConflict (wait for :meth:`committed` or :meth:`rolled_back`)."""
        return self._stages.holds(run_ids)

    @property
    def _st(self) -> Stage:
        return self._stages.current

    def prepare(
        self, env: Envelope, *, trust_cache: bool = False, stage: Stage | None = None
    ) -> Plan:
        """Decide what ``env`` does, outside any transaction: the saga code runs here. Raises
        MessageError for a message that can never be processed (the consumer dead-letters it).

        Call :meth:`committed` or :meth:`rolled_back` (with the same ``stage``) once the plan's
        transaction ended, so that the cache only ever holds committed state. With
        ``trust_cache``, a run this engine activated last is not read again: if another engine
        changed it since, :meth:`apply` raises ActivationConflict (its update names the
        ``last_seq`` it started from)."""
        with self._stages.working_in(stage) as st:
            self._stages.check_free(env.run_id)
            plan = self._prepare(env, trust_cache)
        plan.stage = st
        return plan

    def _prepare(self, env: Envelope, trust_cache: bool) -> Plan:
        if env.type == "start":
            return self._on_start(env)
        if env.type == "child_start":
            return self._on_child_start(env)
        if env.type == "publish":
            if not isinstance(self.store, SubscriptionStore):
                raise MessageError("this engine's store keeps no subscriptions: publish refused")
            event = parse_payload(PublishPayload, env)  # once per event id, whatever its
            once = env.model_copy(update={"message_id": derived_id("publish", env.run_id)})
            return Plan(once, fanout=event)  # message id (a raw publisher's is its bytes' hash)
        triggers = intake.triggers(env, self.app, self.store, self.clock)
        cached = self._cached_record(env.run_id) if trust_cache and self.trusts_cache else None
        run = cached or self._read_run(env.run_id)
        if concurrency.queued(self.app, run):  # record, without starting its code
            plan = self._activate(env, run, triggers, run_code=False)
            drop(self._st.live.pop(run.run_id, None))
            if plan.run is not None and plan.run.status not in s.FINAL_STATUSES:
                kept = {"status": s.RUNNING, "processed_seq": 0, "reason": run.reason}
                plan.run = dataclasses.replace(plan.run, **kept)  # type: ignore[arg-type]
                self._st.runs[run.run_id] = plan.run
            return plan
        plan = self._activate(env, run, triggers)
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
        if live is None or run_id in self._st.live or run_id in self._st.restarted:
            return None
        record = live.record
        return record if record is not None and record.last_seq == live.state.last_seq else None

    def alone(self, plans: Sequence[Plan]) -> bool:
        """Whether :meth:`apply` writes ``plans`` as one checkpoint and nothing after it
        (``aftermath.alone``): ``lone=True``."""
        return aftermath.alone(self.app, self.store, plans)

    def apply(
        self, tx: Tx, plan: Plan, *, inbox: bool = True, reply: InboxRow | None = None
    ) -> None:
        """Write the plan in ``tx``. A duplicate message writes nothing; a run changed since
        :meth:`prepare` read it raises ActivationConflict (roll back and prepare again).
        ``inbox=False``: the message is never delivered (an in-process step's reply, applied
        in the transaction that stores it, ``reply``: its worker's inbox row, written here;
        ActivationConflict if it existed)."""
        now = self.clock.now()
        row: InboxRow | None = (ENGINE_CONSUMER, inbox_key(self.app.name, plan.env), None)
        row = row if inbox else reply
        run, effects = plan.run, plan.effects
        st = plan.stage or self._stages.own  # apply may run outside the lock: not self._st
        if run is not None and effects is not None and plan.checkpoint_only:  # the hot path
            write = Checkpoint(now, row, run, plan.base_seq, effects.events, effects.at)
            write.messages, write.create = effects.messages, plan.create
            written = self.store.write_checkpoint(tx, write)
            if written is Written.DUPLICATE:
                return self._duplicate(plan, reply)
            if written is Written.CONFLICT:
                self._conflict(plan, run)
        else:
            if row is not None and not self.store.inbox_put(tx, row[0], row[1], row[2], now):
                return self._duplicate(plan, reply)
            if plan.fanout is not None:
                fanout.fan_out(self.store, self.app, tx, plan.env, plan.fanout, now)
                return
            if run is None or effects is None:
                if plan.cached:
                    current = self.store.lock_run(tx, plan.env.run_id)
                    if current is None or current.last_seq != plan.base_seq:
                        self._distrust()
                        raise ActivationConflict(f"run {plan.env.run_id!r} changed meanwhile")
                return
            if plan.slot is not None and not concurrency.enforce(self.store, tx, plan.slot, now):
                raise ActivationConflict(f"concurrency key {plan.slot.key!r} changed meanwhile")
            if plan.create:  # inserted as saved, as a checkpoint creates it
                if not self.store.create_run(tx, run):
                    raise ActivationConflict(f"run {run.run_id!r} was created meanwhile")
            elif not self.store.save_run(tx, run, if_last_seq=plan.base_seq):
                self._conflict(plan, run)
            if effects.restart is not None:
                self.store.delete_history(tx, run.run_id)
                self.store.append_events(tx, run.run_id, 0, [effects.restart], effects.at)
            elif effects.events:
                at, events = effects.at, effects.events
                self.store.append_events(tx, run.run_id, effects.after_seq, events, at)
            self.store.enqueue(tx, effects.messages, now)
        aftermath.write(self.store, self.app, tx, plan, st, now)
        st.logs.extend(plan.logs)

    def _duplicate(self, plan: Plan, reply: InboxRow | None) -> None:
        """The message's inbox row existed: nothing of ``plan`` is written."""
        logger.debug("duplicate message %s ignored", plan.env.message_id)
        # what prepare staged for it did not happen
        (plan.stage or self._stages.own).forget(plan.env.run_id)
        if reply is not None:
            raise ActivationConflict(f"the reply to {plan.env.message_id} is stored already")
        if plan.run is not None:  # its activation is not written, and later plans of
            # this transaction may count on it (a start's catch-up): prepare them again
            raise ActivationConflict(f"duplicate message {plan.env.message_id} moved the run")

    def _conflict(self, plan: Plan, run: RunRecord) -> NoReturn:
        if plan.cached:
            self._distrust()
        raise ActivationConflict(f"run {run.run_id!r} changed meanwhile")

    def park(
        self, env: Envelope, error: ErrorInfo, failures: int, *, stage: Stage | None = None
    ) -> Plan:
        """A plan that parks the run of ``env`` in ``needs_attention`` without running saga
        code: ``env`` failed ``failures`` times. The message is kept with the run, and
        ``sagaloop retry`` processes it again."""
        with self._stages.working_in(stage) as st:
            run = self._read_run(env.run_id)
            parked = decide.engine_failed(env, error, failures)
            drop(self._cache.pop(run.run_id, None))  # its state may be what failed: start afresh
            drop(st.live.pop(run.run_id, None))
            finish = [lambda rs: [] if rs.finished else parked]
            return self._activate(env, run, finish, run_code=False)

    def _read_run(self, run_id: str) -> RunRecord:
        self._stages.check_free(run_id)
        if run_id in self._st.restarted:
            raise ActivationConflict(f"run {run_id!r} continues as new in this transaction")
        return self._own(run_id, self._st.runs.get(run_id) or self.store.get_run(run_id))

    def _own(self, run_id: str, run: RunRecord | None) -> RunRecord:
        """``run``, if it exists and belongs to this engine's app; else MessageError."""
        if run is None:
            raise RunNotStartedError(f"no run with id {run_id!r}")
        if run.app != self.app.name:
            raise MessageError(
                f"run {run_id!r} belongs to app {run.app!r}, not {self.app.name!r}: a message "
                "for it reached the wrong engine queue"
            )
        return run

    def _on_start(self, env: Envelope) -> Plan:
        if env.run_id in self._st.restarted:
            raise ActivationConflict(f"run {env.run_id!r} continues as new in this transaction")
        run = self._st.runs.get(env.run_id) or self.store.get_run(env.run_id)
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
            key = concurrency.key_of(saga, input_json)
        except (MessageError, ValidationError) as e:
            return self._reject_start(env, run, e.reason if isinstance(e, MessageError) else str(e))
        now = self.clock.now()
        if run is not None and (run.processed_seq > 0 or run.app != self.app.name):
            # a duplicate start, or one of a run that is not this app's
            return self._activate(env, self._own(env.run_id, run), [lambda st: []])
        name = saga.name
        record = run or RunRecord(env.run_id, self.app.name, name, s.RUNNING, input_json, now, now)

        def started() -> list[NewEvent]:  # in the activation's span: its trace
            data = {"input": input_json, **tracing.run_trace(env.trace)}
            return [] if run is not None else [NewEvent(h.RUN_STARTED, name=name, data=data)]

        return self._gated(env, record, run is None, started, key)

    def _gated(
        self, env: Envelope, record: RunRecord, create: bool, started: Started, key: str
    ) -> Plan:
        """The plan of a start (``started``: the events that start the run; ``create``: it
        does not exist yet) under its saga's concurrency limit, if any: it claims a slot, or
        its run waits for one (recorded as a client records it, its code not started), or
        ends cancelled (``at_limit="cancel_new"``)."""
        at = record.created_at
        slot = concurrency.judge(self.store, self.app, record.saga, env.run_id, key, at)
        if slot is not None and slot.kind == "queue":
            now, began = self.clock.now(), started()
            last = len(began) if create else record.last_seq
            saved = dataclasses.replace(
                record, last_seq=last, reason=slot.describe(), updated_at=now
            )
            base = 0 if create else record.last_seq
            plan = Plan(env, run=saved, base_seq=base, slot=slot, create=create)
            plan.effects = decide.Effects(now, base, events=began)
            self._st.runs[env.run_id] = saved
            return plan
        if slot is not None and slot.kind == "cancel_new":
            cancel = NewEvent(h.CANCEL_REQUESTED, data={"reason": slot.describe()})
            plan = self._activate(env, record, [lambda st: [*started(), cancel]], run_code=False)
        elif slot is not None and slot.kind in ("claim", "take"):  # the code starts now
            claimed = NewEvent(h.SLOT_CLAIMED, data={"key": key, "slot": slot.slot})
            plan = self._activate(env, record, [lambda st: [*started(), claimed]])
            plan.slot = slot
        else:
            plan = self._activate(env, record, [lambda st: started()])
            plan.slot = slot if slot is not None and slot.kind != "held" else None
        plan.create = create
        return plan

    def _on_child_start(self, env: Envelope) -> Plan:
        """Start a child run for the parent's ``ctx.call(saga, ...)``, linked to the parent's
        call; if its run id is taken by another run, fail the parent's call instead."""
        start, pos = ChildStart.parse(env), env.position
        parent_id = start.parent
        saga = self.app.get_saga(env.saga or "")
        if pos is None or saga is None:
            raise MessageError("invalid child_start: needs a known saga, parent and position")
        link = {"run_id": parent_id, "position": pos}
        run = self._st.runs.get(env.run_id) or self.store.get_run(env.run_id)
        if run is None:
            now = self.clock.now()
            value = start.input
            record = RunRecord(env.run_id, self.app.name, saga.name, s.RUNNING, value, now, now)
            data = {"input": value, "parent": link, **tracing.run_trace(env.trace)}
            started = NewEvent(h.RUN_STARTED, name=saga.name, data=data)
            try:
                key = concurrency.key_of(saga, value)
            except ValidationError as e:  # the child fails, saying why; its parent hears it
                fail = [started, *decide.rejected_start_events(str(e))]
                plan = self._activate(env, record, [lambda st: fail], run_code=False)
                plan.create = True
                return plan
            return self._gated(env, record, True, lambda: [started], key)
        first = self.store.load_history(None, run.run_id)[:1]
        if run.app == self.app.name and first and first[0].data.get("parent") == link:
            return self._activate(env, run, [lambda st: []])  # a duplicate: it runs already
        outcome = decide.child_id_taken(env.run_id)
        return self._activate(
            env, self._read_run(parent_id), [lambda st: decide.child_outcome(st, pos, outcome)]
        )

    def _reject_start(self, env: Envelope, run: RunRecord | None, reason: str) -> Plan:
        """A start the engine refuses fails its run with the reason (creating it if no client
        did), unless the run already went further: then it is someone else's run, left alone.
        Either way the message is dead-lettered."""
        if run is not None and (run.processed_seq > 0 or run.app != self.app.name):
            raise MessageError(reason)
        finish = decide.rejected_start_events(reason)
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

    def close(self) -> None:
        """Drop every run held in memory, unwinding its saga code on its own loop (``finally``
        blocks run there, not in the garbage collector): what a stopping process does once
        no thread activates runs any more. The engine can go on after it, from the store."""
        for live in self._cache.values():
            live.drop_code()
        self._cache.clear()
        for st in [*self._stages.open]:
            self.rolled_back(st)

    def committed(self, stage: Stage | None = None) -> None:
        """Keep the runs activated in the transaction that just committed in the cache."""
        st = self._stages.end(stage)
        st.keep(self._cache, self.cache_size)
        runlog.emit(st.logs)
        if st.first_timer is not None and self.on_timers is not None:
            self.on_timers(st.first_timer)

    def rolled_back(self, stage: Stage | None = None) -> None:
        """Forget what the failed transaction's plans did to in-memory state."""
        self._stages.end(stage).drop()

    # --- activation --------------------------------------------------------------------------

    def _activate(
        self, env: Envelope, run: RunRecord, triggers: Sequence[Triggers], *, run_code: bool = True
    ) -> Plan:
        run_id = run.run_id
        plan = Plan(env, base_seq=run.last_seq, stage=self._st)
        began = tracing.now_ns()
        try:
            live = self._load(run, run_code=run_code)
            subscribed = live.state.subscriptions()
            with tracing.activation(env, live.state.trace, run.saga, began) as trace:
                if not live.state.finished or env.type == "undo_run":
                    effects = decide.Effects(self.clock.now(), live.state.last_seq, trace=trace)
                    reacted = False
                    for trigger in triggers:
                        if isinstance(trigger, updates.Arrival):  # judged by the code
                            trigger.code = live.code
                        pending = trigger(live.state)
                        if (
                            pending
                            or run.processed_seq < run.last_seq
                            or live.divergence is not None
                        ):
                            self._react(live, pending, effects)
                            reacted = True
                    if reacted:
                        plan.run = decide.saved_run(run, live.state, now=self.clock.now())
                        plan.effects = effects
                        if (now_subscribed := live.state.subscriptions()) != subscribed:
                            plan.subscriptions = now_subscribed
                        first = run.processed_seq == 0
                        plan.logs = runlog.lines(live.state, effects.events, first=first)
                        if effects.restart is not None:  # the run's state starts again too
                            plan.run = dataclasses.replace(
                                plan.run, status=s.RUNNING, last_seq=1, processed_seq=0, reason=None
                            )
        except BaseException:
            self._st.forget(run_id)
            raise
        if plan.effects is not None and plan.effects.restart is not None:
            drop(self._st.live.pop(run_id, None))  # the next activation replays the fresh history
            self._st.restarted.add(run_id)
        else:
            live.record = plan.run or run  # in the cache once committed
            self._st.live[run_id] = live
        if plan.run is not None:
            self._st.runs[run_id] = plan.run
        return plan

    def _load(self, run: RunRecord, *, run_code: bool = True) -> Live:
        live = self._st.live.get(run.run_id) or self._cache.pop(run.run_id, None)
        if live is not None and live.state.last_seq <= run.last_seq:
            if live.state.last_seq < run.last_seq:  # another engine appended since
                newer = self.store.load_history(None, run.run_id, after_seq=live.state.last_seq)
                newer = [e for e in newer if e.seq <= run.last_seq]  # as of the run row read
                self._catch_up(live, newer, run.processed_seq)
            return live
        drop(live)  # newer than the run row read: this transaction lost a race
        events = self.store.load_history(None, run.run_id) if run.last_seq else []
        events = [e for e in events if e.seq <= run.last_seq]  # as of the run row read
        live = Live(RunState(run.run_id), None)
        for ev in events:
            live.state.apply(ev)
        st = live.state
        if run_code and not (
            st.finished or st.saga_done or st.failing or decide.code_stopped(st.parked)
        ):
            live.code = self._new_code(live, run.saga)
            self._catch_up(live, events, run.processed_seq, fold=False)
        return live

    def _new_code(self, live: Live, saga_name: str) -> Replayer | None:
        saga = self.app.get_saga(saga_name)
        if saga is None:
            return None
        return Replayer(self.app, saga, live.state.run_id, watchdog=self.watchdog)

    def _catch_up(
        self, live: Live, events: list[Event], processed_seq: int, *, fold: bool = True
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
            live.divergence = decide.code_parked(e)

    def _react(self, live: Live, pending: list[NewEvent], effects: decide.Effects) -> None:
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
                            pending.append(NewEvent(h.RUN_PARKED, data=decide.code_parked(e)))
                        else:
                            pending.extend(live.code.take_rejections())
                    elif ev.kind == h.CANCEL_DELIVERED:  # no code to clean up (a queued run)
                        pending.append(cancelling.cancelled_code_events(st, {"cancelled": True})[0])
                    pending.extend(self._effects_of(ev, live, effects))
            pending.extend(self._decide(live))
            if not pending:
                return

    # --- what the engine does next ------------------------------------------------------------

    def _decide(self, live: Live) -> list[NewEvent]:
        st, code = live.state, live.code
        if st.finished or st.parked is not None:
            return []
        if code is None:
            return decide.next_events(self.app, st, code=None)
        commands = code.take_new_commands()  # then its outcome, if it returned
        answered = code.take_rejections()  # updates whose handlers ended as it resumed
        return [*answered, *decide.next_events(self.app, st, code=(commands, code.outcome))]

    def _engine_queue_of(self, run_id: str) -> str:
        """The engine queue of the app that ``run_id`` belongs to (this app's if none does
        yet: its engine dead-letters the message, or it is a run this app starts)."""
        run = self.store.get_run(run_id)
        return engine_queue(run.app) if run is not None else self.queue

    def _effects_of(self, ev: Event, live: Live, effects: decide.Effects) -> list[NewEvent]:
        if ev.kind == h.RUN_RESUMED:
            return self._resume(live, effects)
        now, queue_of = self.clock.now(), self._engine_queue_of
        return decide.effects_of(self.app, live.state, ev, effects, now=now, queue_of=queue_of)

    def _resume(self, live: Live, effects: decide.Effects) -> list[NewEvent]:
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
        return decide.resume_events(st)


DEFAULT_LEASE = timedelta(seconds=60)
DISTRUST = 30.0
"""Seconds an engine reads every run after a plan from its cache met a run moved by another
engine (see :attr:`Engine.trusts_cache`)."""
