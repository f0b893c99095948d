"""A run's story as the console's run page tells it: a timeline of bars on one time axis
(each step attempt, wait, timer, compensation and child run), the steps with their inputs and
results, the compensations in the order they ran, the approvals' audit, the tree of child runs,
and the history, each paged so that a page stays bounded however long the run is.

Built from the run's events and the :class:`~sagaloop.client.timeline.Timeline` that ``sagaloop
status`` prints (positions are the Timeline's: nothing is renumbered here); plain data for
templates that only lay it out. No JavaScript: bars are inline SVG rectangles placed by
percentages (presentation attributes, which the console's CSP allows), and values expand with
``<details>``."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from sagaloop.client import Client
from sagaloop.client.timeline import StepLine, Timeline, WaitLine
from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.ports import RunRecord
from sagaloop.errors import RunNotFoundError
from sagaloop.sagas.approvals import OPEN_STATUSES, published_approvals
from sagaloop.ui.spans import Bar, bars_of, call_words, duration_words, error_words, lay_out

BARS_PAGE = 200
"""How many bars a page of the timeline shows at most."""
STEPS_PAGE = 50
"""How many steps a page of the steps table shows at most."""
HISTORY_PAGE = 100
"""How many events a page of the history shows at most."""
PREVIEW = 240
"""How many characters of a value a row shows before its ``… (N more bytes)`` marker."""
INLINE = 2000
"""Up to how many characters the page holds a whole value in its ``<details>``; a longer
one is a link to its own page (``/run/value``), so that a page stays bounded."""
SECTION_INLINE = 32_000
"""How many characters of whole values the steps of a page, and its history, hold at most:
past it, whole values are links too (a page of long values stays bounded)."""
TREE_NODES = 50
"""How many runs the tree of child runs shows at most (depth first)."""
TREE_DEPTH = 4


# --- values -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shown:
    """A JSON value as a row shows it: pretty-printed, cut at :data:`PREVIEW` characters with
    the count of what is cut (in UTF-8 bytes); the whole text when the page may hold it."""

    preview: str
    more: int
    """How many bytes the preview leaves out (0: it is the whole value)."""
    full: str | None
    """The whole value, when it is cut and short enough to sit in the page; None: follow the
    link to see it (or nothing is cut)."""


def pretty(value: Any) -> str:
    """A JSON value as indented JSON (the templates' ``pretty`` filter, and every value the
    run page shows)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


class Budget:
    """How many characters of whole values a section of a page may still hold."""

    def __init__(self, chars: int = SECTION_INLINE) -> None:
        self.left = chars

    def take(self, n: int) -> bool:
        if n > self.left:
            return False
        self.left -= n
        return True


def shown(
    value: Any, *, preview: int = PREVIEW, inline: int = INLINE, budget: Budget | None = None
) -> Shown:
    """``value`` pretty-printed and cut at a line end (else at ``preview`` characters); its
    whole text kept when it is at most ``inline`` characters and ``budget`` has room."""
    text = pretty(value)
    if len(text) <= preview:
        return Shown(text, 0, None)
    cut = text[:preview]
    if (end := cut.rfind("\n")) > preview // 2:
        cut = cut[:end]
    more = len(text.encode()) - len(cut.encode())
    keep = len(text) <= inline and (budget is None or budget.take(len(text)))
    return Shown(cut, more, text if keep else None)


def wait_words(wait: WaitLine) -> str:
    """What a wait waits for, in words: ``approval of refund(cents=1250)``, ``event
    'parcel_returned' (asks: "has the parcel come back?") until …``, ``sleep until …``."""
    until = f" until {wait.until:%Y-%m-%d %H:%M:%S} UTC" if wait.until else ""
    if wait.kind == "sleep":
        return f"sleep{until}"
    if wait.kind == "approval" and isinstance(wait.prompt, Mapping):
        return f"approval of {call_words(str(wait.prompt.get('approve')), wait.prompt.get('args'))}"
    names = " or ".join(f"'{n}'" for n in wait.events)
    asks = ""
    if wait.prompt is not None:
        text = wait.prompt if isinstance(wait.prompt, str) else json.dumps(wait.prompt)
        asks = f" (asks: {text[:120]}{'…' if len(text) > 120 else ''})"
    return f"event {names}{asks}{until}"


