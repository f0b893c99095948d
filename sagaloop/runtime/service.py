"""Services: the engine, workers, timers and relay run on threads until stopped.
``sagaloop dev`` runs all of them in one process on the embedded default.

Each loop absorbs what it can retry. Anything that escapes a thread (an exception its handlers
did not absorb, or a BaseException: ``SystemExit``, ``KeyboardInterrupt``, ``CancelledError``)
kills it, and a process with a dead thread must not go on: it would hold deliveries nobody
processes. So the death is logged at CRITICAL, recorded as the process's problem (``sagaloop
health`` fails), and the whole runtime stops; the services then exit with ``EXIT_THREAD_DIED``
so that a supervisor starts them again."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

from sqlalchemy.pool import QueuePool

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.brokers.local_streams import LOCAL
from sagaloop.engine.messages import step_queue
from sagaloop.engine.ports import Broker, Clock, Delivery, Store, Streams, SystemClock
from sagaloop.engine.watchdog import DEADLINE
from sagaloop.errors import BrokerError
from sagaloop.runtime import liveness
from sagaloop.runtime.assembly import Roles, Tuning, assemble, engine_queues
from sagaloop.runtime.consumers import EngineConsumer
from sagaloop.runtime.delivery import log_failure
from sagaloop.runtime.lane import Handoffs, LocalLane
from sagaloop.runtime.registry import SEEN_EVERY, Outage, ProcessRegistry, Registration, describe
from sagaloop.runtime.relay import Relay
from sagaloop.runtime.takeover import Takeover, host_identity, start_of
from sagaloop.sagas.app import App
from sagaloop.store.processes import Identity
from sagaloop.store.sql import SqlStore

logger = logging.getLogger(__name__)

LISTENER = "outbox-listener"
"""The thread of the outbox listener, on a connection of its own (not the store's pool)."""

MAX_BACKOFF = 3.0
"""The longest the relay waits between tries while the broker is down (seconds)."""
QUIET_SWEEP = 1.0
"""On PostgreSQL, the fewest seconds between two sweeps of a relay that nothing woke (see
``Service._sweep_every``)."""
FLUSH_WAIT = 5.0
"""How long a stopping relay waits for the confirms of what it published last (seconds)."""
EXIT_THREAD_DIED = 70
"""The exit status of a service stopped because one of its threads died (``EX_SOFTWARE``)."""
EXIT_ACCESS_REFUSED = 78
"""The exit status of a service that the database or the broker refused at start-up: a wrong
password, a missing role, database or virtual host (``EX_CONFIG``: fix the URL, not retried)."""
GRACE = 30.0
"""How long a stopping service (SIGTERM, Ctrl-C) waits for the step attempts it runs, in all
(``--grace``): then it exits anyway, and what still ran is in doubt, as after a crash."""


class Service:
    """Runs the chosen :class:`Roles` on threads until ``stop()``: the engine, workers on some
    queues, the timer scheduler, retention and, for a broker outside the database, the outbox
    relay (the threads driver of ``sagaloop.runtime.assembly``).

    >>> service = Service(app, store, broker, roles=Roles(queues=["io"]))  # doctest: +SKIP
    >>> service.start()                                                   # doctest: +SKIP
    >>> service.stop()                                                    # doctest: +SKIP
    """

    def __init__(
        self,
        app: App,
        store: Store,
        broker: Broker,
        *,
        roles: Roles | None = None,
        tuning: Tuning | None = None,
        name: str = "sagaloop",
        clock: Clock | None = None,
        streams: Streams | None = None,
    ) -> None:
        roles, tuning = roles or Roles(), tuning or Tuning()
        self.app = app
        self.store = store
        self.broker = broker
        self.roles = roles
        self.tuning = tuning
        self.clock = clock or SystemClock()
        self.poll = tuning.poll
        self.retention = roles.retention
        self.name = name
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.deaths: dict[str, str] = {}
        """Threads that died, and why: each stopped the runtime."""
        self.engine_problems: list[Callable[[], Iterable[str]]] = []
        """Callables that return what is wrong now (one line each; say, a stalled activation):
        :meth:`problems` reports them and ``sagaloop health`` fails while there are any."""
        self._lock = threading.Lock()
        self._on_death: Callable[[], None] | None = None
        self._registration: Registration | None = None
        self._liveness: tuple[liveness.Beat, Path] | None = None
        self._liveness_outage = Outage()
        self._takeover: Takeover | None = None
        self.parts = parts = assemble(
            app, store, broker, roles, tuning, clock=self.clock, streams=streams or LOCAL, name=name
        )
        self.runner = parts.runner
        self.engine_problems.append(self.runner.problems)  # every thread held past its timeout
        self.app_queues = [step_queue(app.name, q) for q in app.queues]
        broker.declare([*engine_queues(app), *self.app_queues])
        self.consumes: list[str] = []
        """The queues this process consumes (its registry row says so)."""
        self.lane: LocalLane | None = None
        """The in-process lane, in an engine of an app with ``local=True`` steps."""
        concurrency, batch = tuning.concurrency, tuning.batch
        if parts.engine is not None:
            consumer = parts.engine
            self.consumes += engine_queues(app)
            self.engine_problems.append(parts.watchdog.stalled)
            self._spawn(
                "engine", self._consume, broker, [consumer.queue], consumer.process_batch, batch
            )
            self._spawn("starts", self._consume_starts, broker, consumer, max(batch // 4, 1))
        if isinstance(parts.lane, LocalLane) and parts.local is not None:
            self.lane = lane = parts.lane
            self.consumes.append(lane.queue)
            for i in range(concurrency):
                args = (lane, [lane.queue], parts.local.process_batch, 1)
                self._spawn(f"local-{i}", self._consume, *args)
        self.consumes += parts.step_queues
        if parts.worker is not None and parts.step_queues:
            process = parts.worker.process_batch
            for i in range(concurrency):
                self._spawn(f"worker-{i}", self._consume, broker, parts.step_queues, process, 1)
        if parts.timers is not None:
            fire = parts.timers.fire_due
            if parts.schedules is not None:  # the app's schedules fire on the same thread
                fire = parts.schedules.beside(fire)
            if parts.debounce is not None:  # and the due debounce windows
                fire = parts.debounce.beside(fire)
            self._spawn("timers", self._repeat, fire)
        if roles.retention is not None:
            self._spawn("retention", self._retain)
        self.relay: Relay | None = parts.relay
        self.listening = threading.Event()
        """Set while this process's outbox listener listens (an engine on PostgreSQL)."""
        self._announced = isinstance(store, SqlStore) and store.dialect == "postgresql"
        """Rows nobody holds are announced to the engines' listeners (``NOTIFY``)."""
        self._listens = self._announced and parts.engine is not None and self.relay is not None
        if self.relay is not None:
            self._spawn("relay", self._relay, self.relay)
            # What other processes commit unclaimed (starts, events, steps completed from
            # outside) is an engine's work: it wakes an engine's relay at once (a worker's
            # relay finds it at its next sweep, if no engine did).
            if self._listens:
                listen = cast(SqlStore, store).listen_for_writes
                wake, listening = self.relay.poke, self.listening
                self._spawn(LISTENER, listen, wake, self.stopping, listening)

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        args = (name, target, *args)
        self.threads.append(threading.Thread(target=self._guard, args=args, name=name, daemon=True))

    def start(
        self,
        *,
        registry: ProcessRegistry | None = None,
        role: str = "",
        on_death: Callable[[], None] | None = None,
        run_dir: Path | None = None,
    ) -> Service:
        """Start the threads. With ``registry`` (default: the store, for
        ``Roles(registry=True)``), keep this process's row there (as ``role``,
        refreshed every ``SEEN_EVERY`` seconds with :meth:`problems`), and its liveness file
        in ``run_dir`` (default ``sagaloop.runtime.liveness.run_dir()``), written before each
        refresh of the row; ``on_death`` is called when a thread dies, after the runtime began
        to stop."""
        self._on_death = on_death
        owner = None
        if registry is None and self.roles.registry:
            registry = cast(ProcessRegistry, self.store)
        if registry is not None:
            role = role or self.name.partition("@")[0]
            owner = secrets.token_hex(8)
            identity = Identity(self.consumes, self.app_queues, owner, host_identity())
            self._registration = Registration(
                registry, self.name, self.app.name, role, self.clock, identity
            )
            now, pid = datetime.now(UTC), os.getpid()
            beat = liveness.Beat(
                name=self.name,
                app=self.app.name,
                role=role,
                pid=pid,
                host=socket.gethostname(),
                started_at=now,
                beat_at=now,
                process_start=start_of(pid),
            )
            self._liveness = (beat, run_dir or liveness.run_dir())
            self._live([])  # first: the database may refuse what follows
            if isinstance(self.store, SqlStore):
                self.store.claim_owner = owner
                if self.relay is not None:
                    self.relay.token = f"{owner}.{self.relay.token}"
                self._takeover = Takeover(self.store, self.name, owner)
                self._take_over()  # before consuming: what a dead process held goes first
            self._registration.started()
            self._spawn("registry", self._beat, self._registration)
        own = self._own_broker()
        if self.relay is not None or self.lane is not None or own is not None:
            handoffs = Handoffs(self.lane, self.relay, owner=owner, broker=own)
            self.store.hand_over_to(handoffs)
        self._check_pool()
        for thread in self.threads:
            thread.start()
        return self

    def _check_pool(self) -> None:
        """Warn when the store's pool keeps fewer connections than this service has threads
        that use it (all but the outbox listener): each transaction beyond the pool's size at
        once would open a connection and close it again (see ``Tuning.connections``)."""
        pool = self.store.engine.pool if isinstance(self.store, SqlStore) else None
        users = sum(1 for thread in self.threads if thread.name != LISTENER)
        if isinstance(pool, QueuePool) and pool.size() < users:
            logger.warning(
                "the store's pool keeps %d connections for %d threads that use it: each "
                "transaction beyond %d at once opens and closes a connection; open the "
                "service's store with open_store(url, connections=tuning.connections) (%d)",
                pool.size(),
                users,
                pool.size(),
                self.tuning.connections,
            )

    def _own_broker(self) -> DatabaseBroker | None:
        """The broker, when it is the store's outbox table (the embedded default, or the
        database broker on PostgreSQL) and no relay publishes: its consumers here take the
        rows this process writes to their queues in memory (``Handoffs``)."""
        broker = self.broker
        if self.relay is None and isinstance(broker, DatabaseBroker) and broker.store is self.store:
            return broker
        return None

    def problems(self) -> list[str]:
        """What is wrong with this process now: its dead threads, then what each of
        ``engine_problems`` reports."""
        out = self._deaths()
        for source in list(self.engine_problems):
            try:
                out.extend(source())
            except Exception as e:
                out.append(f"could not check {getattr(source, '__qualname__', source)}: {e!r}")
        return out

    def abandoned(self) -> list[dict[str, Any]]:
        """What an operator should know that is no problem (health does not fail for it): the
        attempts abandoned past their timeouts whose threads still run, until they end."""
        return self.runner.abandoned()

    def _deaths(self) -> list[str]:
        with self._lock:
            return [f"thread {name!r} died: {why}" for name, why in self.deaths.items()]

    def _guard(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run a thread's loop; whatever escapes it kills the thread, which stops the runtime."""
        try:
            target(*args)
        except BaseException as e:
            self._died(name, describe(e), e)
        else:
            if not self.stopping.is_set():
                self._died(name, "its loop returned while the process was running", None)

    def _died(self, name: str, why: str, exc: BaseException | None) -> None:
        with self._lock:
            self.deaths[name] = why
        logger.critical(
            "thread %r died (%s); stopping this process: the messages in hand are finished or "
            "redelivered, and a supervisor should start it again",
            name,
            why,
            exc_info=exc,
        )
        self._halt()
        if self._registration is not None:
            self._live(self.problems())
            self._registration.beat(
                self.problems(), self.abandoned()
            )  # now: stopping takes a while
        if self._on_death is not None:
            self._on_death()

    def _halt(self) -> None:
        """Tell every thread to finish the message in hand and end; an attempt waiting for a
        step thread is given back (it never started)."""
        self.stopping.set()
        self.runner.stop_starting()
        nudge = getattr(self.store, "nudge", None)
        if nudge is not None:
            nudge()

    def _beat(self, registration: Registration) -> None:
        """Every ``SEEN_EVERY`` seconds: the liveness file, the registry row, dead processes'
        work. The file is written before and after each database call, so a database that
        refuses or times out never leaves it older than one call (``sagaloop health --live``)."""
        while not self.stopping.wait(SEEN_EVERY):
            problems = self.problems()
            self._live(problems)
            registration.beat(problems, self.abandoned())
            self._live(problems)
            self._take_over()
            self._live(problems)

    def _live(self, problems: list[str]) -> None:
        """Rewrite this process's liveness file (with a registry only); a failure is logged
        once per outage and never stops the service."""
        if self._liveness is None:
            return
        beat, directory = self._liveness
        now = {"beat_at": datetime.now(UTC), "problems": problems}
        write = lambda: liveness.write(beat.model_copy(update=now), directory)  # noqa: E731
        self._liveness_outage.attempt(
            write, "could not write the liveness file in %s (%s)", directory
        )

    def _take_over(self) -> None:
        """Release the claims of processes proven dead (``sagaloop.runtime.takeover``)."""
        if self._takeover is None:
            return
        try:
            self._takeover.sweep()
        except Exception as e:  # their leases run out anyway
            logger.warning("could not look for dead processes' work (%s); retrying later", e)

    def stop(self, timeout: float = GRACE) -> list[str]:
        """Finish the messages in hand, waiting at most ``timeout`` seconds in all (the
        service's grace), then stop; unstarted messages stay queued or are given back. The
        registry then says that this process exited (with the deaths it exits because of).
        Returns what still runs after that (one line each; the service exits anyway, see
        ``sagaloop.cli.serve``)."""
        self._halt()
        end = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(end - time.monotonic(), 0.0))
        stuck = [t.name for t in self.threads if t.is_alive()]
        cut_off = [f"attempt of {job}" for job in self.runner.running()]
        if stuck:
            cut_off.append(f"thread(s) {', '.join(stuck)}")
        self.store.hand_over_to(None)
        if self.relay is not None:
            self._flush(self.relay)
        if self.lane is not None:
            self.lane.release_handed()
        own = self._own_broker()
        if own is not None:
            own.release_handed()
        self.runner.close()
        if not stuck and self.parts.engine is not None:  # no thread activates runs any more
            self.parts.engine.engine.close()
        if self._registration is not None:
            self._registration.stopped(self._deaths())
        if self._liveness is not None:
            liveness.remove(self._liveness[0].pid, self._liveness[1])
        return cut_off

    @staticmethod
    def _flush(relay: Relay) -> None:
        """Publish what the last messages handed over (else it waits for a sweep elsewhere)."""
        try:
            relay.settle(FLUSH_WAIT)
            while relay.send_handed():
                pass
            relay.store.delete_published()
        except Exception as e:
            logger.warning("relay: could not publish at stop (%s); a sweep will", e)

    def _consume(
        self,
        broker: Broker,
        queues: list[str],
        process: Callable[[list[Delivery]], None],
        batch: int,
    ) -> None:
        while not self.stopping.is_set():
            try:
                deliveries = broker.receive(queues, batch, self.poll)
                if deliveries:
                    process(deliveries)
            except Exception as e:
                log_failure(f"consumer of {queues} failed", e)
                self.stopping.wait(1.0)

    def _consume_starts(self, broker: Broker, consumer: EngineConsumer, batch: int) -> None:
        """Take up new runs when it is their turn (see ``sagaloop.runtime.admission``)."""
        while not self.stopping.is_set():
            try:
                room = consumer.gate.wait_turn(self.poll, batch)
                if not room:
                    if consumer.gate.full:
                        self.stopping.wait(self.poll)
                    continue
                deliveries = broker.receive([consumer.start_queue], room, self.poll)
                consumer.gate.taken(len(deliveries))
                if deliveries:
                    consumer.process_batch(deliveries, starts=True)
            except Exception as e:
                log_failure(f"consumer of {consumer.start_queue} failed", e)
                self.stopping.wait(1.0)

    def _repeat(self, once: Callable[[], int]) -> None:
        while not self.stopping.is_set():
            try:
                if once() == 0:
                    self.stopping.wait(self.poll)
            except Exception as e:
                log_failure(f"{threading.current_thread().name} failed", e)
                self.stopping.wait(1.0)

    def _relay(self, relay: Relay) -> None:
        """Publish the rows this process's transactions hand over as soon as they commit, and
        sweep every ``poll`` seconds for rows nobody holds (written by other processes, or left
        by a process that died). While the broker is down it backs off and says so once; it
        alerts on the oldest unsent row."""
        delay, down_since, next_sweep = 0.2, None, 0.0
        while not self.stopping.is_set():
            try:
                sent = relay.send_handed()
                if time.monotonic() >= next_sweep:
                    swept = relay.relay_once()
                    wait = 0 if swept >= relay.batch else self._sweep_every()
                    next_sweep = time.monotonic() + wait
                    sent += swept
            except BrokerError as e:
                if down_since is None:
                    down_since = time.monotonic()
                    logger.warning("relay: broker unavailable (%s); pausing", e)
                self._warn_if_old()
                self.stopping.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF)
                continue
            except Exception as e:
                log_failure("relay failed", e)
                self.stopping.wait(1.0)
                continue
            if down_since is not None:
                logger.warning(
                    "relay: broker back after %.1f s; publishing", time.monotonic() - down_since
                )
                down_since, delay = None, 0.2
            if sent == 0 and relay.wait(max(0.0, next_sweep - time.monotonic())):
                next_sweep = 0.0  # another process committed rows: sweep them now

    def _sweep_every(self) -> float:
        """Seconds from a sweep that found less than a batch to the next one, unless the relay
        is woken sooner: ``poll``; on PostgreSQL, at least ``QUIET_SWEEP``. There the rows
        nobody holds are announced (``NOTIFY``) to the engines' listeners, which wake their
        relays to sweep at once; a sweep nothing woke only looks for the rows of a process
        that died (their lease ran out) or of a publish that failed, none of them urgent to
        the second. A sweep every ``poll`` cost an idle engine a statement each time, and a
        busy one, at each step of a sequential run, a transaction (the deletes of what it
        published ride the claim): 6 % of its GIL's time. An engine whose listener does not
        listen (the server restarting, a pooler that drops ``LISTEN``) sweeps every ``poll``."""
        if not self._announced or (self._listens and not self.listening.is_set()):
            return self.poll
        return max(self.poll, QUIET_SWEEP)

    def _warn_if_old(self, threshold: float = 60.0) -> None:
        oldest = self.store.oldest_outbox_message()
        if oldest is not None:
            age = (self.clock.now() - oldest).total_seconds()
            if age > threshold:
                logger.warning("relay: the oldest unsent message is %.0f s old", age)

    def _retain(self) -> None:
        """Delete finished runs and old inbox rows, in batches, once an hour."""
        assert self.retention is not None
        while not self.stopping.is_set():
            try:
                before = self.clock.now() - self.retention
                while not self.stopping.is_set() and self.store.prune(before=before) > 0:
                    pass
            except Exception:
                logger.exception("retention failed; retrying later")
            self.stopping.wait(3600)


class Runtime(Service):
    """``Service`` with its options as keyword arguments, as before ``Roles`` and ``Tuning``:
    this name is kept for one release (use ``Service``)."""

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
        relay_lease: timedelta = timedelta(seconds=30),
        retention: timedelta | None = None,
        batch: int = 16,
        name: str = "sagaloop",
        activation_deadline: float = DEADLINE,
        streams: Streams | None = None,
    ) -> None:
        super().__init__(
            app,
            store,
            broker,
            roles=Roles(engine=engine, queues=queues, timers=timers, retention=retention),
            tuning=Tuning(
                concurrency=concurrency,
                batch=batch,
                poll=poll,
                heartbeat=heartbeat,
                lease=relay_lease,
                activation_deadline=activation_deadline,
            ),
            name=name,
            clock=clock,
            streams=streams,
        )
