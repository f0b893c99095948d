"""The console's runs page: its filters (all in the address, so a filtered page is a bookmark),
a page of runs by keyset cursor with what each waits for in words, the cheap change stamp its
live region polls, and bulk cancel / retry.

What a page costs: one SELECT of 51 runs on the order's index, the counts by status, and, for
the page's runs not finished, three indexed reads (``RunQueries.run_waits``): no history is
replayed. What a poll of a page that did not move costs: one read of the end of an index
(``RunQueries.last_run_update``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode

from sagaloop.client import Client
from sagaloop.client.timeline import short_json
from sagaloop.engine import state as s
from sagaloop.engine.listing import PAGE, RunOrder, RunWaits, run_cursor
from sagaloop.engine.ports import RunRecord
from sagaloop.errors import SagaloopError
from sagaloop.sagas.approvals import KEY_PREFIX
from sagaloop.ui.security import csrf_ok

AGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
"""The choices of the age filter: runs updated within this time."""
FIELDS = {"id": "run id starts with", "input": "input contains"}
"""Where the search box looks."""
REPAINT = 60
"""Seconds after which a live region is sent again even if no run moved (its durations)."""
BULK_MAX = 200
"""The most runs one bulk action takes."""
ACTIONS = {"cancel": "Cancel", "retry": "Retry"}
FLAGGED = 100
"""Up to how many open approvals the navigation counts (more: "99+")."""


@dataclasses.dataclass(frozen=True)
class Filters:
    """What the address asks of the runs page; every field has a query parameter."""

    saga: str | None = None
    status: str | None = None
    age: str | None = None
    q: str | None = None
    field: str = "id"
    sort: RunOrder = RunOrder.UPDATED_DESC
    after: str | None = None
    before: str | None = None

    def query(self, **changes: Any) -> str:
        """The query string of these filters with ``changes`` (defaults left out; a change of
        filter or order drops the page cursors unless it names them)."""
        values = dataclasses.asdict(self) | {"after": None, "before": None} | changes
        if values["field"] == "id":
            values["field"] = None
        if values["sort"] == RunOrder.UPDATED_DESC:
            values["sort"] = None
        return urlencode({k: str(v) for k, v in values.items() if v})


def filters_of(params: Mapping[str, str]) -> Filters:
    """The filters of a query string; a value the page does not offer is ignored."""

    def text(name: str) -> str | None:
        return (params.get(name) or "").strip() or None

    status, age, sort = text("status"), text("age"), text("sort")
    field = text("field")
    return Filters(
        saga=text("saga"),
        status=status if status in s.ALL_STATUSES else None,
        age=age if age in AGES else None,
        q=text("q"),
        field=field if field in FIELDS else "id",
        sort=RunOrder(sort) if sort in set(RunOrder) else RunOrder.UPDATED_DESC,
        after=text("after"),
        before=None if text("after") else text("before"),
    )


@dataclasses.dataclass
class Row:
    run: RunRecord
    duration: str
    waits_for: str
    pick: str
    """The id of the row's checkbox (kept checked while the live region is sent again)."""


@dataclasses.dataclass
class RunsPage:
    rows: list[Row]
    counts: list[tuple[str, int, str]]
    """(status, how many, the address of the page filtered by it)."""
    total: int
    next: str | None
    previous: str | None
    sorts: dict[str, tuple[str, str]]
    """Per sortable column (``created``, ``updated``): the address its header links to, and
    the arrow that says how the page is sorted by it."""
    stamp: str


def stamp(client: Client) -> str:
    """What a live region compares: the newest update of the client's runs, and the minute
    (a moved run always has a newer ``updated_at``; the minute repaints durations)."""
    app = client.app_name if client.own_app_only else None
    last = client.store.last_run_update(app=app)
    minute = int(client.clock.now().timestamp()) // REPAINT
    return hashlib.sha256(f"{last}|{minute}".encode()).hexdigest()[:16]


class Counts:
    """The counts by status, kept while the stamp they were read under holds: paging and
    searching a page that did not move does not count the runs again (a count is one scan of
    an index of every run: 40 ms at 100,000 runs). Shared by the threads of one console."""

    def __init__(self) -> None:
        self._kept: tuple[str, str | None, dict[str, int]] | None = None

    def of(self, client: Client, saga: str | None, taken: str) -> dict[str, int]:
        kept = self._kept
        if kept is not None and kept[:2] == (taken, saga):
            return kept[2]
        counted = client.count(saga=saga)
        self._kept = (taken, saga, counted)
        return counted


