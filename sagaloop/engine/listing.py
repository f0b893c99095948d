"""The runs listing's query terms: its sort orders, its opaque keyset cursor and what the page of
a waiting run reads to say what it waits for (``RunQueries.list_runs``, ``Client.list``, the
console's runs page).

A cursor is the sort key and the run id of the last run of a page: the next page is the runs
strictly after that pair in the sort order (keyset paging, never an offset), so a page costs an
index range scan however deep it is.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import datetime
from enum import StrEnum

from sagaloop.engine.history import Event
from sagaloop.engine.records import ApprovalRow, RunRecord, Timer
from sagaloop.errors import ValidationError

PAGE = 50
"""How many runs a page of the console (and of ``sagaloop list --after``) shows."""


class RunOrder(StrEnum):
    """How a listing of runs is sorted; ties of the time are broken by run id, the same way."""

    UPDATED_DESC = "-updated"
    """Most recently updated first (the default)."""
    UPDATED_ASC = "updated"
    CREATED_DESC = "-created"
    CREATED_ASC = "created"

    @property
    def column(self) -> str:
        """The run's field the order sorts by (``updated_at`` or ``created_at``)."""
        return "updated_at" if self.value.endswith("updated") else "created_at"

    @property
    def descending(self) -> bool:
        return self.value.startswith("-")


def run_order(text: str | RunOrder | None) -> RunOrder:
    """The order named ``text`` (None or empty: most recently updated first)."""
    if not text:
        return RunOrder.UPDATED_DESC
    try:
        return RunOrder(text)
    except ValueError:
        names = ", ".join(o.value for o in RunOrder)
        raise ValidationError(f"{text!r} is not a sort order of runs (one of {names})") from None


def run_cursor(run: RunRecord, order: RunOrder = RunOrder.UPDATED_DESC) -> str:
    """The cursor after ``run`` in ``order``: pass it as ``after=`` for the next page."""
    at: datetime = getattr(run, order.column)
    raw = json.dumps([order.value, at.isoformat(), run.run_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def read_run_cursor(text: str, order: RunOrder) -> tuple[datetime, str]:
    """The (time, run id) a cursor of ``order`` names; ValidationError when it is not one (or
    was made for another order)."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        name, at, run_id = json.loads(raw)
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not isinstance(run_id, str):
            raise ValueError("not an aware time and a run id")
    except (ValueError, TypeError) as e:
        raise ValidationError(
            f"{text[:60]!r} is not a cursor of the runs listing (pass the cursor that the "
            "previous page printed)"
        ) from e
    if name != order.value:
        raise ValidationError(
            f"this cursor pages runs sorted by {name!r}, not {order.value!r}: ask with the "
            "same order as the page that gave it"
        )
    return when, run_id


@dataclasses.dataclass(frozen=True, slots=True)
class RunWaits:
    """What a run's page reads to say what it waits for, without replaying its history: its
    open approvals, its timers, and the waits and steps among its newest events that no newer
    event ended (``RunQueries.run_waits``)."""

    approvals: list[ApprovalRow] = dataclasses.field(default_factory=list)
    timers: list[Timer] = dataclasses.field(default_factory=list)
    waits: list[Event] = dataclasses.field(default_factory=list)
    steps: list[Event] = dataclasses.field(default_factory=list)
    """The ``step_scheduled`` / ``compensation_scheduled`` events among its newest events whose
    attempt no newer event ended (queued or running)."""
