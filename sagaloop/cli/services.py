"""Services: the engine, workers, timers and relay run on threads until stopped.
``sagaloop dev`` runs all of them in one process on the embedded default."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sagaloop.engine.activation import Engine
from sagaloop.engine.messages import engine_queue, step_queue
from sagaloop.engine.ports import Broker, Clock, Delivery, Store, SystemClock
from sagaloop.engine.runtime import EngineConsumer, TimerScheduler, WorkerConsumer
from sagaloop.engine.steps import StepRunner
from sagaloop.outbox.relay import Relay
from sagaloop.sagas.app import App

logger = logging.getLogger(__name__)


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
        heartbeat: float = 10.0,
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
            worker = WorkerConsumer(app, store, self.runner, self.clock, heartbeat=heartbeat)
            for i in range(concurrency):
                self._spawn(f"worker-{i}", self._consume, step_queues, worker.process)
        if timers:
            scheduler = TimerScheduler(app, store, self.clock)
            self._spawn("timers", self._repeat, scheduler.fire_due)
        if not broker.uses_outbox:
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
            except Exception:
                logger.exception("consumer of %s failed; retrying", queues)
                self.stopping.wait(1.0)

    def _repeat(self, once: Callable[[], int]) -> None:
        while not self.stopping.is_set():
            try:
                if once() == 0:
                    self.stopping.wait(self.poll)
            except Exception:
                logger.exception("%s failed; retrying", threading.current_thread().name)
                self.stopping.wait(1.0)
