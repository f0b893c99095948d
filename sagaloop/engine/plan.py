"""What an activation holds and decides: a run's :class:`Live` state with its suspended saga
code, and the :class:`Plan` that :meth:`~sagaloop.engine.activation.Engine.prepare` builds
outside any transaction and :meth:`~sagaloop.engine.activation.Engine.apply` writes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Collection, Iterator
from datetime import datetime
from typing import Any

from sagaloop.engine import concurrency, decide, runlog
from sagaloop.engine.messages import Envelope, PublishPayload
from sagaloop.engine.ports import RunRecord
from sagaloop.engine.replay import Replayer
from sagaloop.engine.state import RunState
from sagaloop.errors import TransientStoreError


class ActivationConflict(TransientStoreError):
    """The run changed (another engine activated it) between prepare and apply: prepare
    again."""


@dataclasses.dataclass
class Live:
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


def drop(live: Live | None) -> None:
    if live is not None:
        live.drop_code()


@dataclasses.dataclass(eq=False)
class Stage:
    """What the plans of one transaction did to the engine's memory, kept apart until the
    transaction ends (:meth:`Engine.committed` moves it to the cache, :meth:`Engine.rolled_back`
    forgets it). While it is open its runs are its own: another stage's prepare of one of them
    is an ActivationConflict (see :meth:`Engine.holds`)."""

    live: dict[str, Live] = dataclasses.field(default_factory=dict)
    """The runs its plans activated, as they leave them."""
    runs: dict[str, RunRecord] = dataclasses.field(default_factory=dict)
    """The runs' rows as its plans save them."""
    restarted: set[str] = dataclasses.field(default_factory=set)
    """Runs whose history a plan restarts: not activated again before it commits."""
    logs: list[runlog.Line] = dataclasses.field(default_factory=list)
    """The log lines of the plans applied in it (see ``runlog``)."""
    first_timer: datetime | None = None
    """The earliest timer the plans applied in it set."""
    discarded: list[Live] = dataclasses.field(default_factory=list)
    """Runs whose saga code is dropped when the stage ends: saga code, its unwinding too,
    runs only under the engine's lock, and :meth:`Engine.apply` may run without it."""

    def holds(self, run_id: str) -> bool:
        return run_id in self.live or run_id in self.runs or run_id in self.restarted

    def forget(self, run_id: str) -> None:
        """What the stage did to ``run_id`` did not happen (its saga code is discarded)."""
        if (live := self.live.pop(run_id, None)) is not None:
            self.discarded.append(live)
        self.runs.pop(run_id, None)

    def keep(self, cache: collections.OrderedDict[str, Live], size: int) -> None:
        """Its runs go to ``cache`` (least recently used first out, past ``size``)."""
        for run_id, live in self.live.items():
            cache[run_id] = live
            cache.move_to_end(run_id)
        while len(cache) > size:
            drop(cache.popitem(last=False)[1])
        for live in self.discarded:
            live.drop_code()

    def drop(self) -> None:
        for live in [*self.live.values(), *self.discarded]:
            live.drop_code()


class Stages:
    """An engine's open stages: its own one (used when a caller names none) and those of the
    transactions under way (see :meth:`Engine.stage`)."""

    def __init__(self) -> None:
        self.own = self.current = Stage()
        """``current``: the stage :meth:`Engine.prepare` works in."""
        self.open = [self.own]

    def new(self) -> Stage:
        self.open.append(stage := Stage())
        return stage

    def holds(self, run_ids: Collection[str]) -> bool:
        return any(st.holds(run_id) for st in self.open for run_id in run_ids)

    @contextlib.contextmanager
    def working_in(self, stage: Stage | None) -> Iterator[Stage]:
        self.current = stage or self.own
        try:
            yield self.current
        finally:
            self.current = self.own

    def check_free(self, run_id: str) -> None:
        """ActivationConflict if a stage other than the current one holds ``run_id``."""
        if any(st is not self.current and st.holds(run_id) for st in self.open):
            raise ActivationConflict(f"run {run_id!r} is in another open transaction")

    def end(self, stage: Stage | None) -> Stage:
        """``stage`` (None: the engine's own, which starts afresh) is no longer open."""
        st = stage or self.own
        if st in self.open:
            self.open.remove(st)
        if st is self.own:
            self.own = self.current = Stage()
            self.open.append(self.own)
        return st


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
    effects: decide.Effects | None = None
    create: bool = False
    """The run does not exist yet: insert it (a start published without a client)."""
    rejected: str | None = None
    """The message was refused (the run records why); dead-letter it after the commit."""
    logs: list[runlog.Line] = dataclasses.field(default_factory=list)
    """The log lines of the events it appends, written once they are committed."""
    slot: concurrency.Gate | None = None
    """A start under a concurrency limit: the slot it claims or the queue it joins."""
    subscriptions: frozenset[tuple[str, str]] | None = None
    """The run's subscriptions to published events after the activation, when it changed
    them (None: unchanged)."""
    fanout: PublishPayload | None = None
    """A ``publish``: the event :meth:`Engine.apply` delivers to the runs subscribed to it."""
    stage: Stage | None = None
    """The stage it was prepared in (None: the engine's own)."""

    @property
    def checkpoint_only(self) -> bool:
        """Whether the plan's writes up to its run's events are a :class:`Checkpoint` (no
        fan-out, slot or fresh history; an update of the run from ``base_seq``, or its
        creation)."""
        e = self.effects
        special = self.fanout is not None or self.slot is not None
        return not special and e is not None and e.restart is None and e.after_seq == self.base_seq
