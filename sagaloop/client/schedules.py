"""Schedules managed from Python (``client.schedules``): create, describe, list, pause, resume,
update, delete, and start runs outside the ticks (trigger, backfill). ``sagaloop schedule`` calls
these; what they refuse they refuse with :class:`~sagaloop.sagas.schedules.InvalidSchedule`.

Run ids, and so what starts at most once:
- a tick's run: ``schedule:<app>:<name>:<tick>`` (:func:`tick_run_id`), whether the scheduler
  fires it or :meth:`Schedules.backfill` starts it: a backfill over ticks already fired, or
  fired later, starts nothing twice;
- a triggered run: ``schedule:<app>:<name>:trigger:<id>``, a new uuid unless ``trigger_id`` is
  given: triggering twice with one id starts one run.
"""

from __future__ import annotations

import builtins
import dataclasses
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sagaloop.engine.ports import Schedule, ScheduleStore
from sagaloop.sagas.app import App
from sagaloop.sagas.schedules import (
    Cron,
    Every,
    InvalidSchedule,
    ScheduleDef,
    Spec,
    make_spec,
    parse_spec,
    spec_text,
    tick_run_id,
    ticks,
)

if TYPE_CHECKING:
    from sagaloop.client.client import Client

BACKFILL_LIMIT = 1000
"""A backfill over more ticks than this is refused, before any run starts."""
_UNSET: Any = object()


@dataclass(frozen=True)
class ScheduleInfo:
    """A stored schedule as :meth:`Schedules.describe` tells it: ``spec`` readable (a cron
    expression in UTC, or ``every <n>s``), the next ticks (none while paused), the last tick
    fired and its run, and where it comes from (``code``: ``@app.schedule``; ``cli``: made at
    run time, from Python or ``sagaloop schedule add``)."""

    app: str
    name: str
    saga: str
    spec: str
    input: Any
    catch_up: str
    paused: bool
    origin: str
    next_ticks: list[datetime]
    last_tick: datetime | None
    last_run_id: str | None
    note: str | None

    @classmethod
    def of(cls, row: Schedule, count: int) -> ScheduleInfo:
        spec = parse_spec(row.spec)
        upcoming: list[datetime] = []
        tick: datetime | None = row.next_tick
        while not row.paused and tick is not None and len(upcoming) < count:
            upcoming.append(tick)
            tick = spec.next_after(tick)
        return cls(
            row.app,
            row.name,
            row.saga,
            str(spec),
            row.input,
            row.catch_up,
            row.paused,
            row.origin,
            upcoming,
            row.last_tick,
            row.last_run_id,
            row.note,
        )


