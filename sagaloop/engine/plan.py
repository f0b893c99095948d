"""What an activation holds and decides: a run's :class:`Live` state with its suspended saga
code, and the :class:`Plan` that :meth:`~sagaloop.engine.activation.Engine.prepare` builds
outside any transaction and :meth:`~sagaloop.engine.activation.Engine.apply` writes."""

from __future__ import annotations

import dataclasses
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

    @property
    def checkpoint_only(self) -> bool:
        """Whether the plan's writes up to its run's events are a :class:`Checkpoint` (no
        fan-out, slot, creation or fresh history; an update of the run from ``base_seq``)."""
        e = self.effects
        special = self.fanout is not None or self.slot is not None or self.create
        return not special and e is not None and e.restart is None and e.after_seq == self.base_seq
