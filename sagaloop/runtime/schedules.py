"""The scheduler: starts the runs of an app's schedules when their ticks fall due.
``sagaloop.runtime.service`` runs it on the timers' thread of an engine; the harness steps it.

Exactly one run per tick, however many engines fire it: the run id derives from (app, schedule,
tick) and starting an existing run id starts nothing (``Client.start`` is idempotent per run id).
The run is started first and the stored next tick moved on after (compare-and-set): an engine
that dies between the two leaves the tick to the next engine, which starts the same run id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sagaloop.client import Client
from sagaloop.client.schedules import CODE, first_tick, stored
from sagaloop.engine.ports import Clock, Schedule, ScheduleStore, Store
from sagaloop.errors import OverloadedError, SagaloopError, StoreError
from sagaloop.runtime.registry import Outage
from sagaloop.sagas.app import App
from sagaloop.sagas.schedules import (
    InvalidSchedule,
    check_catch_up,
    due_ticks,
    parse_spec,
    tick_run_id,
)

logger = logging.getLogger(__name__)

RELOOK = 1.0
"""Seconds after which a scheduler looks again for due schedules, though its last look found
none due before then: it looks ``RELOOK`` ahead of the clock, and a next tick is always after
the time it was set at, so only another process's write (``sagaloop schedule add``, a resume)
can make a schedule due sooner, which then waits up to ``RELOOK`` (an idle engine reads once a
second, not every ``--poll``)."""


class Scheduler:
    """Fires the due ticks of ``app``'s schedules: those declared in its code (written to the
    store the first time it fires) and those added at run time (``sagaloop schedule add``)."""

    def __init__(self, app: App, store: Store, clock: Clock, *, client: Client | None = None):
        if not isinstance(store, ScheduleStore):
            raise TypeError("schedules need a store with the ScheduleStore role (a SqlStore)")
        self.app = app
        self.store: ScheduleStore = store
        self.clock = clock
        self.client = client or Client(store, app, clock=clock, start_backlog=0)
        self._synced = False
        self._looked: tuple[datetime, float] | None = None
        """When it last looked for due schedules: the clock's time and ``time.monotonic()``."""
        self._quiet: tuple[datetime, float] | None = None
        """After a look that found nothing due: the clock's time before which nothing is due
        (the next tick it found, or RELOOK ahead) and the ``time.monotonic()`` until which
        that look holds."""

    def sync(self) -> None:
        """Write the app's declared schedules to the store: new ones start at the next tick;
        a changed one is replaced (its pause kept; a new spec starts at its next tick)."""
        now = self.clock.now()
        for schedule in self.app.schedules.values():
            self.store.put_schedule(stored(self.app.name, schedule, now), replace=True)
        self._synced = True

    def fire_due(self) -> int:
        """Start the runs of the due ticks; return how many ticks were handled."""
        if not self._synced:
            self.sync()
        now = self.clock.now()
        looked = self._looked
        if looked is not None and looked[0] == now and time.monotonic() - looked[1] < RELOOK:
            return 0  # a stopped clock (the harness's): nothing fell due since that look
        quiet = self._quiet
        if quiet is not None and now < quiet[0] and time.monotonic() < quiet[1]:
            return 0  # nothing falls due before quiet[0] (see RELOOK)
        self._looked = (now, time.monotonic())
        ahead = now + timedelta(seconds=RELOOK)
        found = self.store.due_schedules(self.app.name, ahead)
        due = [schedule for schedule in found if schedule.next_tick <= now]
        if not due:
            next_at = min((schedule.next_tick for schedule in found), default=ahead)
            self._quiet = (next_at, time.monotonic() + RELOOK)
            return 0
        self._quiet = None
        fired = 0
        for schedule in due:
            if schedule.origin == CODE and schedule.name not in self.app.schedules:
                continue  # declared by another version of the app: its engines fire it
            fired += self._fire(schedule, now)
        return fired

    def beside(self, fire_timers: Callable[[], int]) -> Callable[[], int]:
        """One step of the timers' thread that fires the due schedules too (a service runs
        them there: no thread of their own). A failure of the schedules is said once per
        outage and does not hold the timers up."""
        outage = Outage()

        def fire() -> int:
            done = fire_timers()
            fired = [0]

            def schedules() -> None:
                fired[0] = self.fire_due()

            warning = "the schedules of app %r could not fire (%s); trying again"
            outage.attempt(schedules, warning, self.app.name)
            return done + fired[0]

        return fire

    def _fire(self, schedule: Schedule, now: datetime) -> int:
        try:
            spec = parse_spec(schedule.spec)
            policy = check_catch_up(schedule.catch_up)
        except InvalidSchedule as e:
            logger.error("schedule %r is not valid (%s): paused", schedule.name, e)
            self.store.pause_schedule(
                schedule.app, schedule.name, paused=True, now=now, next_tick=None
            )
            return 1
        last: tuple[datetime | None, str | None] = (None, None)
        for tick in due_ticks(spec, schedule.next_tick, now, policy):
            run_id = tick_run_id(schedule.app, schedule.name, tick)
            try:
                self.client.start(schedule.saga, schedule.input, run_id=run_id)
            except OverloadedError as e:
                logger.warning("schedule %r: %s; trying again", schedule.name, e)
                return 0
            except StoreError:
                raise
            except SagaloopError as e:  # an unknown saga, a run id taken...: said, not retried
                logger.error("schedule %r could not start run %r: %s", schedule.name, run_id, e)
                continue
            last = (tick, run_id)
            logger.info(
                "schedule %r fired its tick %s: run %r (started once, by whichever engine "
                "fired first)",
                schedule.name,
                f"{tick:%Y-%m-%d %H:%M:%S}",
                run_id,
                extra=_extra(run_id),
            )
        moved = self.store.advance_schedule(schedule, first_tick(spec, now), *last, now)
        return 1 if moved else 0


def _extra(run_id: str) -> dict[str, Any]:
    return {"run_id": run_id}