# --- paging -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pager:
    """One page of a list: which (1-based), of how many, and which items it holds; ``param``
    names it in the run page's address."""

    param: str
    page: int
    pages: int
    total: int
    first: int
    """The index of its first item."""
    size: int

    def rows(self, items: list[Any]) -> list[Any]:
        return items[self.first : self.first + self.size]

    @property
    def last_index(self) -> int:
        return min(self.first + self.size, self.total)


def pager(param: str, total: int, size: int, asked: str | None) -> Pager:
    """The page ``asked`` (1-based; ``last``, missing or out of range: the nearest page) of
    ``total`` items in pages of ``size``."""
    pages = max((total + size - 1) // size, 1)
    if asked == "last" or (asked and asked.isdigit() and len(asked) > 9):
        page = pages  # past any page there is
    else:
        try:
            page = int(asked or 1)
        except ValueError:
            page = 1
    page = min(max(page, 1), pages)
    return Pager(param, page, pages, total, (page - 1) * size, size)


# --- the timeline ------------------------------------------------------------------------------


@dataclasses.dataclass
class TimelinePage:
    bars: list[Bar]
    pager: Pager
    start: datetime
    end: datetime
    ticks: list[tuple[float, str]]
    """Where the axis' labels go (percent) and what they say."""


def timeline_page(bars: list[Bar], now: datetime, asked: str | None) -> TimelinePage:
    """The page ``asked`` of ``bars`` (:data:`BARS_PAGE` a page) laid on one axis: from the
    first bar's start to the last end among them (open bars end now)."""
    p = pager("tp", len(bars), BARS_PAGE, asked)
    rows = p.rows(bars)
    start, end, ticks = lay_out(rows, now)
    return TimelinePage(rows, p, start, end, ticks)


# --- steps, compensations, approvals, children ------------------------------------------------


@dataclasses.dataclass
class StepRow:
    position: int
    step: str
    state: str
    attempts: int
    duration_s: float | None
    worker: str | None
    queue: str | None
    compensation: str | None
    idempotency_key: str
    input: Shown | None
    input_seq: int | None
    result: Shown | None
    result_seq: int | None
    forkable: bool
    """Completed: a fork here runs it again with the code as it is now (``Client.fork``)."""


def step_rows(steps: list[StepLine], events: list[Event]) -> list[StepRow]:
    """The Timeline's ``steps`` (its positions) with the input each was given and its
    result, whole values within one :class:`Budget`."""
    budget = Budget()
    inputs: dict[int, tuple[int, Any]] = {}
    results: dict[int, tuple[int, Any]] = {}
    for ev in events:
        if ev.pos is None:
            continue
        if ev.kind == h.STEP_SCHEDULED:
            inputs[ev.pos] = (ev.seq, ev.data.get("args"))
        elif ev.kind == h.CHILD_STARTED:
            inputs[ev.pos] = (ev.seq, ev.data.get("input"))
        elif ev.kind in (h.STEP_COMPLETED, h.CHILD_COMPLETED):
            results[ev.pos] = (ev.seq, ev.data.get("result"))
    rows = []
    for st in steps:
        given, got = inputs.get(st.position), results.get(st.position)
        rows.append(
            StepRow(
                position=st.position,
                step=st.step,
                state=st.state,
                attempts=st.attempts,
                duration_s=st.duration_s,
                worker=st.worker,
                queue=st.queue,
                compensation=st.compensation,
                idempotency_key=st.idempotency_key,
                input=shown(given[1], budget=budget) if given else None,
                input_seq=given[0] if given else None,
                result=shown(got[1], budget=budget) if got else None,
                result_seq=got[0] if got else None,
                forkable=st.state in ("completed", "reconciled"),
            )
        )
    return rows


@dataclasses.dataclass
class CompensationRow:
    order: int
    """1 for the first compensation that began, 2 for the next..."""
    position: int
    step: str
    started: datetime
    ended: datetime | None
    attempts: int
    outcome: str
    """``compensated``, ``failed``, ``retrying`` or ``running``."""
    error: str | None

    @property
    def took(self) -> str:
        if self.ended is None:
            return "-"
        return f"{(self.ended - self.started).total_seconds():.3f} s"


def compensation_rows(events: list[Event]) -> list[CompensationRow]:
    """Each compensation, in the order they began, with its timing and outcome."""
    rows: dict[int, CompensationRow] = {}
    for ev in events:
        pos = ev.pos
        if pos is None:
            continue
        if ev.kind == h.COMPENSATION_SCHEDULED and pos not in rows:
            rows[pos] = CompensationRow(
                len(rows) + 1, pos, str(ev.name), ev.at, None, 1, "running", None
            )
        elif pos in rows and ev.kind == h.COMPENSATION_RETRYING:
            rows[pos].attempts += 1
            rows[pos].outcome = "retrying"
            rows[pos].error = error_words(ev.data.get("error"))
        elif pos in rows and ev.kind == h.COMPENSATION_COMPLETED:
            rows[pos].ended, rows[pos].outcome = ev.at, "compensated"
        elif pos in rows and ev.kind == h.COMPENSATION_FAILED:
            rows[pos].ended, rows[pos].outcome = ev.at, "failed"
            rows[pos].error = error_words(ev.data.get("error"))
    return list(rows.values())


@dataclasses.dataclass
class AuditRow:
    """A settled approval: who answered, when, what, and which arguments they changed."""

    call_id: str
    action: str
    asked_at: datetime
    status: str
    by: str | None
    answered_at: datetime | None
    reason: str | None
    edited: list[str]
    """The names of the arguments the approver changed (``*``: the arguments as a whole)."""
    edited_args: Shown | None

    @property
    def waited(self) -> str:
        if self.answered_at is None:
            return "-"
        return duration_words((self.answered_at - self.asked_at).total_seconds())


def audit_rows(published: Mapping[str, Any]) -> list[AuditRow]:
    """The settled approvals among what the run published, in the order they were asked."""
    rows = []
    for call_id, p in published_approvals(published):
        if p.status in OPEN_STATUSES:
            continue
        edited: list[str] = []
        if p.edited:
            if isinstance(p.args, Mapping) and isinstance(p.edited_args, Mapping):
                keys = dict.fromkeys([*p.args, *p.edited_args])
                edited = [k for k in keys if p.args.get(k) != p.edited_args.get(k)]
            else:
                edited = ["*"]
        rows.append(
            AuditRow(
                call_id=call_id,
                action=p.action,
                asked_at=p.requested_at,
                status=p.status,
                by=p.by,
                answered_at=p.answered_at,
                reason=p.answer_reason,
                edited=edited,
                edited_args=shown(p.edited_args) if p.edited else None,
            )
        )
    return sorted(rows, key=lambda r: r.asked_at)


@dataclasses.dataclass
class Node:
    """A run of the tree: its id, saga, status (None: not started yet) and how its parent
    started it (``call``: awaited; ``start``: fire-and-forget), with its own children."""

    run_id: str
    saga: str
    how: str
    position: int | None
    status: str | None
    children: list[Node] = dataclasses.field(default_factory=list)


def _started(events: list[Event]) -> list[tuple[int | None, str, str, str]]:
    return [
        (
            ev.pos,
            str(ev.data.get("run_id")),
            str(ev.name),
            "call" if ev.kind == h.CHILD_STARTED else "start",
        )
        for ev in events
        if ev.kind in (h.CHILD_STARTED, h.RUN_SPAWNED) and ev.data.get("run_id")
    ]


def child_tree(client: Client, events: list[Event]) -> list[Node]:
    """The runs this run started (awaited children and ``ctx.start``), and theirs, depth
    first, at most :data:`TREE_NODES` runs and :data:`TREE_DEPTH` levels."""
    budget = [TREE_NODES]

    def nodes(of: list[Event], depth: int, seen: set[str]) -> list[Node]:
        out = []
        for pos, run_id, saga, how in _started(of):
            if budget[0] <= 0 or run_id in seen:
                break
            budget[0] -= 1
            node = Node(run_id, saga, how, pos, None)
            try:
                node.status = client.get(run_id).status
                if depth < TREE_DEPTH:
                    node.children = nodes(client.history(run_id), depth + 1, seen | {run_id})
            except RunNotFoundError:
                pass  # not started yet (its start message is on its way), or another app's
            out.append(node)
        return out

    return nodes(events, 1, set())


@dataclasses.dataclass(frozen=True)
class Link:
    """A run this one comes from: its parent, who started it, or the run it was forked from."""

    how: str
    run_id: str
    position: int | None


def origins(events: list[Event]) -> list[Link]:
    started = next((e for e in events if e.kind == h.RUN_STARTED), None)
    if started is None:
        return []
    links = []
    for field, how in (("parent", "child of"), ("forked_from", "forked from")):
        value = started.data.get(field)
        if isinstance(value, Mapping) and value.get("run_id"):
            position = value.get("position")
            links.append(
                Link(how, str(value["run_id"]), position if isinstance(position, int) else None)
            )
    by = started.data.get("started_by")
    if isinstance(by, str) and by:
        links.append(Link("started by", by, None))
    return links


# --- the history ------------------------------------------------------------------------------


@dataclasses.dataclass
class HistoryRow:
    seq: int
    at: datetime
    kind: str
    name: str | None
    pos: int | None
    data: Shown


# --- the whole story ---------------------------------------------------------------------------


@dataclasses.dataclass
class Story:
    timeline: TimelinePage
    steps: list[StepRow]
    steps_pager: Pager
    compensations: list[CompensationRow]
    audit: list[AuditRow]
    children: list[Node]
    origins: list[Link]
    waits: list[str]
    """What the run waits for, in words."""
    history: list[HistoryRow]
    history_pager: Pager
    pages: dict[str, str]
    """The pages asked of each list (``tp``, ``sp``, ``hp``): kept by the live region."""
    forkable: bool
    """Whether the console may fork (its client has the App)."""

    def query(self, **changes: str) -> str:
        """The run page's query with ``changes`` to the pages asked."""
        return urlencode({**self.pages, **changes})


def story(
    client: Client,
    run: RunRecord,
    events: list[Event],
    tl: Timeline,
    now: datetime,
    pages: Mapping[str, str | None],
) -> Story:
    """The story of ``run`` for its page; ``pages``: the page asked of the timeline (``tp``),
    the steps (``sp``) and the history (``hp``), 1-based or ``last``."""
    asked = {k: str(v) for k, v in pages.items() if k in ("tp", "sp", "hp") and v}
    sp = pager("sp", len(tl.steps), STEPS_PAGE, asked.get("sp"))
    hp = pager("hp", len(events), HISTORY_PAGE, asked.get("hp"))
    budget = Budget()
    history = [
        HistoryRow(e.seq, e.at, e.kind, e.name, e.pos, shown(e.data, budget=budget))
        for e in hp.rows(events)
    ]
    return Story(
        timeline=timeline_page(bars_of(events), now, asked.get("tp")),
        steps=step_rows(sp.rows(tl.steps), events),
        steps_pager=sp,
        compensations=compensation_rows(events),
        audit=audit_rows(tl.published),
        children=child_tree(client, events),
        origins=origins(events),
        waits=[wait_words(w) for w in tl.waits],
        history=history,
        history_pager=hp,
        pages={"id": run.run_id, **asked},
        forkable=client.app is not None,
    )


def event_of(client: Client, run_id: str, seq: int) -> Event | None:
    """The event ``seq`` of run ``run_id`` (its whole data for ``/run/value``), if it has it."""
    return next((ev for ev in client.history(run_id) if ev.seq == seq), None)


def history_document(client: Client, run_id: str) -> dict[str, Any]:
    """The run's whole history as ``sagaloop export RUN_ID`` writes it (the same function:
    :func:`sagaloop.testing.histories.history_document`), which ``sagaloop replay`` reads."""
    from sagaloop.testing.histories import history_document as document  # only when asked

    run = client.get(run_id)  # first: the history read next is at least as new
    return document(run, client.history(run_id))


def file_name(run_id: str) -> str:
    """The name a downloaded history is saved under: the run id, made safe for a header
    and a file system, and ``.json``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id)[:80].strip("._") or "run"
    return f"{safe}.history.json"
