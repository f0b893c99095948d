"""A run's timeline for people and scripts: every step with its state, attempts, durations and
idempotency key; the compensations; and the answer to "why is this run not moving?"."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from sagaloop.client.fork import settled_commands
from sagaloop.client.values import clip_json
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO, UNDO, idempotency_key
from sagaloop.engine.history import Event
from sagaloop.engine.ports import RunRecord
from sagaloop.engine.state import RunState
from sagaloop.errors import ErrorInfo
from sagaloop.sagas.approvals import KEY_PREFIX


@dataclasses.dataclass
class StepLine:
    position: int
    step: str
    state: str
    attempts: int
    idempotency_key: str
    queue: str | None
    started_at: datetime
    duration_s: float | None
    worker: str | None
    error: str | None
    compensation: str | None
    compensation_key: str | None
    traceback: str | None = None
    """Where the last error was raised, while it stands (the step did not complete since)."""


@dataclasses.dataclass
class CommandLine:
    """One command the saga code issued, at its position: the one numbering of a run that
    ``status``, ``tail``, ``fork --at``, idempotency keys, approval call ids and the console
    share (positions count every command: calls, waits, sleeps, publishes, approvals)."""

    position: int
    command: str
    """``call``, ``sleep``, ``wait_for_event``, ``approval`` (an approval asked: its call id
    is this position), ``publish``, ``patched``... (``sagaloop export``'s ``command``)."""
    name: str
    """The step, saga, event, timer or key it names, as the history stores it."""
    state: str
    """A step's state (as :attr:`StepLine.state`); a wait's, sleep's or child run's
    ``waiting`` (``sleeping``) or ``ended``; else ``done``."""


@dataclasses.dataclass
class WaitLine:
    """One thing the run waits for, for scripts (``waiting_for`` says it in words)."""

    kind: str
    """``event``, ``approval`` (the answer to ``ctx.approval``: an event too) or ``sleep``."""
    events: list[str]
    """The event names that end it (any one of them); none for a sleep."""
    until: datetime | None
    """When it times out; a sleep: when it ends."""
    prompt: Any = None
    """What it asks (``wait_for_event(..., prompt=...)``); an approval: the request."""


@dataclasses.dataclass
class KeptLine:
    """An event the run received that no wait took yet: kept until one does."""

    name: str
    data: Any
    received_at: datetime


@dataclasses.dataclass
class RefusedLine:
    """An event the run refused, and why (its data did not fit the wait's model, say)."""

    name: str
    reason: str
    position: int | None
    """The wait that refused it; None: refused as it arrived or before its wait began
    (``early="refuse"``), or an answer to no open request."""


@dataclasses.dataclass
class Timeline:
    run_id: str
    saga: str
    status: str
    created_at: datetime
    updated_at: datetime
    steps: list[StepLine]
    waiting_for: list[str]
    output: Any
    error: dict[str, Any] | None
    reason: str | None
    events: int
    published: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The latest value the saga published under each key (``ctx.publish``)."""
    prompts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What each open wait asks, by event name (``wait_for_event(..., prompt=...)``)."""
    waits: list[WaitLine] = dataclasses.field(default_factory=list)
    """The open waits and sleeps of a run that is not finished, in the order they began."""
    cancel_reason: str | None = None
    """Why the run was cancelled, once a cancellation was asked for (``cancel --reason``)."""
    abandoned: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Attempts of this run abandoned past their timeouts whose threads still run, as live
    processes report them (``step``, ``position``, ``attempt``, ``since``, ``process``):
    their outcome is dropped whenever they end."""
    unserved: list[str] = dataclasses.field(default_factory=list)
    """The queues its outstanding steps wait on that no live process consumes (from the
    process registry: ``sagaloop.client.serving``)."""
    no_live_engine: bool = False
    """Whether its app has no live engine (from the process registry)."""
    kept: list[KeptLine] = dataclasses.field(default_factory=list)
    """The events received and not yet taken by a wait, oldest first (a wait that begins
    takes the oldest of its names)."""
    refused: list[RefusedLine] = dataclasses.field(default_factory=list)
    """Every event the run refused, in the order it refused them, with the reason."""
    accepts: list[str] = dataclasses.field(default_factory=list)
    """The event names the saga declared it accepts (``@app.saga(events=...)``), as the run
    recorded them; empty if it declared none (any name)."""
    commands: list[CommandLine] = dataclasses.field(default_factory=list)
    """Every command of the run by position, steps and the rest (``steps`` holds the steps'
    details): a position that ``status`` shows is one ``fork --at`` takes."""

    def to_json(self) -> dict[str, Any]:
        def conv(v: Any) -> Any:
            return v.isoformat() if isinstance(v, datetime) else v

        data = dataclasses.asdict(self)
        data["created_at"], data["updated_at"] = conv(self.created_at), conv(self.updated_at)
        for line in data["steps"]:
            line["started_at"] = conv(line["started_at"])
        for wait in data["waits"]:
            wait["until"] = conv(wait["until"])
        for kept in data["kept"]:
            kept["received_at"] = conv(kept["received_at"])
        return data


def _state_word(x: s.StepState) -> str:
    if x.status == s.DONE:
        return "reconciled" if x.reconciled else "completed"
    if x.status == s.SCHEDULED and x.handed_off == x.attempt:
        return "handed off"
    if x.status == s.SCHEDULED:
        return "in doubt" if x.in_doubt else "scheduled"
    if x.status == s.RETRYING:
        return "retrying"
    if x.status == s.HALTED:
        return "in doubt (halted)" if x.in_doubt else "failed (parked: retry runs it again)"
    return "failed"


def _comp_word(x: s.StepState) -> str | None:
    return {
        None: None,
        s.SCHEDULED: "compensating",
        s.RETRYING: "compensation retrying",
        s.DONE: "compensated",
        s.GAVE_UP: "compensation failed",
    }[x.comp_status]


def timeline(run: RunRecord, events: list[Event], now: datetime) -> Timeline:
    st = RunState(run.run_id)
    for ev in events:
        st.apply(ev)
    queues = {ev.pos: ev.data.get("queue") for ev in events if ev.kind == "step_scheduled"}
    took = {ev.pos: ev.data.get("took_s") for ev in events if ev.kind == "step_completed"}
    lines = []
    for x in sorted(st.steps.values(), key=lambda v: v.pos):
        lines.append(
            StepLine(
                position=x.pos,
                step=x.name,
                state=_state_word(x),
                attempts=len(x.attempts),
                idempotency_key=idempotency_key(run.run_id, x.pos, DO),
                queue=queues.get(x.pos),
                started_at=x.scheduled_at,
                duration_s=_duration(x, took.get(x.pos)),
                worker=next((a.worker for a in reversed(x.attempts) if a.worker), None),
                error=ErrorInfo.from_json(x.error).describe() if x.error else None,
                compensation=_comp_word(x),
                compensation_key=(
                    idempotency_key(run.run_id, x.pos, UNDO) if x.comp_status else None
                ),
                traceback=_traceback(x.error) if x.status != s.DONE else None,
            )
        )
    return Timeline(
        run_id=run.run_id,
        saga=run.saga,
        status=run.status,
        created_at=run.created_at,
        updated_at=run.updated_at,
        steps=lines,
        waiting_for=_why(st, run, queues, now),
        output=run.output,
        error=run.error,
        reason=run.reason,
        events=len(events),
        published=dict(st.published),
        prompts={
            w.name: w.prompt
            for w in sorted(st.waits.values(), key=lambda v: v.pos)
            if not w.resolved and w.prompt is not None and run.status not in s.FINAL_STATUSES
        },
        waits=[] if run.status in s.FINAL_STATUSES else _waits(st),
        cancel_reason=st.cancel_reason or (st.cancelling or {}).get("reason"),
        kept=[] if run.status in s.FINAL_STATUSES else _kept(st),
        refused=[
            RefusedLine(str(ev.name), str(ev.data.get("reason", "")), ev.pos)
            for ev in events
            if ev.kind == h.EVENT_REJECTED
        ],
        accepts=sorted(st.declared or ()),
        commands=_commands(st, events, {line.position: line.state for line in lines}),
    )


def _commands(st: RunState, events: list[Event], steps: dict[int, str]) -> list[CommandLine]:
    """The commands of ``events`` by position, with their state: a step's as ``steps`` says;
    a sleep is open while ``st`` holds it (a timer the code stopped waiting for, or a call's
    timeout once the call ended, has ended), a wait until it is resolved, a child run until
    its outcome is recorded."""
    settled = settled_commands(events) | {w.pos for w in st.waits.values() if w.resolved}
    found: dict[int, CommandLine] = {}
    for ev in events:
        if ev.kind not in h.COMMAND_KINDS or ev.pos is None or ev.pos in found:
            continue
        command, name = h.COMMAND_LABEL.get(ev.kind, ev.kind), str(ev.name or "")
        if name == command:  # a sleep's name
            name = ""
        if ev.kind == h.PUBLISHED and name.startswith(KEY_PREFIX):
            value = ev.data.get("value")
            action = value.get("action") if isinstance(value, dict) else None
            command, name = "approval", str(action or name)
        ended = ev.pos not in st.sleeps if ev.kind == h.TIMER_STARTED else ev.pos in settled
        state = steps.get(ev.pos) or _state(ev.kind, ended)
        found[ev.pos] = CommandLine(ev.pos, command, name, state)
    return [found[pos] for pos in sorted(found)]


def _state(kind: str, settled: bool) -> str:
    """A command's state in a word, a step's aside (:func:`_state_word`)."""
    if kind in (h.EVENT_WAITING, h.TIMER_STARTED, h.CHILD_STARTED):
        return "ended" if settled else ("sleeping" if kind == h.TIMER_STARTED else "waiting")
    return "done"


def _kept(st: RunState) -> list[KeptLine]:
    return [KeptLine(k.name, k.data, k.at) for k in st.buffered]


def _duration(x: s.StepState, took: Any) -> float | None:
    """A completed step's duration: from its scheduling to its result (queue waits and
    retries included); a reconciled step's is its reconciling attempt's (as the worker
    measured it; else since that attempt's dispatch), not the lease a dead worker's message
    waited out before it came back."""
    if x.status != s.DONE or x.completed_at is None:
        return None
    if not x.reconciled:
        return (x.completed_at - x.scheduled_at).total_seconds()
    if isinstance(took, int | float) and not isinstance(took, bool):
        return float(took)
    since = x.attempts[-1].at if x.attempts else x.scheduled_at
    return (x.completed_at - since).total_seconds()


def _waits(st: RunState) -> list[WaitLine]:
    """The open waits and sleeps of ``st``, in the order the saga began them."""
    found: list[tuple[int, WaitLine]] = []
    for w in st.waits.values():
        if not w.resolved:
            names = list(w.names or (w.name,))
            approval = len(names) == 1 and names[0].startswith(KEY_PREFIX)
            kind = "approval" if approval else "event"
            found.append((w.pos, WaitLine(kind, names, w.until, w.prompt)))
    found += [(pos, WaitLine("sleep", [], fire_at)) for pos, fire_at in st.sleeps.items()]
    return [line for _, line in sorted(found, key=lambda x: x[0])]


def _traceback(error: Any) -> str | None:
    trace = error.get("traceback") if isinstance(error, dict) else None
    return str(trace) if trace else None


def _t(when: datetime) -> str:
    return f"{when:%Y-%m-%d %H:%M:%S} UTC"


def _ago(now: datetime, then: datetime) -> str:
    return f"{max((now - then).total_seconds(), 0):.1f} s"


def _why(st: RunState, run: RunRecord, queues: dict[Any, Any], now: datetime) -> list[str]:
    if run.status in s.FINAL_STATUSES:
        return []
    why: list[str] = []
    if run.status == s.NEEDS_ATTENTION:
        why.append(f"needs attention: {run.reason}")
    if run.status == s.CANCELLING and st.cancelling is not None:
        grace_end = datetime.fromisoformat(str(st.cancelling.get("until")))
        why.append(
            f"cancelling ({st.cancelling.get('reason')}): its saga code cleans up until "
            f"{_t(grace_end)}, then the run is cancelled and compensated"
        )
    if run.processed_seq == 0 and run.status == s.RUNNING and run.reason:
        # a concurrency key's queue: "queued behind N runs of key K" (as it last was judged)
        why.append(f"{run.reason}: its code starts once a slot of its concurrency key is free")
    elif run.processed_seq == 0 and run.status == s.RUNNING:
        why.append(
            f"waiting in the start queue for {_ago(now, run.created_at)}: an engine takes up "
            "new runs after the work of the runs in flight, within its start window "
            "(SAGALOOP_START_WINDOW)"
        )
    elif run.processed_seq < run.last_seq:
        why.append("queued for the engine")
    for x in sorted(st.steps.values(), key=lambda v: v.pos):
        if x.status == s.SCHEDULED and x.handed_off == x.attempt and x.beat_at is not None:
            why.append(  # ctx.complete_async(): Client.complete_step / sagaloop complete-step
                f"waiting for step {x.name!r} (attempt {x.attempt}) to be completed from "
                f"outside (task token {x.token}) for {_ago(now, x.beat_at)}"
            )
        elif x.status == s.SCHEDULED:
            since = x.attempts[-1].at if x.attempts else x.scheduled_at
            why.append(
                f"step {x.name!r} (attempt {x.attempt}) queued or running on "
                f"{queues.get(x.pos) or '?'} for {_ago(now, since)}"
            )
        elif x.status == s.RETRYING and x.retry_at:
            error = x.error or {}
            cause = f"{error.get('type')}: {str(error.get('message', ''))[:160]}"
            wait = max((x.retry_at - now).total_seconds(), 0)
            why.append(
                f"step {x.name!r} failing: {cause}; attempt {x.attempt} failed, attempt "
                f"{x.attempt + 1} in {wait:.0f} s (at {_t(x.retry_at)})"
            )
        if x.comp_status == s.SCHEDULED:
            why.append(f"compensation of step {x.name!r} queued or running")
        elif x.comp_status == s.RETRYING and x.comp_retry_at:
            why.append(f"retry of the compensation of {x.name!r} at {_t(x.comp_retry_at)}")
    for w in sorted(st.waits.values(), key=lambda v: v.pos):
        if not w.resolved:
            until = f" until {w.until:%Y-%m-%d %H:%M:%S} UTC" if w.until else ""
            asks = f", asking {short_json(w.prompt)}" if w.prompt is not None else ""
            names = " or ".join(repr(n) for n in (w.names or (w.name,)))
            if w.routed:  # a wait on published events: its key, or its predicate
                names += f" published with key {w.key!r}" if w.key is not None else " (match=)"
            refused = [r for n, r in st.refused if n in (w.names or (w.name,))] + w.rejected
            told = f"; {len(refused)} refused, the last: {refused[-1][:200]}" if refused else ""
            why.append(f"waiting for event {names}{until}{asks}{told}")
    for k in st.buffered:  # received before any wait for it: said, so a typo is seen
        why.append(
            f"event {k.name!r} received at {_t(k.at)}, kept until a wait takes it "
            f"({_kept_why(st, k.name)})"
        )
    for fire_at in st.sleeps.values():
        why.append(f"sleeping until {fire_at:%Y-%m-%d %H:%M:%S} UTC")
    if running := [u for u, answer in st.updates.items() if answer is None]:
        ids = ", ".join(repr(u) for u in running[:5]) + (" and more" if len(running) > 5 else "")
        why.append(f"answering update {ids}: its handler runs (ctx.on_update)")
    return why


def _kept_why(st: RunState, name: str) -> str:
    """Why a received event is not taken yet, in words."""
    if st.declared is not None and name not in st.declared and not name.startswith(KEY_PREFIX):
        return "the saga does not declare it: no wait of it will take it"
    return "no wait for it has begun"


def short_json(value: Any, limit: int = 200) -> str:
    """``value`` as JSON for a line of status, cut at a value's edge with a visible marker
    when longer than ``limit`` (:func:`sagaloop.client.values.clip_json`)."""
    return clip_json(value, limit)