class Schedules:
    """The schedules in the client's store, of the client's app unless ``app=`` names another
    (or, with a client of no app, the only app that has a schedule so named)."""

    def __init__(self, client: Client) -> None:
        if not isinstance(client.store, ScheduleStore):
            raise TypeError("schedules need a store with the ScheduleStore role (a SqlStore)")
        self.client = client
        self.store: ScheduleStore = client.store

    def _app(self) -> App:
        if self.client.app is None:
            raise InvalidSchedule("creating a schedule needs the app: Client(store, app)")
        return self.client.app

    def _find(self, name: str, app: str | None) -> Schedule:
        return find_schedule(self.store, name, app or self.client.app_name)

    def create(
        self,
        name: str,
        saga: str,
        input: Any = None,
        *,
        cron: str | None = None,
        every: timedelta | None = None,
        catch_up: str = "latest",
        note: str | None = None,
    ) -> ScheduleInfo:
        """Store a schedule that starts ``saga`` with ``input`` at each tick of ``cron`` (5
        fields, UTC) or ``every``, from the next tick on. Refused as ``@app.schedule`` refuses
        (a bad spec, name or policy, an unknown saga) and if the name is taken. ``note``: a
        note kept with it (a pause or resume replaces it)."""
        row = add_schedule(
            self.store,
            self._app(),
            name,
            saga,
            cron=cron,
            every=every,
            input=input,
            catch_up=catch_up,
            note=note,
            now=self.client.clock.now(),
        )
        return ScheduleInfo.of(row, 5)

    def describe(self, name: str, *, app: str | None = None, ticks: int = 5) -> ScheduleInfo:
        """The schedule ``name`` with its next ``ticks`` ticks."""
        return ScheduleInfo.of(self._find(name, app), ticks)

    def list(self, *, app: str | None = None, ticks: int = 1) -> list[ScheduleInfo]:
        """The schedules of ``app`` (default: the client's; a client of no app: all)."""
        rows = self.store.list_schedules(app or self.client.app_name)
        return [ScheduleInfo.of(row, ticks) for row in rows]

    def pause(self, name: str, *, note: str | None = None, app: str | None = None) -> Schedule:
        """Pause: nothing starts at its ticks until resumed; ``note`` (why) replaces the
        stored note. Returns the schedule found."""
        row = self._find(name, app)
        now = self.client.clock.now()
        pause_schedule(self.store, row, paused=True, now=now, note=note)
        return row

    def resume(self, name: str, *, note: str | None = None, app: str | None = None) -> Schedule:
        """Resume from the next tick: the ticks of the pause start nothing (backfill them).
        The note is replaced by ``note`` (none: cleared)."""
        row = self._find(name, app)
        now = self.client.clock.now()
        pause_schedule(self.store, row, paused=False, now=now, note=note)
        return row

    def delete(self, name: str, *, app: str | None = None) -> Schedule:
        """Delete a schedule made at run time (one declared in code is refused: pause it)."""
        row = self._find(name, app)
        delete_schedule(self.store, row)
        return row

    def update(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: timedelta | None = None,
        input: Any = _UNSET,
        app: str | None = None,
    ) -> ScheduleInfo:
        """Change the spec (``cron`` or ``every``) and/or the input of a schedule made at run
        time (one declared in code: change the code). A new spec drops the stored next tick:
        the next tick is the new spec's first after now, and the ticks of the old spec not yet
        fired start nothing. The same spec keeps the next tick; a new input is used from the
        next tick on. The pause, last tick and last run are kept."""
        row = self._find(name, app)
        if row.origin == CODE:
            raise InvalidSchedule(
                f"schedule {name!r} is declared in the code of app {row.app!r}: change it there"
            )
        spec = parse_spec(row.spec) if cron is None and every is None else make_spec(cron, every)
        value = row.input if input is _UNSET else input
        definition = self.client.app.get_saga(row.saga) if self.client.app else None
        if definition is not None:  # checks the input as @app.schedule does
            probe = App(row.app)
            probe.sagas[definition.name] = definition
            expr = spec.expr if isinstance(spec, Cron) else None
            interval = spec.interval if isinstance(spec, Every) else None
            probe.schedule(expr, every=interval, name=name, input=value)(definition)
        now = self.client.clock.now()
        next_tick = first_tick(spec, now)
        changed = Schedule(
            app=row.app,
            name=row.name,
            saga=row.saga,
            spec=spec_text(spec),
            input=value,
            catch_up=row.catch_up,
            paused=row.paused,
            origin=row.origin,
            next_tick=next_tick,
            updated_at=now,
            note=row.note,
        )
        self.store.put_schedule(changed, replace=True)
        return self.describe(name, app=row.app)

    def _start(self, row: Schedule, run_id: str) -> str:
        if self.client.app_name not in (None, row.app):
            raise InvalidSchedule(
                f"schedule {row.name!r} belongs to app {row.app!r}, not to this client's "
                f"{self.client.app_name!r}"
            )
        return self.client.start(row.saga, row.input, run_id=run_id)

    def trigger(self, name: str, *, trigger_id: str | None = None, app: str | None = None) -> str:
        """Start one run of the schedule now, outside its ticks (paused or not), and return its
        id: ``schedule:<app>:<name>:trigger:<trigger_id or a new uuid>``. Idempotent per
        ``trigger_id``."""
        row = self._find(name, app)
        suffix = trigger_id if trigger_id is not None else uuid.uuid4().hex
        return self._start(row, f"schedule:{row.app}:{row.name}:trigger:{suffix}")

    def backfill(
        self, name: str, start: datetime, end: datetime, *, app: str | None = None
    ) -> builtins.list[str]:
        """Start one run per tick of the schedule in ``[start, end]``, with the tick's own run
        id: a tick already fired (or fired later by the scheduler) starts nothing again.
        Returns the run ids, in tick order. Refused, before any run starts, over more than
        :data:`BACKFILL_LIMIT` ticks or with ``end`` before ``start``."""
        row = self._find(name, app)
        if end < start:
            raise InvalidSchedule(f"backfill: the end {end} is before the start {start}")
        found: builtins.list[datetime] = []
        for tick in ticks(parse_spec(row.spec), start, end):
            found.append(tick)
            if len(found) > BACKFILL_LIMIT:
                raise InvalidSchedule(
                    f"backfill of schedule {name!r}: more than {BACKFILL_LIMIT} ticks from "
                    f"{start} to {end}; backfill a shorter range at a time"
                )
        return [self._start(row, tick_run_id(row.app, row.name, tick)) for tick in found]


