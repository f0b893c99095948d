"""The state of a run folded from its history: no saga code needed.

The engine uses it to decide what to dispatch, retry and compensate; ``status`` uses it to show
what happened and why a run waits. Folding the same events always gives the same state.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from sagaloop.engine import history as h
from sagaloop.engine.history import Event


class RunStatus(StrEnum):
    """A run's status. A member is its string: it is stored and read back as that string, and
    compares equal to it. The module's constants are its members, typed ``str`` as they
    always were (``RunRecord.status`` is the stored string)."""

    RUNNING = "running"
    WAITING = "waiting"
    COMPENSATING = "compensating"
    COMPLETED = "completed"
    FAILED = "failed"
    COMPENSATED = "compensated"
    CANCELLED = "cancelled"
    NEEDS_ATTENTION = "needs_attention"
    CANCELLING = "cancelling"
    """A cancel was delivered into the saga code, which cleans up within its
    ``cancel_grace``."""


RUNNING: Final[str] = RunStatus.RUNNING
WAITING: Final[str] = RunStatus.WAITING
COMPENSATING: Final[str] = RunStatus.COMPENSATING
COMPLETED: Final[str] = RunStatus.COMPLETED
FAILED: Final[str] = RunStatus.FAILED
COMPENSATED: Final[str] = RunStatus.COMPENSATED
CANCELLED: Final[str] = RunStatus.CANCELLED
NEEDS_ATTENTION: Final[str] = RunStatus.NEEDS_ATTENTION
CANCELLING: Final[str] = RunStatus.CANCELLING
FINAL_STATUSES: frozenset[str] = frozenset({COMPLETED, FAILED, COMPENSATED, CANCELLED})
ALL_STATUSES: tuple[str, ...] = tuple(status.value for status in RunStatus)
"""Plain strings, not members: ``click.Choice`` matches an enum member by its name."""


class StepStatus(StrEnum):
    """The state of a step (also of its compensation), in a run's folded state."""

    SCHEDULED = "scheduled"
    RETRYING = "retrying"
    DONE = "completed"
    GAVE_UP = "failed"
    HALTED = "halted"


SCHEDULED: Final[str] = StepStatus.SCHEDULED
RETRYING: Final[str] = StepStatus.RETRYING
DONE: Final[str] = StepStatus.DONE
GAVE_UP: Final[str] = StepStatus.GAVE_UP
HALTED: Final[str] = StepStatus.HALTED
IN_FLIGHT = frozenset({SCHEDULED, RETRYING})


@dataclasses.dataclass
class Attempt:
    number: int
    at: datetime
    in_doubt: bool
    outcome: str = ""
    error: dict[str, Any] | None = None
    worker: str | None = None
    finished_at: datetime | None = None


@dataclasses.dataclass
class StepState:
    pos: int
    name: str
    args: dict[str, Any]
    scheduled_at: datetime
    status: str = SCHEDULED
    attempt: int = 1
    in_doubt: bool = False
    retry_at: datetime | None = None
    error: dict[str, Any] | None = None
    result: Any = None
    reconciled: bool = False
    completed_seq: int | None = None
    completed_at: datetime | None = None
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    # compensation
    comp_status: str | None = None
    comp_attempt: int = 0
    comp_in_doubt: bool = False
    comp_retry_at: datetime | None = None
    comp_error: dict[str, Any] | None = None
    handed_off: int | None = None
    """The attempt the step's body handed to an outside system (``step_handed_off``), while
    that attempt waits to be completed from outside; None otherwise."""
    token: str | None = None
    """The task token of the handed-off attempt (``StepContext.task_token``)."""
    beat_at: datetime | None = None
    """When the handed-off attempt was handed off or last heartbeated from outside."""
    child: str | None = None
    """The child run's id, when this is a saga awaited as a child run (``ctx.call(saga)``):
    compensating it undoes the child run as a whole."""


