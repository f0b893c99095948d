"""Forking a run (:meth:`Client.fork <sagaloop.client.client.Client.fork>`, ``sagaloop fork``): a
new run whose history is a copy of another's up to a command position, checked against the saga
code as it is now before anything is written. The commands before the cut whose outcome is
recorded are kept with that outcome (:func:`fork_history`); the rest is dropped and the saga
code as it is now issues it again."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sagaloop import tracing
from sagaloop.client.checks import check_message, check_text
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.messages import Envelope, derived_id, start_queue
from sagaloop.engine.ports import Outgoing, RunRecord, Store
from sagaloop.engine.replay import check_replay
from sagaloop.engine.state import RunState
from sagaloop.errors import (
    ActivationDeadlineError,
    NonDeterminismError,
    RunStateError,
    ValidationError,
)
from sagaloop.sagas.approvals import OPEN_STATUSES, call_id_of

if TYPE_CHECKING:
    from sagaloop.client.client import Client


_OUTCOMES = frozenset(
    {h.STEP_COMPLETED, h.STEP_FAILED, h.CHILD_COMPLETED, h.CHILD_FAILED, h.COMPENSATE_DONE}
)
_ABOUT_A_COMMAND = frozenset(
    {
        *_OUTCOMES,
        h.STEP_DISPATCHED,
        h.STEP_RETRYING,
        h.STEP_HALTED,
        h.TIMER_FIRED,
        h.TIMER_CANCELLED,
        h.EVENT_REJECTED,
        h.EVENT_TAKEN,
    }
)
"""Events about the command at their position: a fork keeps them with it."""
_UNDOING = frozenset(
    {
        h.COMPENSATION_SCHEDULED,
        h.COMPENSATION_RETRYING,
        h.COMPENSATION_COMPLETED,
        h.COMPENSATION_FAILED,
    }
)


def _received(events: Sequence[Event]) -> tuple[dict[int, int], set[int]]:
    """Which wait took each arrived event (its seq -> the wait's position), as replay gives
    them out: to the open wait issued first that takes its name, else kept for the next wait
    that does; and the positions of the waits that ended (an event they accepted, a timeout)."""
    waits: dict[int, tuple[str, ...]] = {}
    ended: set[int] = set()
    early: list[tuple[int, str]] = []
    took: dict[int, int] = {}
    for ev in events:
        if ev.kind == h.EVENT_WAITING and ev.pos is not None:
            names = tuple(ev.data.get("names") or [ev.name])
            waits[ev.pos] = names
            i = next((i for i, (_, name) in enumerate(early) if name in names), None)
            if i is not None:
                took[early.pop(i)[0]] = ev.pos
                ended.add(ev.pos)
        elif ev.kind == h.EVENT_ARRIVED:
            open_waits = (p for p in sorted(waits) if p not in ended and ev.name in waits[p])
            pos = next(open_waits, None)
            if pos is None:
                early.append((ev.seq, str(ev.name)))
            else:
                took[ev.seq] = pos
                ended.add(pos)
        elif ev.kind == h.EVENT_REJECTED and ev.pos is not None:
            ended.discard(ev.pos)  # the data did not fit: the wait goes on
        elif ev.kind == h.TIMER_FIRED and ev.pos in waits:
            ended.add(ev.pos)
    return took, ended


def settled_commands(events: Sequence[Event]) -> set[int]:
    """The positions of the commands whose outcome ``events`` records: a step or child run
    that completed or failed for good, a sleep that ended, a wait that received its event or
    timed out, a ``ctx.compensate`` done, and the commands complete once issued (``patched``,
    ``publish``, ``send_event``, ``start``). The others are outstanding."""
    kinds = {e.pos: e.kind for e in events if e.kind in h.COMMAND_KINDS and e.pos is not None}
    settled = {pos for pos, kind in kinds.items() if kind in h.INSTANT_KINDS}
    settled |= _received(events)[1]
    for ev in events:
        if ev.pos is not None and (
            ev.kind in _OUTCOMES
            or (ev.kind == h.TIMER_FIRED and kinds.get(ev.pos) == h.TIMER_STARTED)
        ):
            settled.add(ev.pos)
    return settled & set(kinds)


def fork_history(events: Sequence[Event], at: int, *, run_id: str = "") -> list[Event]:
    """The events of ``events`` that a fork at command position ``at`` keeps, in their order:
    ``run_started``; each command at a position before ``at`` whose outcome is recorded (see
    :func:`settled_commands`) with what happened to it (attempts, its result, the event a wait
    received, the compensations a ``ctx.compensate`` made). Dropped: the commands at ``at`` and
    after, those still outstanding, events no wait kept took, and what concerns the run as a
    whole (cancellation, parking, its end). ValidationError for a position outside the
    history: ``at`` may be the position after the last command (to keep them all)."""
    events = sorted(events, key=lambda e: e.seq)
    if not events or events[0].kind != h.RUN_STARTED:
        raise ValidationError(f"the history of run {run_id!r} does not begin with run_started")
    first = int(events[0].data.get("first_pos", 0))
    commands = [e for e in events if e.kind in h.COMMAND_KINDS and e.pos is not None]
    end = max((e.pos for e in commands if e.pos is not None), default=first - 1) + 1
    if not first <= at <= end:
        span = f"positions {first} to {end - 1}" if end > first else "no command yet"
        raise ValidationError(
            f"position {at} is outside the history of run {run_id!r}, which holds {span}: "
            f"fork at {first} to {end} (`sagaloop export` lists its commands)"
        )
    took = _received(events)[0]
    kept = {pos for pos in settled_commands(events) if pos < at}
    undone = {e.pos: e.seq for e in events if e.kind == h.COMPENSATE_DONE}
    windows = [
        (e.seq, undone[e.pos])
        for e in commands
        if e.kind == h.COMPENSATE_REQUESTED and e.pos in kept and e.pos in undone
    ]
    out = [events[0]]
    for ev in events[1:]:
        if ev.kind == h.EVENT_ARRIVED:
            keep = took.get(ev.seq) in kept
        elif ev.kind in h.COMMAND_KINDS or ev.kind in _ABOUT_A_COMMAND:
            keep = ev.pos in kept
        elif ev.kind in _UNDOING:
            keep = any(a < ev.seq < b for a, b in windows)
        else:
            keep = False
        if keep:
            out.append(ev)
    return out


def fork_run(client: Client, source: str, at: int, run_id: str | None) -> str:
    """What :meth:`Client.fork <sagaloop.client.client.Client.fork>` does (see there)."""
    if client.app is None:
        raise ValidationError("Client(store, app) needs the App to fork runs")
    old = client.get(source)
    saga = client.app.get_saga(old.saga) if old.app == client.app.name else None
    if saga is None:
        raise RunStateError(
            f"run {source!r} is a run of saga {old.saga!r} of app {old.app!r}, which app "
            f"{client.app.name!r} does not declare: fork it with the app that does"
        )
    if isinstance(at, bool) or not isinstance(at, int):
        raise ValidationError(f"a position is a whole number, not {at!r:.60}")
    kept = fork_history(client.store.load_history(None, source), at, run_id=source)
    new_id = check_text(uuid.uuid4().hex if run_id is None else run_id, "run_id")
    if new_id == source:
        raise RunStateError(f"a fork is a new run: give it another id than {source!r}")
    link = {"run_id": source, "position": at}
    first_pos = kept[0].data.get("first_pos")
    input_json = kept[0].data.get("input")
    now = client.clock.now()
    shift = now - kept[-1].at  # the cut is now: timers issued after it count from now
    with tracing.start(new_id, saga.name) as trace:
        data = {
            "input": input_json,
            "forked_from": link,
            **({"first_pos": first_pos} if first_pos else {}),
            **({"trace": trace} if trace else {}),
            **({"events": accepts} if (accepts := saga.recorded_events()) else {}),
        }
        events = [
            Event(seq, e.kind, e.at + shift, e.pos, e.name, data if seq == 1 else e.data)
            for seq, e in enumerate(kept, start=1)
        ]
        try:  # a fork the code as it is now cannot continue would park at once
            check_replay(client.app, saga, new_id, events, whole=False)
        except (NonDeterminismError, ActivationDeadlineError) as e:
            divergence = e.divergence if isinstance(e, NonDeterminismError) else str(e)
            reason = divergence.removeprefix(f"run {new_id!r}: ")
            raise ValidationError(
                f"cannot fork run {source!r} at position {at}: the saga code does not "
                f"replay what the fork keeps ({reason}); fork at an earlier position"
            ) from e
        env = Envelope(
            type="start",
            message_id=derived_id("start", new_id),
            run_id=new_id,
            saga=saga.name,
            payload={"input": input_json},
            created_at=now,
            trace=trace,
        )
        check_message(env)
        record = RunRecord(new_id, client.app.name, saga.name, s.RUNNING, input_json, now, now)
        # Processed but the last event: the engine's activation replays the copy (the saga's
        # logger silent), gives the code that last event, and records what it does next.
        # The engine expects no command among the events it has not processed: if the last
        # is one, the whole copy is given as new (the saga's log lines said again).
        record.last_seq = len(events)
        record.processed_seq = 0 if events[-1].kind in h.COMMAND_KINDS else len(events) - 1
        with client.store.transaction() as tx:
            if not client.store.create_run(tx, record):
                first = client.store.load_history(tx, new_id)[:1]
                if first and first[0].data.get("forked_from") == link:
                    return new_id  # this very fork, made already
                raise RunStateError(f"run id {new_id!r} is taken: choose another run id")
            after = 0
            for when, group in itertools.groupby(events, key=lambda e: e.at):
                batch = [NewEvent(e.kind, e.pos, e.name, e.data) for e in group]
                after = client.store.append_events(tx, new_id, after, batch, when)[-1].seq
            _index_open_approvals(client.store, tx, record, events, now)
            client.store.enqueue(tx, [Outgoing(start_queue(client.app.name), env)], now)
    return new_id


def _index_open_approvals(
    store: Store, tx: Any, run: RunRecord, events: list[Event], now: Any
) -> None:
    """Index the approvals a fork's copied history leaves open, as the engine indexes
    those it records: the fork's own requests, answered with its own request ids."""
    state = RunState(run.run_id)
    for event in events:
        state.apply(event)
    for key, value in state.published.items():
        call_id = call_id_of(key)
        if call_id and isinstance(value, dict) and value.get("status") in OPEN_STATUSES:
            store.publish_approval(tx, run, call_id, value, now=now)
