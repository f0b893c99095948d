"""The worker consumer: runs step attempts, one message at a time, and answers the engine
with the reply stored in the inbox row of the message (see :class:`WorkerConsumer`); with it,
what it needs to run one: the leases it renews while steps run, the heartbeat a step calls, and
the start slots of rate-limited steps. ``sagaloop.runtime.service`` runs it on threads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.contract import DO, UNDO, UNENCODABLE_RESULT
from sagaloop.engine.messages import (
    Envelope,
    Outcome,
    StepReply,
    StepTask,
    engine_queue,
    inbox_key,
    step_result,
)
from sagaloop.engine.ports import Checkpoint, Clock, Delivery, HeldSlot, Outgoing, Store, Written
from sagaloop.errors import (
    BrokerError,
    ErrorInfo,
    MessageError,
    SagaloopError,
    StepCancelled,
    StoreError,
    TransientStoreError,
    UnencodableError,
    UnknownStepError,
)
from sagaloop.runtime.crashpoints import crash_point
from sagaloop.runtime.delivery import (
    MAX_FAILURES,
    RETRY_DELAY,
    Troubles,
    decode,
    log_failure,
    run_extra,
)
from sagaloop.runtime.steps import AttemptNotStarted, StepRunner
from sagaloop.sagas.app import App
from sagaloop.sagas.convert import encode_value
from sagaloop.sagas.policy import RateLimit

# The name these lines had before the consumers were split: logs and their filters do not change.
logger = logging.getLogger("sagaloop.runtime.consumers")

WORKER_CONSUMER = "worker"
STARTED = "worker.started"
"""The inbox consumer under which a worker records that an attempt of a guarded step (one whose
in-doubt attempts are reconciled or halted) starts, before its body runs."""
RATE_WAIT = timedelta(seconds=1)
"""The longest a worker thread waits for the start slot of a rate-limited step; a slot further
away gives the message back to its queue until shortly before it, the slot kept for it."""
MAX_GIVE_BACK = timedelta(seconds=60)
"""The longest a rate-limited message is given back for at once (a slot further away: again
when it comes back), so that no broker holds it unacknowledged for long (RabbitMQ closes a
channel whose delivery stays unacknowledged past its ``consumer_timeout``)."""
LATE_WAKES = 3
"""How often a thread that woke up too late for its slot takes the next one before it starts
anyway."""


class WorkerConsumer:
    """Runs step attempts. The reply is stored in the inbox row, so a redelivered message whose
    attempt was committed re-sends the stored reply and never runs the step again.

    Once a step's body ran, nothing about its outcome runs it again: a reply that cannot be
    stored (the step runner already turned an unencodable result into a failed attempt) is
    replaced by a failed reply; one that could not be stored because the database is down is
    kept in memory, and stored when the message comes back. No message spins: one whose
    processing fails ``max_failures`` times (an unavailable database aside, which is retried
    for ever), or that was delivered ``2 * max_failures`` times without an answer (its worker
    died each time: a crash loop), is answered ``halted``, which parks its run in
    ``needs_attention`` until ``sagaloop retry``.

    A step with a ``rate_limit`` starts its attempt at a slot reserved in the database (shared
    by every worker): the thread waits for a slot at most ``rate_wait`` away; a message whose
    slot is further away goes back to its queue until shortly before it, the slot held for it,
    and its next delivery is neither in doubt nor counted as a crash (see ``store/limits.py``).
    ``sleep`` waits on ``clock`` (default: its own ``sleep``, or moving a virtual clock)."""

    def __init__(
        self,
        app: App,
        store: Store,
        runner: StepRunner,
        clock: Clock,
        *,
        heartbeat: float | None = None,
        max_failures: int = MAX_FAILURES,
        lease: timedelta = timedelta(seconds=60),
        rate_wait: timedelta = RATE_WAIT,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.runner = runner
        self.clock = clock
        self.rate_wait = rate_wait
        self._sleep = sleep or _sleeper(clock)
        self.reply_queue = engine_queue(app.name)
        self.max_failures = max_failures
        self.lease = lease
        self._keep_alive = _KeepAlive(heartbeat)
        self._troubles = Troubles()
        self._instance = uuid.uuid4().hex
        self._running: set[str] = set()
        self._running_lock = threading.Lock()

    def process_batch(self, deliveries: Sequence[Delivery]) -> None:
        """One at a time: each attempt commits on its own (steps run for long)."""
        for delivery in deliveries:
            self.process(delivery)

    def process(self, delivery: Delivery) -> None:
        env = decode(delivery, self.store)
        if env is None:
            return
        if env.type != "step":
            delivery.dead_letter(f"message type {env.type!r} is not for a worker")
            return
        try:
            task = StepTask.parse(env)
        except MessageError as e:
            delivery.dead_letter(e.reason)
            return
        key = inbox_key(self.app.name, env)
        try:
            reply: StepReply | None = None
            if not self.store.inbox_get(None, WORKER_CONSUMER, key)[0]:
                reply = self._troubles.reply(key) or self._attempt(delivery, env, task, key)
            if reply is not COMMITTED:
                self._commit(delivery, env, task, key, reply)
        except UnknownStepError as e:
            delivery.dead_letter(str(e))
        except _CopyRunning as e:
            logger.info("%s", e)
            delivery.retry_later(RETRY_DELAY)
        except _GiveBack as e:
            logger.debug("%s", e, extra=run_extra(env))
            delivery.retry_later(e.delay)
        except AttemptNotStarted as e:  # the process stops: back to the queue, unrun
            logger.info("%s: given back", e, extra=run_extra(env))
            delivery.retry_later(timedelta(0))
        except BrokerError as e:
            logger.warning("%s", e)
        except TransientStoreError as e:
            self._troubles.transient(key)
            what = f"worker failed on message {env.message_id} (run {env.run_id})"
            log_failure(what, e, run_extra(env))
            delivery.retry_later(RETRY_DELAY)
        except Exception as e:
            self._failed(delivery, env, task, key, e)
        else:
            self._troubles.forget(key)
            delivery.ack()

    def _attempt(self, delivery: Delivery, env: Envelope, task: StepTask, key: str) -> StepReply:
        """Run the attempt (or answer ``halted`` to a message in a crash loop) and keep the
        reply until it is stored. A transactional step's attempt stores its reply in its own
        transaction: then :data:`COMMITTED`."""
        step = self.app.get_step(task.step)
        limit = step.rate_limit if step is not None else None
        deliveries, held = delivery.deliveries, None
        if limit is not None and deliveries > 1:
            held = self.store.take_held_slot(key)
            if held is not None:  # the deliveries it was given back for ran nothing
                deliveries = max(1, deliveries - held.give_backs)
        # An earlier delivery may have run the attempt: not when each was given back unrun.
        redelivered = deliveries > 1 or (held is not None and (held.in_doubt or not held.fresh))
        if self._troubles.unanswered(key, deliveries) >= 2 * self.max_failures:
            reply = self._halted(
                task,
                ErrorInfo(
                    "RepeatedFailure",
                    f"step {task.step!r}: its message was delivered "
                    f"{delivery.deliveries} times without being answered (did the worker die "
                    "while running it? out of memory?), so it was not run again. Fix the "
                    f"cause, then `sagaloop retry {env.run_id}`.",
                ),
            )
        else:
            slot = None if limit is None else self._slot(env, task, key, limit, held, redelivered)
            earlier = self._start(env, task, key, redelivered)
            try:
                with self._keep_alive.hold(delivery):
                    if limit is not None and slot is not None:
                        self._wait_for(env, task, limit, slot)  # the last thing before the body
                    if step is not None and step.transactional:
                        return self._transactional(delivery, env, task, key, redelivered)
                    at = env.position if task.direction == DO else None
                    beat = _Heartbeat(self.store, delivery, env.run_id, at)
                    redelivered = redelivered or earlier
                    reply = self.runner.run(env, redelivered=redelivered, beat=beat, task=task)
            finally:
                with self._running_lock:
                    self._running.discard(key)
            reply = _storable_reply(task, reply)
        self._troubles.keep(key, reply)
        return reply

    def _transactional(
        self, delivery: Delivery, env: Envelope, task: StepTask, key: str, redelivered: bool
    ) -> StepReply:
        """Run a transactional step in the transaction that stores its reply (the inbox row,
        the outbox row, the settled message): its writes through ``ctx.transaction`` commit
        with its completion or not at all. The attempt runs in a savepoint (the step's own,
        inside the runner, rolled back when it raises) within another, rolled back too when a
        copy of the message committed its reply first. A crash before the commit leaves
        nothing: the redelivered message runs it again, not in doubt."""
        from sqlalchemy import Connection  # loaded already by a SQL store

        with self.store.transaction() as tx:
            conn = getattr(tx, "conn", None)
            if not isinstance(conn, Connection):
                raise TransactionalStepError(
                    f"step {task.step!r} is transactional, but this worker's store "
                    f"({type(self.store).__name__}) is not a SQL database: run it on a worker "
                    "of a PostgreSQL or SQLite store"
                )
            attempt = conn.begin_nested()
            reply = self.runner.run(env, redelivered=redelivered, task=task, transaction=conn)
            storable = _storable_reply(task, reply)
            if storable is not reply:  # failed instead: its writes go too
                attempt.rollback()
                attempt = conn.begin_nested()
            self._write(tx, delivery, env, task, key, storable, attempt)
        crash_point("worker.after_commit")
        return COMMITTED

    def _wait_for(self, env: Envelope, task: StepTask, limit: RateLimit, slot: datetime) -> None:
        """Wait for ``slot``. A thread that wakes up too late to start within it (the machine
        was busy) leaves it as a gap and waits for the next free one, so that starts never
        bunch up; after ``LATE_WAKES`` such tries it starts anyway."""
        for tries in range(1, LATE_WAKES + 1):
            wait = (slot - self.clock.now()).total_seconds()
            if wait > 0:
                self._sleep(wait)
            late = (self.clock.now() - slot).total_seconds()
            if late < _tolerance(limit) or tries == LATE_WAKES:
                return
            logger.debug(
                "step %r of run %s woke %.3f s after its slot of %s: taking the next one",
                task.step,
                env.run_id,
                late,
                limit.key,
                extra=run_extra(env),
            )
            slot = self.store.reserve_slot(limit.key, limit.interval, self.clock.now())

    def _slot(
        self,
        env: Envelope,
        task: StepTask,
        key: str,
        limit: RateLimit,
        held: HeldSlot | None,
        in_doubt: bool,
    ) -> datetime:
        """The start slot of this attempt in the step's rate limit, at most ``rate_wait`` away
        (the thread waits for it: :meth:`_wait_for`); a slot further away gives the message
        back (raises _GiveBack) until shortly before it, keeping the slot for it. A slot held
        since an earlier give-back is used if it is not over (see :func:`_tolerance`); one that
        passed while no thread was free is a gap, and the next free slot is reserved."""
        now = self.clock.now()
        slot = None
        if held is not None and held.fresh and held.key == limit.key:
            slot = held.slot if (now - held.slot).total_seconds() < _tolerance(limit) else None
        if slot is None:
            slot = self.store.reserve_slot(limit.key, limit.interval, now)
        wait = (slot - now).total_seconds()
        bound = self.rate_wait.total_seconds()
        if wait > bound:
            give_backs = (held.give_backs if held is not None else 0) + 1
            self.store.hold_slot(
                key, limit.key, slot, in_doubt=in_doubt, give_backs=give_backs, now=now
            )
            back = min(timedelta(seconds=wait - bound / 2), MAX_GIVE_BACK)  # then waits here
            raise _GiveBack(
                back,
                f"step {task.step!r} of run {env.run_id}: its rate limit "
                f"{limit.rate} ({limit.key}) gives it a slot in {wait:.2f} s: back in "
                f"{back.total_seconds():.2f} s",
            )
        return slot

    def _start(self, env: Envelope, task: StepTask, key: str, redelivered: bool) -> bool:
        """Before the body of a guarded step runs (``idempotent=False`` or a reconcile, doing
        it), record that this attempt starts, so that a *copy* of its message (a relay that
        died after publishing and before deleting its outbox row publishes it again) knows it
        may have taken effect: True when an earlier copy started it (the attempt is in doubt);
        raises _CopyRunning while that copy may still be running (in this process, or, for a
        first delivery, within its lease: the step's timeout plus the lease), so the copy comes
        back later. A redelivered message does not wait: the broker gave it back because its
        holder died, and it is in doubt at once, as before."""
        step = self.app.get_step(task.step)
        if step is None or task.direction != DO:
            return False
        if step.idempotent and step.reconcile_fn is None:
            return False  # at least once anyway: nothing to guard
        with self._running_lock:
            if key in self._running:
                raise _CopyRunning(f"a copy of message {env.message_id} runs here: later")
            self._running.add(key)
        try:
            now = self.clock.now()
            found, marker = self.store.inbox_get(None, STARTED, key)
            if not found:
                until = now + self.lease + (step.timeout or timedelta(0))
                record = {"by": self._instance, "until": until.isoformat()}
                with self.store.transaction() as tx:
                    if self.store.inbox_put(tx, STARTED, key, record, now):
                        return False
                found, marker = self.store.inbox_get(None, STARTED, key)  # a copy won the race
            by, until_text = (marker or {}).get("by"), (marker or {}).get("until")
            live = until_text is not None and datetime.fromisoformat(until_text) > now
            if by != self._instance and live and not redelivered:
                raise _CopyRunning(
                    f"a copy of message {env.message_id} started at another worker until "
                    f"{until_text}: later"
                )
            return True
        except BaseException:
            with self._running_lock:
                self._running.discard(key)
            raise

    def _commit(
        self, delivery: Delivery, env: Envelope, task: StepTask, key: str, reply: StepReply | None
    ) -> None:
        """Store ``reply`` (None: it is stored already) and queue it, settling the message. A
        reply the database refuses (not an outage) is replaced by a failed reply."""
        try:
            self._store(delivery, env, task, key, reply)
        except StoreError as e:
            if reply is None or isinstance(e, TransientStoreError):
                raise
            logger.error(
                "worker could not store the reply to %s (run %s)",
                env.message_id,
                env.run_id,
                exc_info=e,
                extra=run_extra(env),
            )
            failed = ErrorInfo(
                "UnstorableResult",
                f"the outcome of step {task.step!r} could not be stored: "
                f"{ErrorInfo.from_exception(e).message}",
            )
            reply = _failed_instead(reply, failed)
            self._troubles.keep(key, reply)
            self._store(delivery, env, task, key, reply)

    def _store(
        self, delivery: Delivery, env: Envelope, task: StepTask, key: str, reply: StepReply | None
    ) -> None:
        with self.store.transaction(lone=reply is not None) as tx:  # see _write
            self._write(tx, delivery, env, task, key, reply)
        crash_point("worker.after_commit")

    def _write(
        self,
        tx: Any,
        delivery: Delivery,
        env: Envelope,
        task: StepTask,
        key: str,
        reply: StepReply | None,
        attempt: Any = None,
    ) -> None:
        """In ``tx``: settle the message, store ``reply`` in the inbox and queue it. When a
        copy stored its reply first, that one is sent, and the savepoint ``attempt`` (a
        transactional step's writes) is rolled back. The reply's checkpoint is the last write:
        in a lone transaction (``_store``) its statement may be the commit."""
        now, ran = self.clock.now(), False
        delivery.settle(tx)  # first: the checkpoint's statement carries it (a database queue)
        if reply is not None:  # the inbox row and the reply message, one write on PostgreSQL
            undo = task.direction == UNDO
            crash_point("worker.undo_before_commit" if undo else "worker.before_commit")
            sent = [Outgoing(self.reply_queue, step_result(env, reply, now))]
            write = Checkpoint(now, (WORKER_CONSUMER, key, reply.to_payload()), messages=sent)
            ran = self.store.write_checkpoint(tx, write) is Written.WRITTEN
        if attempt is not None:
            (attempt.commit if ran else attempt.rollback)()
        if not ran:  # a copy stored its reply first (the checkpoint wrote nothing): send that
            _, stored = self.store.inbox_get(tx, WORKER_CONSUMER, key)
            reply = StepReply.model_validate(stored)  # as this worker (or a copy) built it
            self.store.enqueue(tx, [Outgoing(self.reply_queue, step_result(env, reply, now))], now)

    def _failed(
        self, delivery: Delivery, env: Envelope, task: StepTask, key: str, exc: Exception
    ) -> None:
        """A failure that is no outage: retry it a few times, then answer ``halted``."""
        what = f"worker failed on message {env.message_id} (run {env.run_id})"
        failures = self._troubles.give_up(
            key, delivery, what, exc, self.max_failures, run_extra(env)
        )
        if failures is None:
            return
        logger.error(
            "%s %d times: answering halted", what, failures, exc_info=exc, extra=run_extra(env)
        )
        cause = ErrorInfo.from_exception(exc, with_traceback=True)
        error = ErrorInfo(
            "RepeatedFailure",
            f"step {task.step!r}: processing its message failed {failures} times "
            f"({cause.type}: {cause.message}). Fix the cause, then `sagaloop retry "
            f"{env.run_id}`.",
            traceback=cause.traceback,
        )
        reply = self._halted(task, error)
        try:
            self._store(delivery, env, task, key, reply)
        except BrokerError as e:
            logger.warning("%s", e)
        except Exception as e:
            log_failure(f"could not answer halted to {env.message_id}", e, run_extra(env))
            self._troubles.keep(key, reply)
            delivery.retry_later(RETRY_DELAY)
        else:
            self._troubles.forget(key)
            delivery.ack()

    def _halted(self, task: StepTask, error: ErrorInfo) -> StepReply:
        return StepReply(
            direction=task.direction,
            worker=self.runner.worker,
            outcome=Outcome.HALTED,
            error=error.to_json(),
        )


def _failed_instead(reply: StepReply, error: ErrorInfo) -> StepReply:
    """A failed reply in place of ``reply``, which could not be stored or sent."""
    return StepReply(
        direction=reply.direction,
        worker=reply.worker,
        outcome=Outcome.FAILED,
        error=error.to_json(),
    )


def _storable_reply(task: StepTask, reply: StepReply) -> StepReply:
    """``reply``, or a failed reply if it cannot be stored or sent (the step runner checks
    results already: this is the last line, for anything it did not foresee)."""
    try:
        encode_value(reply.to_payload(), what=f"the reply of step {task.step!r}")
    except UnencodableError as e:
        return _failed_instead(reply, ErrorInfo(UNENCODABLE_RESULT, str(e)))
    return reply


class _Heartbeat:
    """What ``ctx.heartbeat()`` does on a worker, at most once per ``every`` seconds: renew the
    lease (not in the first ``every`` s: it is fresh) and look at the run (cancelled, undone,
    over; or ``cancelling`` and its saga code no longer awaits this step): either way, or if
    another worker took the message, the attempt is told to stop."""

    STOPPING = frozenset({s.COMPENSATING, *s.FINAL_STATUSES})

    def __init__(
        self,
        store: Store,
        delivery: Delivery,
        run_id: str,
        position: int | None = None,
        every: float = 1.0,
    ) -> None:
        self.store, self.delivery, self.run_id, self.every = store, delivery, run_id, every
        self.position = position
        self._next = 0.0
        self._renew_after = time.monotonic() + every
        self._abandoned: bool | None = None
        """Whether the cancel delivered into the saga code cancelled its await of this step
        (None: not looked yet; the answer never changes once the cancel is recorded)."""

    def __call__(self, ctx: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every
        if now >= self._renew_after and not self.delivery.extend():
            raise StepCancelled("the attempt was superseded: another worker took its message")
        run = self.store.get_run(self.run_id)
        if run is not None and run.status in self.STOPPING:
            raise StepCancelled(f"run {self.run_id!r} is {run.status}: the step should stop")
        if run is not None and run.status == s.CANCELLING and self.abandoned():
            raise StepCancelled(
                f"run {self.run_id!r} is cancelling and its saga code no longer awaits this "
                "step: the step should stop"
            )

    def abandoned(self) -> bool:
        if self._abandoned is None and self.position is not None:
            for ev in reversed(self.store.load_history(None, self.run_id)):
                if ev.kind == h.CANCEL_DELIVERED:
                    self._abandoned = self.position in ev.data.get("steps", ())
                    break
        return bool(self._abandoned)


COMMITTED = StepReply(direction=DO, worker="", outcome=Outcome.COMPLETED)
"""What :meth:`WorkerConsumer._attempt` returns when the attempt stored its reply itself (a
transactional step): nothing is left to commit."""


class TransactionalStepError(SagaloopError):
    """A transactional step met a worker whose store is not a SQL database."""


class _CopyRunning(Exception):
    """Another copy of this step message may be running its attempt now: come back later."""


class _GiveBack(Exception):
    """The step's rate limit has no slot for it soon: back to the queue for ``delay``."""

    def __init__(self, delay: timedelta, message: str) -> None:
        super().__init__(message)
        self.delay = delay


def _tolerance(limit: RateLimit) -> float:
    """How late after its slot an attempt may still start: half an interval, so that starts
    stay more than half an interval apart even with the few milliseconds between this check
    and the body (a window of N intervals sees at most N + 1 starts); never less than 20 ms,
    a thread's wake-up on a busy machine (a high rate tolerates that much bunching)."""
    return max(limit.interval / 2, 0.02)


def _sleeper(clock: Clock) -> Callable[[float], None]:
    """How to wait ``seconds`` on ``clock``: its own ``sleep``; on a virtual clock (the test
    harness's), move it; else really sleep."""
    sleep = getattr(clock, "sleep", None)
    if callable(sleep):
        return sleep  # type: ignore[no-any-return]
    advance = getattr(clock, "advance", None)
    if callable(advance):
        return lambda seconds: advance(timedelta(seconds=seconds))
    return time.sleep


class _KeepAlive:
    """Renews the leases of the deliveries whose steps are running, every ``interval`` seconds
    (a worker that dies stops): one thread per worker consumer, while steps run."""

    def __init__(self, interval: float | None) -> None:
        self.interval = interval
        self._running: dict[int, Delivery] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def hold(self, delivery: Delivery) -> Iterator[None]:
        if not self.interval:
            yield
            return
        with self._lock:
            self._running[id(delivery)] = delivery
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="leases", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(id(delivery), None)

    def _run(self) -> None:
        assert self.interval is not None
        while True:
            time.sleep(self.interval)
            with self._lock:
                running = list(self._running.values())
                if not running:
                    self._thread = None  # the next step starts another
                    return
            for delivery in running:
                try:
                    renewed = delivery.extend()
                except Exception:
                    logger.exception("could not renew a lease; retrying")
                    continue
                with self._lock:
                    lost = not renewed and self._running.pop(id(delivery), None) is not None
                if lost:
                    logger.warning("lease lost while the step ran: its result will be discarded")
