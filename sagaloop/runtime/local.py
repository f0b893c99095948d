"""In-process steps: an app's ``local=True`` steps, run by its engine processes.

A local step's message is an outbox row like any step's, written by the activation that decided
it, but on the app's in-process lane (``local_queue``), which no relay publishes
(``sagaloop.runtime.lane``): the process that committed it takes it in memory at once, and
every engine process of the app takes from the database the lane's rows nobody holds (those of
an engine that died, once their claim ran out).

The step runs in a :class:`LocalWorker`, a worker consumer, so every rule of a remote step holds
unchanged (the inbox, the start marker of a guarded step, in doubt, reconcile, retries,
timeouts, heartbeats, rate limits). What differs is where its reply goes: the transaction that
stores the reply also activates the run with it (:meth:`Engine.prepare` and
:meth:`Engine.apply`) and deletes the step's row, so a step costs one commit and no broker
hop. If that transaction cannot be made (the run changed under another engine, the database
refused it), the reply goes the usual way: queued to the engine, whose consumer handles every
case.

The step's row is settled before the plan is applied: the store keeps the delete on the
transaction and makes it in the checkpoint's own statement (on PostgreSQL, see
``sagaloop.store.checkpoint``), or, when no such statement follows (SQLite, a plan written by
separate calls), just before the commit. Either way a lost lease raises LeaseLostError inside
the transaction, as ``settle`` raised it before, and nothing of the attempt commits. A reply
whose plan is its checkpoint alone (``Engine.alone``: the next step's message, no timer or
approval) is applied in a lone transaction: on PostgreSQL that statement is the whole
transaction, with no ``BEGIN`` or ``COMMIT``, and it commits nothing when its lease was lost.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from sagaloop.engine.contract import UNDO
from sagaloop.engine.messages import Envelope, StepReply, StepTask, step_result
from sagaloop.engine.plan import Plan, Stage
from sagaloop.engine.ports import Delivery
from sagaloop.runtime.consumers import EngineConsumer
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.runtime.worker import WORKER_CONSUMER, WorkerConsumer

logger = logging.getLogger(__name__)


class LocalWorker(WorkerConsumer):
    """Runs in-process steps as a worker runs its steps; the reply is stored and applied to the
    run in one transaction with the engine's ``consumer``: prepared under its lock, written
    without it (``EngineConsumer.prepared``), so one group's transaction overlaps the next
    group's saga code.

    Group commit: replies that are ready while another thread holds the engine's lock, or while
    their run's transaction is open, wait for it, and the thread that takes it next
    checkpoints all of them whose runs are free in one transaction (in order of run id, as the
    engine's batches). If that transaction fails, each is tried alone, so a bad one costs only
    itself."""

    def __init__(self, *args: Any, consumer: EngineConsumer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer = consumer
        self._ready: list[_Checkpoint] = []
        self._ready_lock = threading.Lock()

    def _store(
        self, delivery: Delivery, env: Envelope, task: StepTask, key: str, reply: StepReply | None
    ) -> None:
        if reply is None or not self._checkpoint(_Checkpoint(delivery, env, task, key, reply)):
            super()._store(delivery, env, task, key, reply)

    def _checkpoint(self, mine: _Checkpoint) -> bool:
        """Checkpoint ``mine``, with whatever else is ready; True once it is committed, False
        (nothing of it written) if it cannot be done here."""
        with self._ready_lock:
            self._ready.append(mine)
        with self.consumer.gate.first():
            group: list[_Checkpoint] = []
            first: _Prepared | Exception | None = None
            try:
                with self.consumer.lock:
                    group = self._take(mine)
                    try:
                        first = self._prepared(group) if group else None
                    except Exception as e:
                        first = e
                if first is not None:
                    self._commit_group(group, first)
            finally:
                for one in group:  # a thread that raised (a crash point) leaves no one waiting
                    if one.done is None:
                        one.done = False
                    one.finished.set()
        mine.finished.wait()
        if mine.done:
            crash_point("local.after_commit")
        return bool(mine.done)

    def _take(self, mine: _Checkpoint) -> list[_Checkpoint]:
        """Under the engine's lock, once ``mine`` is taken or its run is in no open
        transaction: the ready replies whose runs are in none (the others stay ready), in order
        of run id. Replies of one run that came while its transaction was open are then one
        group (a fan-out's), not one transaction each."""
        engine = self.consumer.engine

        def free(c: _Checkpoint) -> bool:
            return not engine.holds([c.env.run_id])

        def taken() -> bool:
            with self._ready_lock:
                return mine not in self._ready

        self.consumer.lock.wait_for(lambda: taken() or free(mine))
        group: list[_Checkpoint] = []
        with self._ready_lock:
            ready, self._ready = self._ready, []
            for c in ready:
                (group if free(c) else self._ready).append(c)
        return sorted(group, key=lambda c: c.env.run_id)

    def _commit_group(self, group: list[_Checkpoint], first: _Prepared | Exception) -> None:
        """All in one transaction (``first``: its plans, or why they could not be made), else
        one at a time."""
        if not isinstance(first, Exception):
            try:
                self._transaction(group, first)
            except Exception as e:
                first = e
            else:
                return
        if len(group) == 1:
            return _not_here(group[0], first)
        logger.debug("a checkpoint of %d failed (%s); one at a time", len(group), first)
        for one in group:
            try:
                with self.consumer.lock:
                    prepared = self._prepared([one])
                self._transaction([one], prepared)
            except Exception as e:
                _not_here(one, e)

    def _prepared(self, group: list[_Checkpoint]) -> _Prepared:
        """Under the engine's lock: the plans of the replies (the runs as this engine left
        them; a change by another engine since is found by apply: then the reply takes the
        usual way)."""
        now, engine = self.clock.now(), self.consumer.engine

        def prepare(stage: Stage) -> list[Plan]:
            replies = [step_result(c.env, c.reply, now) for c in group]
            return [engine.prepare(r, trust_cache=True, stage=stage) for r in replies]

        return self.consumer.prepared({c.env.run_id for c in group}, prepare)

    def _transaction(self, group: list[_Checkpoint], prepared: _Prepared) -> None:
        """Store the replies, activate their runs and settle their messages, in one
        transaction (each sets ``done``), or raise with nothing written."""
        stage, plans = prepared
        with self.consumer.transaction(stage, plans) as tx:
            for c, plan in zip(group, plans, strict=True):
                if plan.rejected is not None:
                    raise _NotHere(plan.rejected)
                undo = c.task.direction == UNDO
                crash_point("local.undo_before_commit" if undo else "local.before_commit")
                # settled first: the store deletes the step's row with the plan's writes (one
                # statement on PostgreSQL), else before the commit; either way a lost lease
                # raises and nothing commits
                c.delivery.settle(tx)
                # the reply's inbox row is written with the plan (ActivationConflict if a copy
                # of the message stored its reply already)
                reply = (WORKER_CONSUMER, c.key, c.reply.to_payload())
                self.consumer.engine.apply(tx, plan, inbox=False, reply=reply)
        for c in group:
            c.done = True
            c.finished.set()


_Prepared = tuple[Stage, list[Plan]]


def _not_here(one: _Checkpoint, e: Exception) -> None:
    one.done = False
    logger.debug(
        "in-process step %s of run %s: its reply goes to the engine queue (%s)",
        one.task.step,
        one.env.run_id,
        e,
    )


@dataclasses.dataclass(eq=False)
class _Checkpoint:
    """An in-process step's reply, waiting to be checkpointed."""

    delivery: Delivery
    env: Envelope
    task: StepTask
    key: str
    reply: StepReply
    done: bool | None = None
    """True, committed; False, to be queued instead (set before ``finished``)."""
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)


class _NotHere(Exception):
    """The reply cannot be applied in the step's own transaction: it is queued instead."""
