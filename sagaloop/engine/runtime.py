"""The processing loops: the engine consumer, the worker consumer and the timer scheduler.
``sagaloop.cli.services`` runs them on threads.

Every loop settles a message in the transaction that processed it and acknowledges it only after
the commit, so a process killed at any instant loses nothing: what was not committed is
delivered again, and what was committed is never applied twice (inbox).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

from sagaloop.engine.activation import Engine
from sagaloop.engine.crashpoints import crash_point
from sagaloop.engine.messages import CONTENT_TYPE, Envelope, derived_id, engine_queue, step_result
from sagaloop.engine.ports import Clock, Delivery, Outgoing, Store
from sagaloop.engine.steps import StepRunner
from sagaloop.errors import BrokerError, MessageError, TransientStoreError, UnknownStepError
from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)

WORKER_CONSUMER = "worker"
RETRY_DELAY = timedelta(seconds=1)


def log_failure(what: str, exc: BaseException) -> None:
    """An outage of the database is expected and retried: one line. Anything else: a trace."""
    if isinstance(exc, TransientStoreError):
        logger.warning("%s: %s; retrying", what, exc)
    else:
        logger.error("%s; retrying", what, exc_info=exc)


def decode(delivery: Delivery) -> Envelope | None:
    """The delivery's envelope, or None after dead-lettering a message that is not one."""
    content_type = delivery.content_type  # None: not set, which plain clients often do
    if content_type is not None and content_type.split(";")[0].strip().lower() != CONTENT_TYPE:
        delivery.dead_letter(f"content type {delivery.content_type!r} is not {CONTENT_TYPE}")
        return None
    try:
        return Envelope.from_bytes(delivery.body)
    except MessageError as e:
        delivery.dead_letter(e.reason)
        return None


class EngineConsumer:
    def __init__(self, engine: Engine, store: Store) -> None:
        self.engine = engine
        self.store = store
        self.queue = engine.queue

    def process_batch(self, deliveries: Sequence[Delivery]) -> None:
        """Process the messages in one transaction (one commit for the batch), then ack them.

        They are activated in order of run id (stable, so a run's messages keep their order),
        so that two engines lock the runs of their batches in the same order and never
        deadlock. If any of them fails, the whole transaction is rolled back and they are
        processed one at a time, so that a bad message costs only itself."""
        batch = [(d, env) for d in deliveries if (env := decode(d)) is not None]
        if len(batch) > 1:
            batch.sort(key=lambda pair: pair[1].run_id)
            try:
                self._commit(batch)
            except Exception as e:
                logger.debug("a batch of %d failed (%s); one message at a time", len(batch), e)
            else:
                for delivery, _ in batch:
                    delivery.ack()
                return
        for delivery, env in batch:
            self._process(delivery, env)

    def process(self, delivery: Delivery) -> None:
        env = decode(delivery)
        if env is not None:
            self._process(delivery, env)

    def _commit(self, batch: Sequence[tuple[Delivery, Envelope]]) -> None:
        try:
            with self.store.transaction() as tx:
                for delivery, env in batch:
                    self.engine.handle(tx, env)
                    delivery.settle(tx)
                crash_point("engine.before_commit")
        except BaseException:
            self.engine.rolled_back()
            raise
        self.engine.committed()
        crash_point("engine.after_commit")

    def _process(self, delivery: Delivery, env: Envelope) -> None:
        try:
            self._commit([(delivery, env)])
        except MessageError as e:
            delivery.dead_letter(e.reason)
        except BrokerError as e:  # the lease was lost: another consumer owns the message now
            logger.warning("%s", e)
        except Exception as e:
            log_failure(f"engine failed on message {env.message_id} (run {env.run_id})", e)
            delivery.retry_later(RETRY_DELAY)
        else:
            delivery.ack()


class WorkerConsumer:
    """Runs step attempts. The reply is stored in the inbox row, so a redelivered message whose
    attempt was committed re-sends the stored reply and never runs the step again."""

    def __init__(
        self,
        app: App,
        store: Store,
        runner: StepRunner,
        clock: Clock,
        *,
        heartbeat: float | None = None,
    ) -> None:
        self.app = app
        self.store = store
        self.runner = runner
        self.clock = clock
        self.reply_queue = engine_queue(app.name)
        self._keep_alive = _KeepAlive(heartbeat)

    def process_batch(self, deliveries: Sequence[Delivery]) -> None:
        """One at a time: each attempt commits on its own (steps run for long)."""
        for delivery in deliveries:
            self.process(delivery)

    def process(self, delivery: Delivery) -> None:
        env = decode(delivery)
        if env is None:
            return
        if env.type != "step":
            delivery.dead_letter(f"message type {env.type!r} is not for a worker")
            return
        try:
            done, reply = self.store.inbox_get(None, WORKER_CONSUMER, env.message_id)
            if not done:
                with self._keep_alive.hold(delivery):
                    reply = self.runner.run(env, redelivered=delivery.deliveries > 1)
            with self.store.transaction() as tx:
                if not done and not self.store.inbox_put(
                    tx, WORKER_CONSUMER, env.message_id, reply, self.clock.now()
                ):
                    _, reply = self.store.inbox_get(tx, WORKER_CONSUMER, env.message_id)
                now = self.clock.now()
                result = step_result(env, reply, now)
                self.store.enqueue(tx, [Outgoing(self.reply_queue, result)], now)
                delivery.settle(tx)
                if env.payload.get("direction") == "undo":
                    crash_point("worker.undo_before_commit")
                else:
                    crash_point("worker.before_commit")
            crash_point("worker.after_commit")
        except UnknownStepError as e:
            delivery.dead_letter(str(e))
        except BrokerError as e:
            logger.warning("%s", e)
        except Exception as e:
            log_failure(f"worker failed on message {env.message_id}", e)
            delivery.retry_later(RETRY_DELAY)
        else:
            delivery.ack()


class _KeepAlive:
    """Renews the leases of the deliveries whose steps are running, every ``interval`` seconds,
    so that a long step is not redelivered to another worker; a worker that dies stops renewing
    them. One thread per worker consumer renews them all; it runs while steps do."""

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


class TimerScheduler:
    """Turns due timers into messages to the engine, in the transaction that deletes them."""

    def __init__(self, app: App, store: Store, clock: Clock, *, batch: int = 100) -> None:
        self.store = store
        self.clock = clock
        self.batch = batch
        self.queue = engine_queue(app.name)

    def fire_due(self) -> int:
        now = self.clock.now()
        with self.store.transaction() as tx:
            due = self.store.take_due_timers(tx, now, self.batch)
            messages = [
                Outgoing(
                    self.queue,
                    Envelope(
                        type="timer",
                        message_id=derived_id("timer", t.run_id, t.pos, t.kind, t.attempt),
                        run_id=t.run_id,
                        position=t.pos,
                        attempt=t.attempt or None,
                        payload={"kind": t.kind},
                        created_at=now,
                    ),
                )
                for t in due
            ]
            self.store.enqueue(tx, messages, now)
            if due:
                crash_point("timers.before_commit")
        return len(due)
