"""What an activation writes after its run's checkpoint (``Engine.apply``): the concurrency slot
a finished run frees, the approvals it indexes, its timers and its subscriptions; and whether a
plan writes none of them (:func:`alone`), so that its checkpoint's statement may be the whole
transaction. The two sit together because they must agree."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import cast

from sagaloop.engine import concurrency, gate
from sagaloop.engine import state as s
from sagaloop.engine.plan import Plan, Stage
from sagaloop.engine.ports import RunRecord, Store, SubscriptionStore, Tx
from sagaloop.sagas.app import App


def alone(app: App, store: Store, plans: Sequence[Plan]) -> bool:
    """Whether ``plans`` are one checkpoint with nothing written after it (one plan; no slot
    freed, approval indexed, timer or subscription changed): ``lone=True``."""
    plan = plans[0] if len(plans) == 1 else None
    if plan is None or plan.run is None or plan.effects is None or not plan.checkpoint_only:
        return False
    run, e = plan.run, plan.effects
    if e.clear_timers or e.timers or e.dropped_timers or any(map(gate.indexed, e.events)):
        return False
    return not frees_slot(app, run) and subscriptions(store, plan) is None


def write(store: Store, app: App, tx: Tx, plan: Plan, stage: Stage, now: datetime) -> None:
    """Write what ``plan`` sets after its run's checkpoint (its run and effects are set); the
    earliest timer set is noted on ``stage``."""
    run, effects = plan.run, plan.effects
    assert run is not None and effects is not None
    if frees_slot(app, run):
        concurrency.release(store, tx, app, run.run_id, now)  # its slot frees
    gate.index_effects(store, tx, run, effects, plan.env, stage.live.get(run.run_id))
    if effects.clear_timers:
        store.delete_timers(tx, run.run_id)
    for timer in effects.timers:
        store.add_timer(tx, timer)
        if stage.first_timer is None or timer.fire_at < stage.first_timer:
            stage.first_timer = timer.fire_at
    for pos in effects.dropped_timers:  # after the adds: a timer may be both in one
        store.delete_timers(tx, run.run_id, pos=pos)
    if (wanted := subscriptions(store, plan)) is not None:  # the store keeps them
        cast(SubscriptionStore, store).set_subscriptions(tx, app.name, run.run_id, wanted)


def frees_slot(app: App, run: RunRecord) -> bool:
    return run.status in s.FINAL_STATUSES and bool(concurrency.limit_of(app, run.saga))


def subscriptions(store: Store, plan: Plan) -> frozenset[tuple[str, str]] | None:
    """What the run's subscriptions are set to (None: nothing, or no store of them)."""
    restart = plan.effects is not None and plan.effects.restart is not None
    wanted = frozenset() if restart else plan.subscriptions
    # the protocol's isinstance costs 8 us, twice a checkpoint: only when there is a change
    return wanted if wanted is not None and isinstance(store, SubscriptionStore) else None
