"""Forking a run (``Client.fork``, ``sagaloop fork``): which part of a history a fork at a
command position keeps. The commands before the cut whose outcome is recorded are kept with
that outcome; the rest is dropped and the saga code as it is now issues it again."""

from __future__ import annotations

from collections.abc import Sequence

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.errors import ValidationError

_OUTCOMES = frozenset(
    {h.STEP_COMPLETED, h.STEP_FAILED, h.CHILD_COMPLETED, h.CHILD_FAILED, h.COMPENSATE_DONE}
)
_ABOUT_A_COMMAND = frozenset(
    {*_OUTCOMES, h.STEP_DISPATCHED, h.STEP_RETRYING, h.STEP_HALTED, h.TIMER_FIRED, h.EVENT_REJECTED}
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
