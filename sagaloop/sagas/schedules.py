"""Schedules: when a saga starts on its own. A 5-field cron expression (UTC) or a fixed
interval, a catch-up policy for the ticks missed while no engine ran, and the run id of a tick,
the same in every engine (so that two engines firing one tick start one run). No I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, get_args

from sagaloop.errors import DeclarationError

CatchUp = Literal["latest", "all", "skip"]
CATCH_UP_POLICIES: tuple[str, ...] = get_args(CatchUp)
CATCH_UP_LIMIT = 100
"""With ``catch_up="all"``: at most this many of the latest missed ticks start runs."""
SKIP_GRACE = timedelta(seconds=60)
"""With ``catch_up="skip"``: a tick later than this is missed, and starts nothing."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
_DAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# (name, lowest, highest, names of values from `lowest`)
_FIELDS: tuple[tuple[str, int, int, list[str]], ...] = (
    ("minute", 0, 59, []),
    ("hour", 0, 23, []),
    ("day of month", 1, 31, []),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
_SEARCH_YEARS = 9  # any date a cron can match recurs within 8 years (29 February)


class InvalidSchedule(DeclarationError, ValueError):
    """A schedule's cron expression, interval, name or policy is not valid."""


def _value(text: str, field: tuple[str, int, int, list[str]], expr: str) -> int:
    name, low, high, names = field
    if text.lower() in names:
        return names.index(text.lower()) + low
    if not text.isdigit():
        raise InvalidSchedule(f"cron {expr!r}: {text!r} is not a valid {name}")
    number = int(text)
    if not low <= number <= high:
        raise InvalidSchedule(f"cron {expr!r}: {name} {number} is not within {low}-{high}")
    return number


def _field(text: str, field: tuple[str, int, int, list[str]], expr: str) -> frozenset[int]:
    """The values of one field: ``*``, ``5``, ``1-5``, ``*/15``, ``1-30/2``, ``5/10``, lists."""
    name, low, high, _ = field
    values: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"([^/]+)(?:/(\d+))?", part)
        if not match:
            raise InvalidSchedule(f"cron {expr!r}: {part!r} is not a valid {name}")
        span, step_text = match.group(1), match.group(2)
        step = int(step_text) if step_text else 1
        if step < 1:
            raise InvalidSchedule(f"cron {expr!r}: the step of {part!r} must be at least 1")
        if span == "*":
            start, stop = low, high
        elif "-" in span:
            first, _, last = span.partition("-")
            start, stop = _value(first, field, expr), _value(last, field, expr)
            if start > stop:
                raise InvalidSchedule(f"cron {expr!r}: the range {span!r} goes backwards")
        else:
            start = _value(span, field, expr)
            stop = high if step_text else start
        values.update(range(start, stop + 1, step))
    return frozenset(values)


