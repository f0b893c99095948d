"""Run concurrency keys (``@app.saga(concurrency=Concurrency(limit, key, at_limit))``): at most
``limit`` runs of a saga run their code at once per key.

A slot is a row (app, saga, key, slot index) -> run id of the store (``ConcurrencySlots``),
its primary key the guarantee that two engines cannot give one slot to two runs. The engine
judges a start from committed state while it prepares the activation (:func:`judge`), then,
in the activation's transaction, takes the key's lock, judges again from what the transaction
sees and writes the judgement (:func:`enforce`): if the two differ (another engine moved the
key), or the slot's insert writes nothing, the activation conflicts and is prepared again.

* ``claim``: a slot is free and no older run waits for it: the run's code starts in the
  transaction that claims the slot.
* ``queue``: the run is recorded, its code not started; it waits in the key's queue, ordered
  by start time. The transaction that records the end of a slot's holder (or takes a run off
  the queue) frees the slot and sends, through the outbox, a ``start`` message to each run at
  the head of the queue that a free slot awaits (:func:`release`): its activation judges it
  again, and claims.
* ``take`` (``cancel_in_progress``): the new run takes the slot of the key's run in the lowest
  slot, and the same transaction sends that run a cancel.
* ``cancel_new``: the new run ends ``cancelled`` at once, its reason naming the key.

A crash loses no slot and starts no run twice: a slot is claimed in the transaction that
starts the code and freed in the one that records the run's end.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime
from typing import Any, Literal

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.messages import Envelope, engine_queue
from sagaloop.engine.ports import KeySlots, Outgoing, RunRecord, Store, Tx
from sagaloop.sagas.app import App, SagaDef
from sagaloop.sagas.concurrency import Concurrency

NOTED = 100
"""How many runs of a key's queue a release tells their new place (the rest: at their wake)."""
Kind = Literal["claim", "take", "queue", "cancel_new", "held"]


@dataclasses.dataclass(frozen=True)
class Gate:
    """What a start does under its saga's concurrency limit (see the module docstring)."""

    kind: Kind
    app: str
    saga: str
    key: str
    run_id: str
    started_at: datetime
    slot: int = -1
    holder: str | None = None
    """``take``: the run whose slot it takes (it is cancelled)."""
    ahead: int = 0
    """``queue``: the runs it waits behind (holding a slot, or queued before it)."""
    limit: Concurrency | None = None

    def describe(self) -> str:
        """The status words of a queued run, and the reason of a cancelled new one."""
        if self.kind == "cancel_new":
            return (
                f"cancelled at start: concurrency key {self.key!r} of saga {self.saga!r} has "
                'its limit of runs (at_limit="cancel_new")'
            )
        runs = "run" if self.ahead == 1 else "runs"
        return f"queued behind {self.ahead} {runs} of key {self.key!r}"


def _judge(limit: Concurrency, view: KeySlots, run_id: str) -> tuple[Kind, int, str | None, int]:
    if run_id in view.held.values():
        return "held", -1, None, 0
    free = [i for i in range(limit.limit) if i not in view.held]
    free = free[: max(0, limit.limit - len(view.held))]
    waiting = view.waiting
    ahead = waiting.index(run_id) if run_id in waiting else len(waiting)
    if ahead < len(free):
        return "claim", free[ahead], None, 0
    if limit.at_limit == "queue":
        return "queue", -1, None, len(view.held) + ahead
    if limit.at_limit == "cancel_new" or not view.held:
        return "cancel_new", -1, None, 0
    slot = min(view.held)
    return "take", slot, view.held[slot], 0


def limit_of(app: App, saga_name: str) -> Concurrency | None:
    """The concurrency limit of ``app``'s saga ``saga_name``, if it declares one."""
    saga = app.get_saga(saga_name)
    return None if saga is None else saga.concurrency


def key_of(saga: SagaDef[Any, Any], input_json: Any) -> str:
    """The concurrency key of a run of ``saga`` whose input is ``input_json`` (``""`` if the
    saga has no limit). Raises ValidationError for an input or a key the saga refuses."""
    if saga.concurrency is None:
        return ""
    value = saga.input.from_json(input_json, what=f"input of saga {saga.name!r}")
    return saga.concurrency.key_of(value)


