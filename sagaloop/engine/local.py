"""In-process steps: an app's ``local=True`` steps, run by its engine processes.

A local step's message is an outbox row like any step's, written by the activation that decided
it, but on the app's in-process lane (``local_queue``), which no relay publishes
(``sagaloop.brokers.local``): the process that committed it takes it in memory at once, and
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
"""

from __future__ import annotations

import logging
from typing import Any

from sagaloop.engine.crashpoints import CrashPointRaised, crash_point
from sagaloop.engine.messages import Envelope, step_result
from sagaloop.engine.ports import Delivery
from sagaloop.engine.runtime import WORKER_CONSUMER, EngineConsumer, WorkerConsumer

logger = logging.getLogger(__name__)


class LocalWorker(WorkerConsumer):
    """Runs in-process steps as a worker runs its steps; the reply is stored and applied to the
    run in one transaction with the engine's ``consumer`` (under its lock)."""

    def __init__(self, *args: Any, consumer: EngineConsumer, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer = consumer

    def _store(
        self, delivery: Delivery, env: Envelope, key: str, reply: dict[str, Any] | None
    ) -> None:
        if reply is None or not self._activate(delivery, env, key, reply):
            super()._store(delivery, env, key, reply)

    def _activate(self, delivery: Delivery, env: Envelope, key: str, reply: dict[str, Any]) -> bool:
        """Store ``reply``, activate the run with it and settle the step's message, in one
        transaction; False (nothing written) if that cannot be done."""
        engine = self.consumer.engine
        with self.consumer.lock:
            try:
                # The run as this engine left it (a change by another engine since is found
                # by apply: then the reply takes the usual way).
                plan = engine.prepare(step_result(env, reply, self.clock.now()), trust_cache=True)
                if plan.rejected is not None:
                    raise _NotHere(plan.rejected)
                with self.store.transaction() as tx:
                    if not self.store.inbox_put(tx, WORKER_CONSUMER, key, reply, self.clock.now()):
                        raise _NotHere("a copy of the message stored its reply already")
                    engine.apply(tx, plan, inbox=False)  # the reply's own inbox row is above
                    delivery.settle(tx)
                    undo = env.payload.get("direction") == "undo"
                    crash_point("local.undo_before_commit" if undo else "local.before_commit")
            except CrashPointRaised:
                engine.rolled_back()
                raise
            except Exception as e:
                engine.rolled_back()
                logger.debug(
                    "in-process step %s of run %s: its reply goes to the engine queue (%s)",
                    env.payload.get("step"),
                    env.run_id,
                    e,
                )
                return False
            engine.committed()
        crash_point("local.after_commit")
        return True


class _NotHere(Exception):
    """The reply cannot be applied in the step's own transaction: it is queued instead."""