def runs_page(client: Client, f: Filters, kept: Counts | None = None) -> RunsPage:
    """The page of runs the filters ask for (``after``/``before``: the page after or before a
    cursor), with its counts by status (from ``kept`` while the stamp holds), its links and
    its stamp."""
    taken = stamp(client)  # before reading: a run moving meanwhile repaints at the next poll
    now = client.clock.now()
    since = now - AGES[f.age] if f.age else None
    ask: dict[str, Any] = {
        "status": f.status,
        "saga": f.saga,
        "updated_since": since,
        "limit": PAGE + 1,
        "id_prefix": f.q if f.field == "id" else None,
        "input_text": f.q if f.field == "input" else None,
    }
    runs, more_before, more_after = _window(client, f, ask)
    waits = client.store.run_waits([r for r in runs if r.status not in s.FINAL_STATUSES])
    rows = [
        Row(r, duration(r, now), waits_for(r, waits.get(r.run_id), now), pick_id(r.run_id))
        for r in runs
    ]
    counted = (kept or Counts()).of(client, f.saga, taken)
    counts = [
        (name, counted.get(name, 0), "/runs?" + f.query(status=name)) for name in s.ALL_STATUSES
    ]
    after = run_cursor(runs[-1], f.sort) if runs and more_after else None
    before = run_cursor(runs[0], _reverse(f.sort)) if runs and more_before else None
    return RunsPage(
        rows=rows,
        counts=counts,
        total=sum(counted.values()),
        next=f"/runs?{f.query(after=after)}" if after else None,
        previous=f"/runs?{f.query(before=before)}" if before else None,
        sorts={name: _sort_link(f, name) for name in ("created", "updated")},
        stamp=taken,
    )


def _window(client: Client, f: Filters, ask: dict[str, Any]) -> tuple[list[RunRecord], bool, bool]:
    """The page's runs, whether there are runs before them, and after them."""
    if f.before:  # the page before a cursor: the reverse order after it, turned back
        back = client.list(order=_reverse(f.sort), after=f.before, **ask)
        if len(back) > PAGE:
            return back[:PAGE][::-1], True, True
        f = dataclasses.replace(f, before=None)  # at the start: the first page
    runs = client.list(order=f.sort, after=f.after, **ask)
    return runs[:PAGE], f.after is not None, len(runs) > PAGE


def _reverse(order: RunOrder) -> RunOrder:
    name = order.value
    return RunOrder(name[1:] if name.startswith("-") else "-" + name)


def _sort_link(f: Filters, column: str) -> tuple[str, str]:
    """A header's link: newest first, or the other way when the page is sorted so already."""
    newest = RunOrder("-" + column)
    if f.sort == newest:
        return "/runs?" + f.query(sort=RunOrder(column)), "▼"
    return "/runs?" + f.query(sort=newest), "▲" if f.sort == RunOrder(column) else ""


def pick_id(run_id: str) -> str:
    return "pick-" + hashlib.sha256(run_id.encode()).hexdigest()[:16]


def duration(run: RunRecord, now: datetime) -> str:
    """From the run's creation to its end (its last update, when finished) or to now."""
    end = run.updated_at if run.status in s.FINAL_STATUSES else now
    seconds = max((end - run.created_at).total_seconds(), 0.0)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours} h"
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {sec} s"


def _at(when: datetime) -> str:
    return f"{when:%Y-%m-%d %H:%M:%S} UTC"