@dataclasses.dataclass
class Wait:
    pos: int
    name: str
    since: datetime
    until: datetime | None
    resolved: bool = False
    names: tuple[str, ...] = ()
    """The event names it takes: its name, or those of a ``wait_for_any``."""
    models: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per event name, ``module:qualname`` of the type the wait validates it with (if
    importable): where a client finds it to check an event before sending it."""
    prompt: Any = None
    """What the wait asks (``wait_for_event(..., prompt=...)``), shown while it waits."""
    rejected: list[str] = dataclasses.field(default_factory=list)
    """Why events that reached this wait were refused (their data did not fit)."""
    routed: bool = False
    """A wait on published events (``key=`` or ``match=``): the run is subscribed to its
    ``(name, key)`` while it waits, and ``event_taken`` says which event it took."""
    key: str | None = None
    """The key of a routed wait (None: every key of its names)."""


@dataclasses.dataclass
class Kept:
    """An event received that no wait took yet: kept until one does (in arrival order)."""

    name: str
    data: Any
    at: datetime
    seq: int


@dataclasses.dataclass
class RunState:
    run_id: str
    saga: str = ""
    started_at: datetime | None = None
    last_seq: int = 0
    steps: dict[int, StepState] = dataclasses.field(default_factory=dict)
    sleeps: dict[int, datetime] = dataclasses.field(default_factory=dict)
    waits: dict[int, Wait] = dataclasses.field(default_factory=dict)
    buffered: list[Kept] = dataclasses.field(default_factory=list)
    """The events received and not yet taken by a wait, oldest first."""
    declared: dict[str, str | None] | None = None
    """The events the saga declared it accepts when the run started (``@app.saga(events=)``):
    ``{name: "module:qualname" of its model, or None}``; None if it declared none."""
    _refused_early: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """Why kept events were refused by a wait as it began, by the wait's position: the
    engine records these refusals before the wait itself."""
    refused: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    """``(name, reason)`` of the events refused as they arrived (never given to the code)."""
    markers: list[str] = dataclasses.field(default_factory=list)
    parent: dict[str, Any] | None = None
    """``{"run_id", "position"}`` of the run that awaits this one as a child, if any."""
    children: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
    """Child runs in flight: position -> (run id, saga)."""
    call_timeouts: dict[int, int] = dataclasses.field(default_factory=dict)
    """The timers of ``ctx.call(saga, timeout=...)``: the call's position -> the timer's."""
    started_by: str | None = None
    """The run whose ``ctx.start`` started this one, when its ``run_started`` records it (a
    child run's parent is in ``parent``)."""
    epoch: int = 0
    """How many times the run continued as new before this history."""
    trace: dict[str, str] | None = None
    """The run's W3C trace context, stored in ``run_started`` (see ``tracing``)."""
    forked_at: int = 0
    """For a fork (``Client.fork``), the cut: the steps before it were copied from the source
    run, whose effects they are, so this run never compensates them."""
    undoing: bool = False
    """A completed child run that its parent undoes as a whole."""
    continued: dict[str, Any] | None = None
    """Set when saga code continued as new: the next history's input and first position."""
    undo_requested: int | None = None
    """The position of a ``ctx.compensate`` whose compensations are not all done."""
    published: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The latest value saga code published under each key."""
    subscribed: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """``(name, key)`` of the run's subscriptions to published events (``ctx.subscribe``;
    key ``""``: every key)."""
    routes: bool = False
    """The history has a subscription or a routed wait: from there on, which wait took an
    arrived event is recorded (``event_taken``), not inferred from the names."""
    _flying: set[int] = dataclasses.field(default_factory=set)
    """Positions of the steps in flight (see :meth:`in_flight`): a step's status changes only
    by an event at its position."""
    _taken_early: set[int] = dataclasses.field(default_factory=set)
    """Positions of waits whose ``event_taken`` (of a kept event) came before the wait."""
    cancel_reason: str | None = None
    cancelling: dict[str, Any] | None = None
    """The ``cancel_delivered`` data (``reason``, ``until``, ``steps``) while the saga code
    cleans up after a cancel; kept once the run is cancelled."""
    saga_output: Any = None
    saga_error: dict[str, Any] | None = None
    saga_done: bool = False
    parked: dict[str, Any] | None = None
    finished: str | None = None
    finished_at: datetime | None = None
    updates: dict[str, dict[str, Any] | None] = dataclasses.field(default_factory=dict)
    """``Client.update``: by update id, its answer (``{"result"}``, ``{"error"}``, or
    ``{"error", "refused": True}``), or None while its handler runs; oldest first."""

    def carried_published(self) -> dict[str, Any]:
        """What a run that continues as new carries into its next history's ``run_started``:
        the latest value of each key it published, but an approval's (its wait ended)."""
        from sagaloop.sagas.approvals import call_id_of  # pydantic: not for ``sagaloop --help``

        return {k: v for k, v in self.published.items() if call_id_of(k) is None}

    # --- folding -----------------------------------------------------------------------------

    def apply(self, ev: Event) -> None:
        self._fold(ev)
        pos = ev.pos
        if pos is not None and (st := self.steps.get(pos)) is not None:
            if st.status in IN_FLIGHT:
                self._flying.add(pos)
            else:
                self._flying.discard(pos)

    def _fold(self, ev: Event) -> None:
        self.last_seq = ev.seq
        kind, d = ev.kind, ev.data
        if kind == h.RUN_STARTED:
            self.saga = str(ev.name)
            self.started_at = ev.at
            self.parent = d.get("parent")
            self.started_by = d.get("started_by")
            self.epoch = int(d.get("epoch", 0))
            self.trace = d.get("trace")
            self.published = dict(d.get("published") or {})  # carried by continue_as_new
            self.updates = dict(d.get("updates") or {})  # answers carried too
            self.forked_at = int((d.get("forked_from") or {}).get("position", 0))
            events = d.get("events")
            self.declared = dict(events) if isinstance(events, dict) and events else None
        elif kind == h.STEP_SCHEDULED:
            assert ev.pos is not None and ev.name is not None
            st = StepState(ev.pos, ev.name, d.get("args", {}), ev.at)
            st.attempts.append(Attempt(1, ev.at, False))
            self.steps[ev.pos] = st
        elif kind == h.STEP_DISPATCHED:
            st = self.step(ev)
            st.status, st.attempt, st.in_doubt = SCHEDULED, d["attempt"], d.get("in_doubt", False)
            st.retry_at = None
            st.attempts.append(Attempt(st.attempt, ev.at, st.in_doubt))
        elif kind == h.STEP_RETRYING:
            st = self.step(ev)
            st.status, st.error = RETRYING, d["error"]
            st.retry_at = datetime.fromisoformat(d["retry_at"])
            st.in_doubt = d.get("in_doubt", False)
            self._close_attempt(st, ev, "failed", d["error"])
        elif kind == h.STEP_COMPLETED:
            st = self.step(ev)
            st.status, st.result, st.reconciled = DONE, d.get("result"), d.get("reconciled", False)
            st.completed_seq, st.completed_at = ev.seq, ev.at
            self._close_attempt(st, ev, "reconciled" if st.reconciled else "completed", None)
        elif kind == h.STEP_FAILED:
            st = self.step(ev)
            st.status, st.error = GAVE_UP, d["error"]
            st.in_doubt, st.completed_seq = d.get("in_doubt", False), ev.seq
            self._close_attempt(st, ev, "failed", d["error"])
        elif kind == h.STEP_HALTED:
            st = self.step(ev)
            st.status, st.error, st.completed_seq = HALTED, d["error"], ev.seq
            st.in_doubt = d.get("in_doubt", True)  # parked by a failure: maybe not in doubt
            self._close_attempt(st, ev, "halted", d["error"])
        elif kind == h.STEP_HANDED_OFF:
            st = self.step(ev)
            st.handed_off, st.token, st.beat_at = d["attempt"], d.get("token"), ev.at
        elif kind == h.STEP_HEARTBEAT:
            self.step(ev).beat_at = ev.at
        elif kind == h.TIMER_STARTED:
            assert ev.pos is not None
            self.sleeps[ev.pos] = datetime.fromisoformat(d["fire_at"])
            if isinstance(child := d.get("child"), int):  # ctx.call(saga, timeout=...)
                self.call_timeouts[child] = ev.pos
        elif kind == h.TIMER_CANCELLED:  # the code stopped waiting for it (its row is deleted)
            self.sleeps.pop(ev.pos or 0, None)
        elif kind == h.TIMER_FIRED:
            assert ev.pos is not None
            self.sleeps.pop(ev.pos, None)
            wait = self.waits.get(ev.pos)
            if wait is not None:
                wait.resolved = True
        elif kind == h.EVENT_WAITING:
            assert ev.pos is not None and ev.name is not None
            until = d.get("timeout_at")
            wait = Wait(ev.pos, ev.name, ev.at, datetime.fromisoformat(until) if until else None)
            wait.names = tuple(d.get("names") or [ev.name])
            model = d.get("model")
            wait.models = dict(d.get("models") or ({ev.name: model} if model else {}))
            wait.prompt = d.get("prompt")
            wait.rejected = self._refused_early.pop(ev.pos, [])
            self.waits[ev.pos] = wait
            if d.get("subscribe"):
                wait.routed, wait.key, self.routes = True, d.get("key"), True
            if d.get("early") == "refuse":  # what came before it was refused, not taken
                self.buffered = [k for k in self.buffered if k.name not in wait.names]
            if self.routes:  # what it takes, event_taken says
                wait.resolved = ev.pos in self._taken_early
                self._taken_early.discard(ev.pos)
                return
            for i, kept in enumerate(self.buffered):  # the oldest it takes (misfits are gone)
                if kept.name in wait.names:
                    del self.buffered[i]
                    wait.resolved = True
                    break
        elif kind == h.EVENT_ARRIVED and self.routes:  # kept until event_taken names it
            self.buffered.append(Kept(str(ev.name), d.get("data"), ev.at, ev.seq))
        elif kind == h.EVENT_TAKEN:
            self.buffered = [k for k in self.buffered if k.seq != d.get("seq")]
            if ev.pos is not None and (taken := self.waits.get(ev.pos)) is not None:
                taken.resolved = True
            elif ev.pos is not None:
                self._taken_early.add(ev.pos)
        elif kind == h.SUBSCRIBED:
            self.subscribed.add((str(ev.name), d.get("key") or ""))
            self.routes = True
        elif kind == h.UNSUBSCRIBED:
            self.subscribed.discard((str(ev.name), d.get("key") or ""))
        elif kind == h.EVENT_ARRIVED:
            assert ev.name is not None
            for wait in sorted(self.waits.values(), key=lambda w: w.pos):
                if ev.name in wait.names and not wait.resolved:
                    wait.resolved = True
                    break
            else:
                self.buffered.append(Kept(ev.name, d.get("data"), ev.at, ev.seq))
        elif kind == h.EVENT_REJECTED:
            reason = str(d.get("reason", ""))
            if ev.pos is None:  # refused as it arrived (an answer to no open request, say)
                self.refused.append((str(ev.name), reason))
            elif (wait := self.waits.get(ev.pos)) is not None:  # it reached the open wait
                wait.resolved = False
                wait.rejected.append(reason)
            else:  # a kept event that the wait at ev.pos refused as it began (recorded
                # before the wait): it is consumed, and never ends that wait
                for i, kept in enumerate(self.buffered):
                    if kept.name == ev.name:
                        del self.buffered[i]
                        break
                self._refused_early.setdefault(ev.pos, []).append(reason)
        elif kind in (h.UPDATE_ACCEPTED, h.UPDATE_REFUSED, h.UPDATE_COMPLETED):
            update_id = str(d.get("update_id"))
            self.updates.pop(update_id, None)  # the latest last
            answer = {k: v for k, v in d.items() if k not in ("update_id", "data")}
            self.updates[update_id] = None if kind == h.UPDATE_ACCEPTED else answer
        elif kind == h.EVENTS_DECLARED:
            events = d.get("events")
            self.declared = dict(events) if isinstance(events, dict) and events else None
        elif kind == h.MARKER:
            self.markers.append(str(ev.name))
        elif kind == h.CHILD_STARTED:
            assert ev.pos is not None and ev.name is not None
            self.children[ev.pos] = (str(d["run_id"]), str(ev.name))
            st = StepState(ev.pos, ev.name, {"input": d.get("input")}, ev.at)
            st.child = str(d["run_id"])
            self.steps[ev.pos] = st
        elif kind == h.CHILD_COMPLETED:
            assert ev.pos is not None
            self.children.pop(ev.pos, None)
            self.sleeps.pop(self.call_timeouts.pop(ev.pos, -1), None)  # its timeout is moot
            st = self.step(ev)
            st.status, st.result = DONE, d.get("result")
            st.completed_seq, st.completed_at = ev.seq, ev.at
        elif kind == h.CHILD_FAILED:
            assert ev.pos is not None
            self.children.pop(ev.pos, None)
            self.sleeps.pop(self.call_timeouts.pop(ev.pos, -1), None)
            st = self.step(ev)  # the child undid itself: nothing in doubt here
            st.status, st.error, st.completed_seq = GAVE_UP, d.get("error"), ev.seq
        elif kind == h.UNDO_REQUESTED:
            self.undoing, self.finished, self.finished_at = True, None, None
        elif kind == h.RUN_CONTINUED:
            self.continued = dict(d)
        elif kind == h.COMPENSATE_REQUESTED:
            self.undo_requested = ev.pos
        elif kind == h.COMPENSATE_DONE:
            self.undo_requested = None
        elif kind == h.PUBLISHED:
            self.published[str(ev.name)] = d.get("value")
        elif kind == h.CANCEL_REQUESTED:
            self.cancel_reason = d.get("reason") or "cancelled"
            if not any(x.comp_status == GAVE_UP for x in self.steps.values()):
                self.parked = None  # cancelling is how an operator gives up on a stuck run
        elif kind == h.CANCEL_DELIVERED:
            self.cancelling = dict(d)
        elif kind == h.SAGA_FINISHED:
            self.saga_done = True
            self.saga_output, self.saga_error = d.get("output"), d.get("error")
        elif kind == h.RUN_PARKED:
            self.parked = dict(d)
        elif kind == h.RUN_RESUMED:
            self.parked = None
        elif kind == h.COMPENSATION_SCHEDULED:
            st = self.step(ev)
            st.comp_status, st.comp_attempt = SCHEDULED, d["attempt"]
            st.comp_in_doubt, st.comp_retry_at = d.get("in_doubt", False), None
        elif kind == h.COMPENSATION_RETRYING:
            st = self.step(ev)
            st.comp_status, st.comp_error = RETRYING, d["error"]
            st.comp_in_doubt = d.get("in_doubt", False)
            st.comp_retry_at = datetime.fromisoformat(d["retry_at"])
        elif kind == h.COMPENSATION_COMPLETED:
            self.step(ev).comp_status = DONE
        elif kind == h.COMPENSATION_FAILED:
            st = self.step(ev)
            st.comp_status, st.comp_error = GAVE_UP, d["error"]
        elif kind == h.RUN_FINISHED:
            self.finished, self.finished_at = d["status"], ev.at

    def step(self, ev: Event) -> StepState:
        assert ev.pos is not None
        return self.steps[ev.pos]

    @staticmethod
    def _close_attempt(st: StepState, ev: Event, outcome: str, error: Any) -> None:
        st.handed_off = st.token = st.beat_at = None  # the attempt is over, handed off or not
        if st.attempts and not st.attempts[-1].outcome:
            last = st.attempts[-1]
            last.outcome, last.error, last.finished_at = outcome, error, ev.at
            last.worker = ev.data.get("worker")

    # --- questions ---------------------------------------------------------------------------

    def subscriptions(self) -> frozenset[tuple[str, str]]:
        """The ``(name, key)`` pairs (key ``""``: every key) published events reach this run
        by: its subscriptions and its routed waits still open; none once it finished."""
        if self.finished or self.saga_done:
            return frozenset()
        waits = {
            (name, w.key or "")
            for w in self.waits.values()
            if w.routed and not w.resolved
            for name in w.names
        }
        return frozenset(self.subscribed | waits)

    @property
    def failing(self) -> bool:
        """The run must be undone: the saga raised or a cancellation was asked for."""
        return (
            self.cancel_reason is not None
            or self.undoing
            or (self.saga_done and self.saga_error is not None)
        )

    def abandoned(self, pos: int) -> bool:
        """Whether the step at ``pos`` was in flight when a cancel was delivered into the saga
        code (its await was cancelled): it gets no new attempt, and its heartbeat stops it."""
        return self.cancelling is not None and pos in self.cancelling.get("steps", ())

    def in_flight(self) -> list[StepState]:
        """The steps in flight (scheduled or retrying), by position: read from an index that
        :meth:`apply` keeps, so asking costs nothing per step of a long history (``status``
        asks on every activation)."""
        return [self.steps[pos] for pos in sorted(self._flying)]

    def compensations_in_flight(self) -> list[StepState]:
        return [s for s in self.steps.values() if s.comp_status in IN_FLIGHT]

    def to_compensate(self) -> list[StepState]:
        """Steps not yet compensated that took effect or may have (failed in doubt), newest
        first; none a fork copied from its source run."""
        done = [
            s
            for s in self.steps.values()
            if s.comp_status is None
            and s.pos >= self.forked_at
            and (s.status == DONE or (s.status in (GAVE_UP, HALTED) and s.in_doubt))
        ]
        return sorted(done, key=lambda s: s.completed_seq or 0, reverse=True)

    def status(self) -> str:
        if self.finished:
            return self.finished
        if self.parked is not None:
            return NEEDS_ATTENTION
        if self.failing:
            return COMPENSATING
        if self.cancelling is not None:
            return CANCELLING
        if self.in_flight() or not self.started_at:
            return RUNNING
        return WAITING