@dataclass(frozen=True)
class Cron:
    """A 5-field cron expression in UTC: minute, hour, day of month, month, day of week, with
    ``*``, lists, ranges, steps and names (``jan``, ``mon``); ``@daily`` and the other macros.
    As in Vixie cron, when both days are restricted a day matching either one matches."""

    expr: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool
    any_weekday: bool

    @classmethod
    def parse(cls, expr: str) -> Cron:
        if not isinstance(expr, str):
            raise InvalidSchedule(f"a cron expression is a string, not {expr!r:.60}")
        text = _MACROS.get(expr.strip().lower(), expr)
        fields = text.split()
        if len(fields) != 5:
            raise InvalidSchedule(
                f"cron {expr!r} must have 5 fields (minute hour day-of-month month "
                f"day-of-week, in UTC), not {len(fields)}: '*/5 * * * *' is every 5 minutes"
            )
        sets = [_field(f, spec, expr) for f, spec in zip(fields, _FIELDS, strict=True)]
        weekdays = frozenset(d % 7 for d in sets[4])
        minutes, hours, days, months = sets[:4]
        any_day, any_weekday = fields[2] == "*", fields[4] == "*"
        cron = cls(expr, minutes, hours, days, months, weekdays, any_day, any_weekday)
        if cron.next_after(EPOCH) is None:
            raise InvalidSchedule(f"cron {expr!r} never fires (no such date)")
        return cron

    def _day_matches(self, when: datetime) -> bool:
        day = when.day in self.days
        weekday = (when.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return day and weekday
        return day or weekday

    def next_after(self, after: datetime) -> datetime | None:
        """The first time strictly after ``after`` that matches (None: none within 9 years)."""
        t = after.astimezone(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
        limit = t.year + _SEARCH_YEARS
        while t.year <= limit:
            if t.month not in self.months:
                year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
                t = t.replace(year=year, month=month, day=1, hour=0, minute=0)
            elif not self._day_matches(t):
                t = t.replace(hour=0, minute=0) + timedelta(days=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0) + timedelta(hours=1)
            elif t.minute not in self.minutes:
                t += timedelta(minutes=1)
            else:
                return t
        return None

    def __str__(self) -> str:
        return self.expr


@dataclass(frozen=True)
class Every:
    """A fixed interval, at whole seconds: ticks at every multiple of it since 1970-01-01 UTC
    (so that every engine computes the same ticks)."""

    interval: timedelta

    def __post_init__(self) -> None:
        if not isinstance(self.interval, timedelta):
            raise InvalidSchedule(f"every= is a timedelta, not {self.interval!r:.60}")
        if self.interval < timedelta(seconds=1) or self.interval.microseconds:
            raise InvalidSchedule(f"every={self.interval!r} must be whole seconds, at least 1")

    def next_after(self, after: datetime) -> datetime | None:
        seconds = int(self.interval.total_seconds())
        since = after.astimezone(UTC) - EPOCH
        elapsed = since.days * 86400 + since.seconds  # whole seconds, rounded down
        return EPOCH + timedelta(seconds=(elapsed // seconds + 1) * seconds)

    def __str__(self) -> str:
        return f"every {int(self.interval.total_seconds())}s"


Spec = Cron | Every


def spec_text(spec: Spec) -> str:
    """How a spec is stored: ``cron:<expr>`` or ``every:<seconds>``."""
    if isinstance(spec, Cron):
        return f"cron:{spec.expr}"
    return f"every:{int(spec.interval.total_seconds())}"


def parse_spec(text: str) -> Spec:
    """The spec stored as :func:`spec_text` wrote it."""
    kind, _, value = text.partition(":")
    if kind == "every" and value.isdigit():
        return Every(timedelta(seconds=int(value)))
    if kind == "cron":
        return Cron.parse(value)
    raise InvalidSchedule(f"unknown stored schedule spec {text!r}")


def make_spec(cron: str | None, every: timedelta | None) -> Spec:
    if (cron is None) == (every is None):
        raise InvalidSchedule("a schedule takes a cron expression or every=, exactly one")
    return Cron.parse(cron) if cron is not None else Every(every)  # type: ignore[arg-type]


def check_catch_up(catch_up: str) -> CatchUp:
    if catch_up not in CATCH_UP_POLICIES:
        raise InvalidSchedule(
            f"catch_up={catch_up!r}: choose one of {', '.join(CATCH_UP_POLICIES)}"
        )
    return catch_up  # type: ignore[return-value]


def ticks(spec: Spec, start: datetime, end: datetime) -> Iterator[datetime]:
    """The ticks of ``spec`` in ``[start, end]``."""
    tick = spec.next_after(start - timedelta(microseconds=1))
    while tick is not None and tick <= end:
        yield tick
        tick = spec.next_after(tick)


def due_ticks(spec: Spec, first: datetime, now: datetime, policy: CatchUp) -> list[datetime]:
    """The ticks from ``first`` (the stored next tick) to ``now`` that start runs: the latest
    (``latest``), the latest ``CATCH_UP_LIMIT`` (``all``), or the latest if it is at most
    ``SKIP_GRACE`` late (``skip``). Looked for in widening windows back from ``now``, so that
    an engine down for a year does not walk every second of it."""
    wanted = CATCH_UP_LIMIT if policy == "all" else 1
    found: list[datetime] = []
    for back in (timedelta(hours=1), timedelta(days=1), timedelta(days=32), timedelta(days=366)):
        start = max(first, now - back)
        found = list(ticks(spec, start, now))[-wanted:]
        if len(found) >= wanted or start == first:
            break
    else:
        found = list(ticks(spec, max(first, now - timedelta(days=366 * _SEARCH_YEARS)), now))
        found = found[-wanted:]
    if policy == "skip":
        found = [t for t in found if now - t <= SKIP_GRACE]
    return found


def tick_run_id(app: str, schedule: str, tick: datetime) -> str:
    """The run id of ``schedule``'s tick: the same in every engine of the app."""
    stamp = tick.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_id = f"schedule:{app}:{schedule}:{stamp}"
    if len(run_id) <= 200:
        return run_id
    digest = hashlib.sha256(f"{app}\x00{schedule}".encode()).hexdigest()[:32]
    return f"schedule:{digest}:{stamp}"


@dataclass(frozen=True)
class ScheduleDef:
    """A schedule declared in code (``@app.schedule``): start ``saga`` with ``input`` at each
    tick of ``spec``."""

    name: str
    saga: str
    spec: Spec
    input: Any = None
    catch_up: CatchUp = "latest"
