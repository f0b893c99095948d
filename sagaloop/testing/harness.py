from __future__ import annotations

import copy
import inspect
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sagaloop.brokers.database import DatabaseBroker
from sagaloop.brokers.local_streams import LocalStreams
from sagaloop.brokers.memory import MemoryBroker
from sagaloop.client import Client
from sagaloop.client import updates as client_updates
from sagaloop.client.polling import NOTHING, Pending
from sagaloop.client.timeline import Timeline
from sagaloop.engine.history import Event
from sagaloop.engine.messages import Envelope, engine_queue, start_queue, step_queue
from sagaloop.engine.ports import Broker, Delivery, Outgoing, RunRecord
from sagaloop.engine.state import NEEDS_ATTENTION
from sagaloop.errors import ErrorInfo, SagaFailedError
from sagaloop.runtime.assembly import Parts, Roles, Tuning, assemble, lane_queue
from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.approvals import PendingApproval
from sagaloop.store.sql import SqlStore


class VirtualClock:
    """A clock that only moves when told to (or when the harness skips to the next timer)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, delta: timedelta) -> None:
        with self._lock:
            self._now += delta

    def set(self, when: datetime) -> None:
        with self._lock:
            self._now = max(self._now, when)


DEFAULT_CACHE_SIZE = 1024
"""Suspended runs an engine keeps by default (``Engine(cache_size=...)``)."""


class _StepsView(App):
    """The app as the harness's step runners see it: overridden bodies in place of the declared
    ones. Steps declared on the app later are seen too."""

    def __init__(self, app: App) -> None:  # not App.__init__: it registers nothing itself
        self.name = app.name
        self._app = app
        self.overrides: dict[str, StepDef[Any, Any]] = {}

    def get_step(self, name: str) -> StepDef[Any, Any] | None:
        step = self._app.get_step(name)
        return None if step is None else self.overrides.get(step.name, step)


class _Override:
    """An override in place; as a context manager, removed when the block ends."""

    def __init__(self, view: _StepsView, step: StepDef[Any, Any], fn: Callable[..., Any]) -> None:
        self._view, self._name = view, step.name
        self._previous = view.overrides.get(step.name)
        replaced = copy.copy(step)
        replaced.fn = fn
        replaced.is_async = inspect.iscoroutinefunction(fn)
        view.overrides[step.name] = replaced

    def __enter__(self) -> _Override:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is None:
            self._view.overrides.pop(self._name, None)
        else:
            self._view.overrides[self._name] = self._previous


class Crash(Exception):
    """Raised by a crash hook to simulate a process killed at that point."""


class Harness:
    """Drives an app's engine, workers, timers (and relay) one message at a time: the parts
    a ``Service`` runs on threads, built by the same assembly (``sagaloop.runtime.assembly``)
    and stepped on the caller's thread.

    ``broker="database"`` (default) uses the outbox table as the queue, like the embedded
    default; ``broker="memory"`` relays the outbox to the in-memory broker.

    Saga code is replayed from the history on every activation, so that a saga that is not
    deterministic fails its test as it would fail in production once its run leaves the
    engine's cache (a restart, another engine, an eviction). ``cache=True`` keeps suspended
    runs in memory between activations, as production engines do: for tests of that cache.
    """

    def __init__(
        self,
        app: App,
        *,
        url: str = "sqlite://",
        broker: Literal["database", "memory"] = "database",
        clock: VirtualClock | None = None,
        cache: bool = False,
        lease: timedelta = timedelta(seconds=60),
    ) -> None:
        self.app = app
        self.clock = clock or VirtualClock()
        self.lease = lease
        self.store = SqlStore(url)
        self.store.upgrade()
        self.broker: Broker = (
            DatabaseBroker(self.store, clock=self.clock, lease=lease)
            if broker == "database"
            else MemoryBroker(clock=self.clock, lease=lease)
        )
        self.streams = LocalStreams()
        """The run's live channel: what steps stream (``self.client.stream(run_id)``)."""
        self.client = Client(self.store, app, clock=self.clock, streams=self.streams)
        self.cache_size = DEFAULT_CACHE_SIZE if cache else 0
        """How many suspended runs the engine keeps (0: replay on every activation); read by
        :meth:`restart`."""
        self._steps = _StepsView(app)
        self._lane_queue = lane_queue(app)
        """The in-process steps' queue: always in the database, as in production."""
        self.queues: list[str] | None = None
        """The queues this harness consumes; None: the engine's and every step queue of the
        app (as declared when the harness steps, so steps declared later are included). The
        engine's queue (``<app>.engine``) stands for both the engine's queues: with its start
        queue (``<app>.starts``)."""
        self.crash_hook: Callable[[str, Delivery], None] | None = None
        self._processing = 0
        """How many deliveries the harness is processing now (more than one: a step's body
        stepped it, as :meth:`cancel` does)."""
        self.restart()

    def restart(self) -> None:
        """Drop everything held in memory, as a process restart would (the saga code of the
        runs the engine kept unwinds on its own loop, as a stopping process's does)."""
        kept: Parts | None = getattr(self, "parts", None)
        if kept is not None and kept.engine is not None:
            kept.engine.engine.close()
        parts = assemble(
            self.app,
            self.store,
            self.broker,
            Roles(relay=True, lane=True),
            Tuning(heartbeat=None, lease=self.lease, cache_size=self.cache_size),
            clock=self.clock,
            streams=self.streams,
            name="harness",
            stepping=True,
            steps=self._steps,
        )
        # the harness plays every role
        assert parts.engine is not None and parts.worker is not None and parts.lane is not None
        assert parts.local is not None and parts.timers is not None and parts.relay is not None
        self.parts = parts
        """What this harness steps: built by ``sagaloop.runtime.assembly``, as a service's."""
        self.engine = parts.engine.engine
        self.relay, self.timers = parts.relay, parts.timers
        self._engine_consumer, self._worker_consumer = parts.engine, parts.worker
        self._lane, self._local_consumer = parts.lane, parts.local

    # --- client operations -------------------------------------------------------------------

    def start(
        self, saga: SagaDef[Any, Any] | str, input: Any = None, *, run_id: str | None = None
    ) -> str:
        return self.client.start(saga, input, run_id=run_id)

    def send_event(self, run_id: str, name: str, data: Any = None) -> None:
        self.client.send_event(run_id, name, data)

    def publish_event(self, run_id: str, name: str, data: Any = None) -> str:
        """Put an event on the engine's queue as any publisher on the broker may: none of
        the Client's checks (nor its claim of an approval) first. Returns its message id."""
        run = self.client.get(run_id)
        message = Envelope(
            type="event",
            message_id=uuid.uuid4().hex,
            run_id=run_id,
            payload={"name": name, "data": data},
            created_at=self.clock.now(),
        )
        with self.store.transaction() as tx:
            self.store.enqueue(tx, [Outgoing(engine_queue(run.app), message)], self.clock.now())
        return message.message_id

    def cancel(self, run_id: str, reason: str | None = None, *, now: bool = False) -> None:
        """Cancel the run (``Client.cancel``). Called while the harness runs a step (from the
        step's body, an override or a crash hook), the engine takes the cancel at once, as a
        service's engine thread would while the step runs: the run turns ``cancelling`` (the
        saga code, which no longer awaits the step, cleans up) or ``compensating``
        (``cancel_grace=0``), and the step's next heartbeat that looks at the run (its first,
        then at most one a second) raises StepCancelled. Outside a step, the cancel waits on
        the engine's queue for the next ``run_until_idle``."""
        self.client.cancel(run_id, reason, now=now)
        if self._processing:
            self._engine_now()

    def _engine_now(self) -> None:
        """Process the engine's queues (and nothing else) until they are empty: what an
        engine thread does while a step runs on another."""
        kept = self.queues
        self.queues = [engine_queue(self.app.name)]
        try:
            while self.step_once():
                pass
        finally:
            self.queues = kept

    def retry(self, run_id: str) -> None:
        self.client.retry(run_id)

    def approvals(self, run_id: str | None = None) -> list[PendingApproval]:
        """The approvals that runs wait for (``Client.approvals``)."""
        return self.client.approvals(run_id)

    def approve(
        self, run_id: str, call_id: str, *, args: Any = None, by: str | None = None
    ) -> None:
        """Answer the approval ``call_id`` of ``run_id`` yes (``Client.approve``)."""
        self.client.approve(run_id, call_id, args=args, by=by)

    def deny(self, run_id: str, call_id: str, *, reason: str, by: str | None = None) -> None:
        """Answer the approval ``call_id`` of ``run_id`` no (``Client.deny``)."""
        self.client.deny(run_id, call_id, reason=reason, by=by)

    def get(self, run_id: str) -> RunRecord:
        return self.client.get(run_id)

    def result(self, run_id: str) -> Any:
        """The run's output, of the type its saga declares (``Client.result`` with the app: a
        pydantic model, a dataclass...). Raises SagaFailedError for a run that did not complete
        or needs attention (with the reason: a non-determinism, say), TimeoutError for one still
        going (call :meth:`run_until_idle` first)."""
        run = self.client.get(run_id)
        if run.status == NEEDS_ATTENTION:
            raise SagaFailedError(run_id, run.status, ErrorInfo("NeedsAttention", run.reason or ""))
        return self.client.result(run_id, timeout=0)

    def get_published(self, run_id: str, key: str, default: Any = None) -> Any:
        """The latest value the run published under ``key``, now (``Client.get_published``)."""
        return self.client.get_published(run_id, key, default)

    def wait_published(self, run_id: str, key: str, *, after: Any = NOTHING) -> Any:
        """``Client.wait_published`` for a test: step the harness, one message at a time, until
        the run has published a value under ``key`` (other than ``after``, if given) and return
        it, so the test sees it before the run goes on. The clock does not move: TimeoutError
        when nothing is left to do but wait (call :meth:`advance`, or send what the run waits
        for, then read again); NotPublishedError if the run ended without publishing it."""
        while True:
            try:
                return self.client.wait_published(run_id, key, timeout=0, after=after)
            except TimeoutError as e:
                if not self.step_once():
                    raise TimeoutError(
                        f"{e}, and nothing is left to do at {self.clock.now():%Y-%m-%d %H:%M:%S}"
                        ": move the clock (Harness.advance) or send what the run waits for"
                    ) from None

    def query(self, run_id: str, query: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Compute a query of the run (``Client.query``) over what it recorded so far: the
        harness is not stepped."""
        return self.client.query(run_id, query, *args, **kwargs)

    def send_update(
        self, run_id: str, name: str, data: Any = None, *, update_id: str | None = None
    ) -> str:
        """Send an update (as ``Client.update`` does) without waiting for its answer, and
        return its update id: read the answer later with :meth:`update` and that id."""
        return client_updates.send(self.client, run_id, name, data, update_id)

    def update(
        self, run_id: str, name: str, data: Any = None, *, update_id: str | None = None
    ) -> Any:
        """``Client.update`` for a test: send the update, then step the harness, one message
        at a time, until the run answers it; return the answer (or raise
        ``UpdateFailedError``/``UpdateRefusedError``). The clock does not move: TimeoutError
        when nothing is left to do but wait. An ``update_id`` sent already is not sent again:
        its answer is read."""
        update_id = client_updates.send(self.client, run_id, name, data, update_id)
        while True:
            found = client_updates.answer(self.client, run_id, name, update_id)
            if not isinstance(found, Pending):
                return found
            if not self.step_once():
                raise TimeoutError(
                    f"{found.waiting}, and nothing is left to do at "
                    f"{self.clock.now():%Y-%m-%d %H:%M:%S}: move the clock (Harness.advance) "
                    "or send what the run waits for"
                )

    def status(self, run_id: str) -> Timeline:
        return self.client.status(run_id)

    def history(self, run_id: str) -> list[Event]:
        return self.client.history(run_id)

    # --- driving -----------------------------------------------------------------------------

    def step_once(self) -> int:
        """Relay, fire due timers, then process at most one message. Returns the work done."""
        work = 0
        if not self.broker.uses_outbox:
            work += self.relay.relay_once()
        work += self.timers.fire_due()
        work += self.parts.schedules.fire_due() if self.parts.schedules is not None else 0
        work += self.parts.debounce.fire_due() if self.parts.debounce is not None else 0
        deliveries = self.broker.receive(self._consumed(), 1, 0)
        if not deliveries and (self.queues is None or self._lane_queue in self.queues):
            deliveries = self._lane.receive([self._lane_queue], 1, 0)
        for delivery in deliveries:
            work += 1
            queue = getattr(delivery, "queue", None) or getattr(
                getattr(delivery, "_message", None), "queue", ""
            )
            role, process = self.parts.route(str(queue))
            self._processing += 1
            try:
                if self.crash_hook is not None:
                    try:
                        self.crash_hook(role, delivery)
                    except Crash:
                        continue  # the message stays claimed until its lease expires
                process(delivery)
            finally:
                self._processing -= 1
        return work

    def run_until_idle(self, *, skip_time: bool = True, max_steps: int = 1_000_000) -> int:
        """Process until nothing is left to do. With ``skip_time``, jump the clock to the next
        timer (or lease expiry) whenever only waiting is left."""
        done = idle_skips = 0
        for _ in range(max_steps):
            work = self.step_once()
            done += work
            if work:
                idle_skips = 0
                continue
            if not skip_time:
                return done
            next_at = self._next_at()
            if self._messages_in_hand():
                # Claimed by a simulated crash, or delayed by retry_later: skip past the lease.
                idle_skips += 1
                if idle_skips > 10:
                    raise RuntimeError("messages stay unavailable after their lease expired")
                self.clock.advance(self.lease + timedelta(seconds=1))
                continue
            if next_at is None:
                return done
            self.clock.set(next_at)
        raise RuntimeError(f"still busy after {max_steps} steps")

    def _next_at(self) -> datetime | None:
        """When the next timer or debounce window of the app falls due (None: nothing waits)."""
        next_at = self.store.next_timer_at(app=self.app.name)
        if self.parts.debounce is not None and any(s.debounce for s in self.app.sagas.values()):
            windows = self.store.pending_debounced(self.app.name)
            due = min((w.due_at for w in windows), default=None)
            if due is not None and (next_at is None or due < next_at):
                return due
        return next_at

    def _messages_in_hand(self) -> bool:
        memory = self.broker if isinstance(self.broker, MemoryBroker) else None
        if memory is not None and (
            memory._unacked or any(memory._queues.get(q) for q in self._consumed())
        ):
            return True
        depths = self.store.queue_depths()
        return any(depths.get(q) for q in [*self._consumed(), self._lane_queue])

    def _consumed(self) -> list[str]:
        app = self.app
        if self.queues is not None:  # the engine's queue stands for the engine: both its queues
            engine, starts = engine_queue(app.name), start_queue(app.name)
            if engine in self.queues and starts not in self.queues:
                at = self.queues.index(engine) + 1
                return [*self.queues[:at], starts, *self.queues[at:]]
            return self.queues
        steps = [step_queue(app.name, q) for q in app.queues]
        return [engine_queue(app.name), start_queue(app.name), *steps]

    def advance(self, delta: timedelta) -> None:
        """Move the virtual clock by ``delta`` as time passes in production: each timer that
        falls due fires at its due time, in order, and the work it causes (steps, new timers)
        is done before the clock moves on to the next one."""
        until = self.clock.now() + delta
        self.run_until_idle(skip_time=False)
        while (next_at := self._next_at()) is not None:
            if next_at > until:
                break
            self.clock.set(next_at)
            self.run_until_idle(skip_time=False)
        self.clock.set(until)
        self.run_until_idle(skip_time=False)

    # --- step bodies -------------------------------------------------------------------------

    def override(self, step: StepDef[Any, Any], fn: Callable[..., Any]) -> _Override:
        """Run ``fn`` in place of ``step``'s body (same arguments, ``ctx`` first) for the rest
        of the test, or until the ``with`` block it is used as ends. The app is not changed:
        other harnesses of the same app run the declared body."""
        declared = self.app.get_step(step.name)
        if declared is not step:
            raise ValueError(
                f"step {step.name!r} is not registered in app {self.app.name!r}: override "
                "a step of the app this harness runs"
            )
        return _Override(self._steps, step, fn)

    def close(self) -> None:
        self.store.close()