def waits_for(run: RunRecord, waits: RunWaits | None, now: datetime) -> str:
    """What an unfinished run waits for, in words, from what ``run_waits`` read ("" for
    none): its open approvals, its event waits, its steps queued or running, its sleeps and
    retries."""
    if waits is None or run.status in s.FINAL_STATUSES:
        return ""
    said: list[str] = []
    for a in waits.approvals:
        request = a.request if isinstance(a.request, dict) else {}
        args = request.get("args")
        if isinstance(args, dict):
            shown = ", ".join(f"{k}={short_json(v, 40)}" for k, v in args.items())
        else:
            shown = short_json(args, 60)
        said.append(f"approval of {request.get('action', a.call_id)}({shown})")
    timers: dict[tuple[int | None, str], Any] = {(t.pos, t.kind): t for t in waits.timers}
    for ev in waits.waits:
        names = [str(n) for n in (ev.data.get("names") or [ev.name])]
        names = [n for n in names if not (waits.approvals and n.startswith(KEY_PREFIX))]
        if not names:
            continue
        timer = timers.pop((ev.pos, "wait"), None)
        until = f" until {_at(timer.fire_at)}" if timer else ""
        said.append("event " + " or ".join(repr(n) for n in names) + until)
    for ev in waits.steps:
        what = "step" if ev.kind == "step_scheduled" else "compensation of"
        queue = ev.data.get("queue")
        said.append(f"{what} {ev.name!r}" + (f" on {queue}" if queue else ""))
    for t in sorted(timers.values(), key=lambda t: t.fire_at):
        if t.kind == "sleep":
            said.append(f"sleep until {_at(t.fire_at)}")
        elif t.kind in ("retry", "undo_retry"):
            what = "step" if t.kind == "retry" else "compensation"
            said.append(f"retry of {what} #{t.pos} (attempt {t.attempt + 1}) at {_at(t.fire_at)}")
        elif t.kind == "cancel_grace":
            said.append(f"cleanup of the cancellation until {_at(t.fire_at)}")
    if not said and run.status == s.RUNNING and run.processed_seq == 0:
        said.append("the start queue")
    return "; ".join(said)


def pending_approvals(client: Client) -> str:
    """The open approvals of the client's runs, counted up to ``FLAGGED`` ("" for none, and
    when the store cannot say: a page that tells a store error still shows)."""
    app = client.app_name if client.own_app_only else None
    try:
        n = len(client.store.open_approvals(app=app, limit=FLAGGED))
    except SagaloopError:
        return ""
    return "" if n == 0 else f"{FLAGGED - 1}+" if n >= FLAGGED else str(n)


# --- bulk actions ------------------------------------------------------------------------------


@dataclasses.dataclass
class Bulk:
    """A bulk action's form: what to do, to which runs (in the order they were ticked)."""

    action: str
    run_ids: list[str]
    reason: str
    back: str
    """The runs page the form was on (its query string)."""


class BulkRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bulk_form(body: bytes, csrf: str) -> Bulk:
    """The POSTed bulk form, once its CSRF token is checked (``run_id`` repeats)."""
    pairs = parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    fields = dict(pairs)
    if not csrf_ok(csrf, fields.get("csrf")):
        raise BulkRefused(403, "this form is not one of the console's current pages: reload it")
    action = fields.get("action", "")
    if action not in ACTIONS:
        raise BulkRefused(400, f"no bulk action {action!r}: cancel or retry")
    run_ids = list(dict.fromkeys(v for k, v in pairs if k == "run_id" and v))
    if not run_ids:
        raise BulkRefused(400, "no run is selected: tick the runs to act on")
    if len(run_ids) > BULK_MAX:
        raise BulkRefused(400, f"{len(run_ids)} runs selected: at most {BULK_MAX} at once")
    back = fields.get("back", "")
    return Bulk(action, run_ids, (fields.get("reason") or "").strip(), back)


@dataclasses.dataclass
class BulkResult:
    action: str
    done: list[str]
    refused: list[tuple[str, str]]
    """(run id, why) of each run the action refused."""
    back: str


def do_bulk(client: Client, bulk: Bulk) -> BulkResult:
    """The action on each run in turn; a run it refuses (not found, finished, not in
    ``needs_attention`` for a retry...) is told with why, the others are done."""
    done: list[str] = []
    refused: list[tuple[str, str]] = []
    for run_id in bulk.run_ids:
        try:
            if bulk.action == "cancel":
                client.cancel(run_id, bulk.reason or "cancelled in the console (bulk)")
            else:
                client.retry(run_id)
        except SagaloopError as e:
            refused.append((run_id, str(e)))
        else:
            done.append(run_id)
    return BulkResult(bulk.action, done, refused, bulk.back)


def bulk_fields(bulk: Bulk) -> Sequence[tuple[str, str]]:
    """The confirmation form's hidden fields (``run_id`` repeated)."""
    fields = [("action", bulk.action), ("reason", bulk.reason), ("back", bulk.back)]
    return fields + [("run_id", run_id) for run_id in bulk.run_ids]