def queued(app: App, run: RunRecord) -> bool:
    """Whether ``run``, of a limited saga, has no slot yet: its code has not started (no
    engine processed its history: the activation that claims a slot starts the code), because
    it waits for a slot or its start is not processed yet (an event sent with the start may
    come first). A message to it is recorded without starting its code."""
    return run.processed_seq == 0 and run.status == s.RUNNING and bool(limit_of(app, run.saga))


def judge(
    store: Store, app: App, saga_name: str, run_id: str, key: str, at: datetime
) -> Gate | None:
    """How the start of ``run_id`` (key ``key``, started at ``at``) fares, from committed
    state; None when its saga has no concurrency limit."""
    limit = limit_of(app, saga_name)
    if limit is None:
        return None
    view = store.key_slots(None, app.name, saga_name, key)
    kind, slot, holder, ahead = _judge(limit, view, run_id)
    return Gate(kind, app.name, saga_name, key, run_id, at, slot, holder, ahead, limit)


def enforce(store: Store, tx: Tx, gate: Gate, now: datetime) -> bool:
    """Write ``gate`` in ``tx`` under the key's lock; False (roll back and prepare again) when
    the key moved since it was judged."""
    app, saga, key, run_id, limit = gate.app, gate.saga, gate.key, gate.run_id, gate.limit
    if limit is None:
        return True
    store.lock_key(tx, app, saga, key)
    view = store.key_slots(tx, app, saga, key)
    kind, slot, holder, _ = _judge(limit, view, run_id)
    if kind == "held" or (kind, slot, holder) != (gate.kind, gate.slot, gate.holder):
        return kind == "held" and gate.kind == "held"
    if kind == "claim":
        return store.claim_slot(tx, app, saga, key, slot, run_id, now)
    if kind == "queue":
        store.queue_for_slot(tx, app, saga, key, run_id, gate.started_at)
        return True
    if kind == "take" and holder is not None:
        if not store.move_slot(tx, app, saga, key, slot, holder, run_id):
            return False
        reason = (
            f"cancelled by run {run_id!r}: concurrency key {key!r} of saga {saga!r} "
            'has its limit of runs (at_limit="cancel_in_progress")'
        )
        # now: its code stops where it waits, no cleanup (its slot is the new run's)
        payload = {"reason": reason, "now": True}
        cancel = Envelope(type="cancel", run_id=holder, payload=payload, created_at=now)
        store.enqueue(tx, [Outgoing(engine_queue(app), cancel)], now)
    return True


def release(store: Store, tx: Tx, app: App, run_id: str, now: datetime) -> None:
    """In the transaction that records the end of ``run_id`` (or takes it off its key's
    queue): free its slot and send a ``start`` to each queued run a free slot awaits."""
    found = store.release_slot(tx, run_id)
    if found is None:
        return
    app_name, saga_name, key = found
    saga = app.get_saga(saga_name)
    if saga is None or saga.concurrency is None:
        return
    store.lock_key(tx, app_name, saga_name, key)
    view = store.key_slots(tx, app_name, saga_name, key)
    free = max(0, saga.concurrency.limit - len(view.held))
    wakes = []
    for waiter in view.waiting[:free]:
        first = store.load_history(tx, waiter)[:1]
        if not first or first[0].kind != h.RUN_STARTED:
            continue
        wake = Envelope(
            type="start",
            message_id=f"wake-{uuid.uuid4().hex}",
            run_id=waiter,
            saga=saga_name,
            payload={"input": first[0].data.get("input")},
            created_at=now,
        )
        wakes.append(Outgoing(engine_queue(app_name), wake))
    store.enqueue(tx, wakes, now)
    held, behind = len(view.held), view.waiting[free : free + NOTED]
    gates = [
        Gate("queue", app_name, saga_name, key, w, now, ahead=held + free + i)
        for i, w in enumerate(behind)
    ]
    store.note_waiting(tx, {g.run_id: g.describe() for g in gates})  # status says it
