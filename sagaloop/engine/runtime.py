"""The processing loops: the engine consumer, the worker consumer, the timer scheduler, and a
``Runtime`` that runs them on threads (``sagaloop dev`` runs all of them in one process).

Every loop settles a message in the transaction that processed it and acknowledges it only after
the commit, so a process killed at any instant loses nothing: what was not committed is
delivered again, and what was committed is never applied twice (inbox).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sagaloop.engine.activation import Engine
from sagaloop.engine.messages import CONTENT_TYPE, Envelope, engine_queue, step_queue
from sagaloop.engine.ports import Broker, Clock, Delivery, Outgoing, Store, SystemClock
from sagaloop.engine.steps import StepRunner
from sagaloop.errors import BrokerError, MessageError, SagaloopError, UnknownStepError
from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)

WORKER_CONSUMER = "worker"
RETRY_DELAY = timedelta(seconds=1)


def decode(delivery: Delivery) -> Envelope | None:
    """The delivery's envelope, or None after dead-lettering a message that is not one."""
    if delivery.content_type not in (None, CONTENT_TYPE):
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

    def process(self, delivery: Delivery) -> None:
        env = decode(delivery)
        if env is None:
            return
        try:
            with self.store.transaction() as tx:
                self.engine.handle(tx, env)
                delivery.settle(tx)
        except MessageError as e:
            delivery.dead_letter(e.reason)
        except BrokerError as e:  # the lease was lost: another consumer owns the message now
            logger.warning("%s", e)
        except Exception:
            logger.exception("engine failed on message %s (run %s)", env.message_id, env.run_id)
            delivery.retry_later(RETRY_DELAY)
        else:
            delivery.ack()


class WorkerConsumer:
    """Runs step attempts. The reply is stored in the inbox row, so a redelivered message whose
    attempt was committed re-sends the stored reply and never runs the step again."""

    def __init__(self, app: App, store: Store, runner: StepRunner, clock: Clock) -> None:
        self.app = app
        self.store = store
        self.runner = runner
        self.clock = clock
        self.reply_queue = engine_queue(app.name)

    def process(self, delivery: Delivery) -> None:
        env = decode(delivery)
        if env is None:
            return
        if env.type != "step":
            delivery.dead_letter(f"message type {env.type!r} is not for a worker")
            return
        try:
            with self.store.transaction() as tx:
                done, reply = self.store.inbox_get(tx, WORKER_CONSUMER, env.message_id)
            if not done:
                reply = self.runner.run(env, redelivered=delivery.deliveries > 1)
            with self.store.transaction() as tx:
                if not done and not self.store.inbox_put(
                    tx, WORKER_CONSUMER, env.message_id, reply, self.clock.now()
                ):
                    _, reply = self.store.inbox_get(tx, WORKER_CONSUMER, env.message_id)
                result = Envelope(
                    type="step_result",
                    message_id=f"result:{env.message_id}",
                    run_id=env.run_id,
                    saga=env.saga,
                    position=env.position,
                    attempt=env.attempt,
                    idempotency_key=env.idempotency_key,
                    payload=reply,
                    created_at=self.clock.now(),
                )
                self.store.enqueue(tx, [Outgoing(self.reply_queue, result)], self.clock.now())
                delivery.settle(tx)
        except UnknownStepError as e:
            delivery.dead_letter(str(e))
        except BrokerError as e:
            logger.warning("%s", e)
        except Exception:
            logger.exception("worker failed on message %s", env.message_id)
            delivery.retry_later(RETRY_DELAY)
        else:
            delivery.ack()


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
                        message_id=f"timer:{t.run_id}:{t.pos}:{t.kind}:{t.attempt}",
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
        return len(due)


class Runtime:
    """Runs the chosen roles on threads until ``stop()``: the engine, workers on some queues,
    the timer scheduler and, for a broker outside the database, the outbox relay."""

    def __init__(
        self,
        app: App,
        store: Store,
        broker: Broker,
        *,
        engine: bool = True,
        queues: Sequence[str] | None = None,
        timers: bool = True,
        concurrency: int = 4,
        clock: Clock | None = None,
        poll: float = 0.2,
        name: str = "sagaloop",
    ) -> None:
        self.app = app
        self.store = store
        self.broker = broker
        self.clock = clock or SystemClock()
        self.poll = poll
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.runner = StepRunner(app, threads=max(concurrency, 1) * 2, worker=name)
        if engine:
            consumer = EngineConsumer(Engine(app, store, clock=self.clock), store)
            self._spawn("engine", self._consume, [consumer.queue], consumer.process)
        step_queues = [step_queue(app.name, q) for q in (app.queues if queues is None else queues)]
        if step_queues:
            worker = WorkerConsumer(app, store, self.runner, self.clock)
            for i in range(concurrency):
                self._spawn(f"worker-{i}", self._consume, step_queues, worker.process)
        if timers:
            scheduler = TimerScheduler(app, store, self.clock)
            self._spawn("timers", self._repeat, scheduler.fire_due)
        if not broker.uses_outbox:
            from sagaloop.outbox.relay import Relay

            relay = Relay(store, broker, clock=self.clock)
            self._spawn("relay", self._repeat, relay.relay_once)
        broker.declare([engine_queue(app.name), *step_queues])

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        self.threads.append(threading.Thread(target=target, args=args, name=name, daemon=True))

    def start(self) -> Runtime:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the messages in hand, then stop; unstarted messages stay queued."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout)
        self.runner.close()

    def _consume(self, queues: list[str], process: Callable[[Delivery], None]) -> None:
        while not self.stopping.is_set():
            try:
                for delivery in self.broker.receive(queues, 1, self.poll):
                    process(delivery)
            except SagaloopError:
                logger.exception("consumer of %s failed; retrying", queues)
                self.stopping.wait(1.0)

    def _repeat(self, once: Callable[[], int]) -> None:
        while not self.stopping.is_set():
            try:
                if once() == 0:
                    self.stopping.wait(self.poll)
            except SagaloopError:
                logger.exception("%s failed; retrying", threading.current_thread().name)
                self.stopping.wait(1.0)