# --- the rows of schedules (shared with the runtime's Scheduler) ---------------------------

CODE, CLI = "code", "cli"
"""Where a stored schedule comes from: declared in the app's code, or added at run time."""


def first_tick(spec: Spec, now: datetime) -> datetime:
    tick = spec.next_after(now)
    if tick is None:  # refused when parsed: a cron that never fires
        raise InvalidSchedule(f"schedule {spec} never fires")
    return tick


def stored(app: str, schedule: ScheduleDef, now: datetime, origin: str = CODE) -> Schedule:
    """The row of a declared schedule, its next tick the first after ``now``."""
    spec = schedule.spec
    return Schedule(
        app=app,
        name=schedule.name,
        saga=schedule.saga,
        spec=spec_text(spec),
        input=schedule.input,
        catch_up=schedule.catch_up,
        paused=False,
        origin=origin,
        next_tick=first_tick(spec, now),
        updated_at=now,
    )


def add_schedule(
    store: ScheduleStore,
    app: App,
    name: str,
    saga: str,
    *,
    cron: str | None = None,
    every: timedelta | None = None,
    input: Any = None,
    catch_up: str = "latest",
    note: str | None = None,
    now: datetime,
) -> Schedule:
    """Store a schedule of ``app`` made at run time, checked as a declared one is. Refused
    (:class:`InvalidSchedule`) if the name is taken, by the app's code or in the store."""
    definition = app.get_saga(saga)
    if definition is None:
        raise InvalidSchedule(f"app {app.name!r} has no saga {saga!r}: {sorted(app.sagas)}")
    if name in app.schedules:
        raise InvalidSchedule(f"schedule {name!r} is declared in the code of app {app.name!r}")
    probe = App(app.name)  # checks the name, spec, input and policy as @app.schedule does
    probe.sagas[definition.name] = definition
    probe.schedule(cron, every=every, name=name, input=input, catch_up=catch_up)(definition)
    row = dataclasses.replace(stored(app.name, probe.schedules[name], now, origin=CLI), note=note)
    if not store.put_schedule(row, replace=False):
        raise InvalidSchedule(
            f"app {app.name!r} already has a schedule {name!r}: delete it first, or choose "
            "another name"
        )
    return row


def find_schedule(store: ScheduleStore, name: str, app: str | None) -> Schedule:
    """The stored schedule ``name`` (of ``app``, or of the only app that has one so named)."""
    found = [s for s in store.list_schedules(app) if s.name == name]
    if not found:
        raise InvalidSchedule(f"no schedule {name!r}" + (f" in app {app!r}" if app else ""))
    if len(found) > 1:
        apps = ", ".join(s.app for s in found)
        raise InvalidSchedule(f"apps {apps} each have a schedule {name!r}: name the app")
    return found[0]


def pause_schedule(
    store: ScheduleStore,
    schedule: Schedule,
    *,
    paused: bool,
    now: datetime,
    note: str | None = None,
) -> None:
    """Pause (nothing starts) or resume (from the next tick: the paused ones are not caught
    up) a stored schedule; ``note`` is stored with it (a resume without one clears it)."""
    next_tick = None if paused else first_tick(parse_spec(schedule.spec), now)
    store.pause_schedule(
        schedule.app, schedule.name, paused=paused, now=now, next_tick=next_tick, note=note
    )


def delete_schedule(store: ScheduleStore, schedule: Schedule) -> None:
    """Delete a schedule made at run time. One declared in code would come back when an engine
    starts: pause it, or remove it from the code."""
    if schedule.origin == CODE:
        raise InvalidSchedule(
            f"schedule {schedule.name!r} is declared in the code of app {schedule.app!r}: "
            "pause it (sagaloop schedule pause), or remove it from the code"
        )
    store.delete_schedule(schedule.app, schedule.name)
