"""The engine consumer: runs activations, a batch of messages to one commit. The processing
loops are split by role: this one, the worker consumer (``worker``) and the timer scheduler
(``timers``), over what they share (``delivery``); ``sagaloop.runtime.service`` runs them on
threads. Their names are importable from here too.

Every loop settles a message in the transaction that processed it and acknowledges it only after
the commit, so a process killed at any instant loses nothing: what was not committed is
delivered again, and what was committed is never applied twice (inbox).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Sequence

from sagaloop.engine.activation import ENGINE_CONSUMER, ActivationConflict, Engine
from sagaloop.engine.messages import Envelope, inbox_key, start_queue
from sagaloop.engine.plan import Plan, Stage
from sagaloop.engine.ports import Delivery, Store, Tx
from sagaloop.errors import (
    BrokerError,
    ErrorInfo,
    MessageError,
    RunNotStartedError,
    TransientStoreError,
)
from sagaloop.runtime.admission import StartGate
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.runtime.delivery import MAX_FAILURES as MAX_FAILURES
from sagaloop.runtime.delivery import NOT_STARTED_TRIES as NOT_STARTED_TRIES
from sagaloop.runtime.delivery import RETRY_DELAY as RETRY_DELAY
from sagaloop.runtime.delivery import Troubles
from sagaloop.runtime.delivery import decode as decode
from sagaloop.runtime.delivery import log_failure as log_failure
from sagaloop.runtime.delivery import run_extra as run_extra
from sagaloop.runtime.timers import TimerScheduler as TimerScheduler
from sagaloop.runtime.worker import LATE_WAKES as LATE_WAKES
from sagaloop.runtime.worker import MAX_GIVE_BACK as MAX_GIVE_BACK
from sagaloop.runtime.worker import RATE_WAIT as RATE_WAIT
from sagaloop.runtime.worker import STARTED as STARTED
from sagaloop.runtime.worker import WORKER_CONSUMER as WORKER_CONSUMER
from sagaloop.runtime.worker import WorkerConsumer as WorkerConsumer

logger = logging.getLogger(__name__)

CONFLICT_RETRIES = 5


class EngineConsumer:
    """Runs activations: the saga code of a batch of messages outside any transaction
    (:meth:`Engine.prepare`), then one transaction that writes them all (:meth:`Engine.apply`),
    then the acks.

    No message spins: one that fails the same way ``max_failures`` times (counting its
    earlier deliveries) parks its run in ``needs_attention`` with the error, keeping the
    message for ``sagaloop retry``, and is acknowledged. Only an unavailable database is
    retried for ever."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        *,
        max_failures: int = MAX_FAILURES,
        gate: StartGate | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.queue = engine.queue
        self.start_queue = start_queue(engine.app.name)
        self.gate = gate or StartGate(store, engine.app.name)
        """Takes up new runs after the work of runs in flight (see ``admission.py``)."""
        self.max_failures = max_failures
        self._troubles = Troubles()
        self.lock = threading.Condition()
        """Held while the engine prepares and while a transaction's stage ends: its threads and
        the in-process steps' (see ``local.py``) share one :class:`Engine`, which is not
        thread-safe. A transaction's own writes run without it (:meth:`prepared`)."""

    def process_batch(self, deliveries: Sequence[Delivery], *, starts: bool = False) -> None:
        """Process the messages in one transaction (one commit for the batch), then ack them.
        ``starts``: a batch of the start queue, which waits its turn (see ``admission.py``)
        rather than delaying the batches of the engine queue.

        They are activated in order of run id (stable, so a run's messages keep their order),
        so that two engines lock the runs of their batches in the same order and never
        deadlock. If any of them fails, the whole transaction is rolled back and they are
        processed one at a time, so that a bad message costs only itself. Decoding (which may
        read large payloads back) happens before the engine's lock is taken."""
        with contextlib.nullcontext() if starts else self.gate.first():
            batch = [(d, env) for d in deliveries if (env := decode(d, self.store)) is not None]
            self._activate_batch(batch)

    def process(self, delivery: Delivery) -> None:
        with self.gate.first():
            env = decode(delivery, self.store)
            if env is not None:
                self._process(delivery, env)

    def prepared(
        self, run_ids: Collection[str], prepare: Callable[[Stage], list[Plan]]
    ) -> tuple[Stage, list[Plan]]:
        """Under :attr:`lock`: once no open transaction of this engine holds any of
        ``run_ids``, ``prepare`` plans in a stage of their own (ended if it raises). Write them
        in :meth:`transaction`, without the lock: the next plans are prepared meanwhile."""
        self.lock.wait_for(lambda: not self.engine.holds(run_ids))
        stage = self.engine.stage()
        try:
            return stage, prepare(stage)
        except BaseException:
            self._end(stage, committed=False)
            raise

    @contextlib.contextmanager
    def transaction(self, stage: Stage, plans: Sequence[Plan]) -> Iterator[Tx]:
        """The transaction that writes the plans of ``stage``; their stage ends with it."""
        try:
            # a plan written as its checkpoint alone: that statement may be the commit, so the
            # caller's crash points come before any write
            with self.store.transaction(lone=self.engine.alone(plans)) as tx:
                yield tx
        except BaseException:
            self._end(stage, committed=False)
            raise
        self._end(stage, committed=True)

    def _end(self, stage: Stage, *, committed: bool) -> None:
        with self.lock:
            if committed:
                self.engine.committed(stage)
            else:
                self.engine.rolled_back(stage)
            self.lock.notify_all()

    def _activate_batch(self, batch: list[tuple[Delivery, Envelope]]) -> None:
        if len(batch) > 1:
            batch.sort(key=lambda pair: pair[1].run_id)
            try:
                plans = self._commit(batch)
            except Exception as e:
                logger.debug("a batch of %d failed (%s); one message at a time", len(batch), e)
            else:
                for (delivery, _), plan in zip(batch, plans, strict=True):
                    _finish(delivery, plan)
                return
        for delivery, env in batch:
            self._process(delivery, env)

    def _commit(
        self,
        batch: Sequence[tuple[Delivery, Envelope]],
        *,
        trust_cache: bool = True,
        seen: bool = False,
    ) -> list[Plan]:
        """Prepare and apply the batch in one transaction. ``trust_cache``: runs this engine
        activated last are not read again (a change by another engine since is an
        ActivationConflict, and the retry reads them). ``seen``: the inbox has the batch's one
        message already: it is settled as the duplicate it is, not prepared."""
        envs = [env for _, env in batch]

        def prepare(stage: Stage) -> list[Plan]:
            if seen:
                return [Plan(env, stage=stage) for env in envs]
            return [self.engine.prepare(e, trust_cache=trust_cache, stage=stage) for e in envs]

        with self.lock:
            stage, plans = self.prepared({env.run_id for env in envs}, prepare)
        with self.transaction(stage, plans) as tx:
            crash_point("engine.before_commit")
            for (delivery, _), plan in zip(batch, plans, strict=True):
                if plan.rejected is None:  # first: the checkpoint's statement carries it
                    delivery.settle(tx)
                self.engine.apply(tx, plan)
                if plan.fanout is not None:
                    crash_point("engine.fanout_before_commit")
        crash_point("engine.after_commit")
        return plans

    def _process(self, delivery: Delivery, env: Envelope) -> None:
        for tries in range(CONFLICT_RETRIES):
            try:  # prepared again: a duplicate whose activation was not written is settled
                seen = tries > 0 and self._processed(env)
                plans = self._commit([(delivery, env)], trust_cache=tries == 0, seen=seen)
            except ActivationConflict as e:
                logger.debug("%s; preparing again", e)
                continue
            except RunNotStartedError as e:
                _not_started(delivery, e)
            except MessageError as e:
                delivery.dead_letter(e.reason)
            except BrokerError as e:  # the lease was lost: another consumer owns the message now
                logger.warning("%s", e)
            except TransientStoreError as e:
                self._troubles.transient(env.message_id)
                what = f"engine failed on message {env.message_id} (run {env.run_id})"
                log_failure(what, e, run_extra(env))
                delivery.retry_later(RETRY_DELAY)
            except Exception as e:
                self._failed(delivery, env, e)
            else:
                self._troubles.forget(env.message_id)
                _finish(delivery, plans[0])
            return
        delivery.retry_later(RETRY_DELAY)  # other engines kept changing the run

    def _processed(self, env: Envelope) -> bool:
        """Whether the inbox has ``env`` already (asked only when preparing it again)."""
        key = inbox_key(self.engine.app.name, env)
        return bool(self.store.inbox_get(None, ENGINE_CONSUMER, key)[0])

    def _failed(self, delivery: Delivery, env: Envelope, exc: Exception) -> None:
        """A failure that is no outage: retry it a few times, then park the run on it."""
        what = f"engine failed on message {env.message_id} (run {env.run_id})"
        failures = self._troubles.give_up(
            env.message_id, delivery, what, exc, self.max_failures, run_extra(env)
        )
        if failures is None:
            return
        logger.error(
            "%s %d times: parking the run", what, failures, exc_info=exc, extra=run_extra(env)
        )
        error = ErrorInfo.from_exception(exc, with_traceback=True)

        def park(stage: Stage) -> list[Plan]:
            return [self.engine.park(env, error, failures, stage=stage)]

        try:
            with self.lock:
                stage, plans = self.prepared([env.run_id], park)
            with self.transaction(stage, plans) as tx:
                delivery.settle(tx)  # first: the checkpoint's statement carries it
                self.engine.apply(tx, plans[0])
        except MessageError as e:
            delivery.dead_letter(e.reason)
        except BrokerError as e:
            logger.warning("%s", e)
        except Exception as e:
            log_failure(f"could not park run {env.run_id}", e, run_extra(env))
            delivery.retry_later(RETRY_DELAY)
        else:
            self._troubles.forget(env.message_id)
            delivery.ack()


def _not_started(delivery: Delivery, e: RunNotStartedError) -> None:
    """A message for a run that does not exist: sagaloop's own is handed back until its run's
    start (which may come after it) has been processed, ``NOT_STARTED_TRIES`` deliveries in
    all; one from outside sagaloop's processes is dead-lettered at once."""
    if not delivery.trusted:
        delivery.dead_letter(e.reason)
    elif delivery.deliveries < NOT_STARTED_TRIES:
        logger.debug("%s; handed back: its start may come after it", e)
        delivery.retry_later(RETRY_DELAY)
    else:
        delivery.dead_letter(f"{e.reason} (after {delivery.deliveries} deliveries)")


def _finish(delivery: Delivery, plan: Plan) -> None:
    """After the commit: acknowledge, or dead-letter a message the run recorded as refused."""
    if plan.rejected is None:
        delivery.ack()
    else:
        delivery.dead_letter(plan.rejected)
