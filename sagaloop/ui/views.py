"""What the console's pages show, read through :class:`~sagaloop.Client` and built from the
same :class:`~sagaloop.client.timeline.Timeline` that ``sagaloop status`` prints: plain data
for templates that only lay it out."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sagaloop.agents.budgets import USAGE_KEY
from sagaloop.brokers.dead_letters import DeadLetter as BrokerDeadLetter
from sagaloop.client import Client
from sagaloop.client.serving import served
from sagaloop.client.timeline import Timeline, timeline
from sagaloop.engine import answers
from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import Event
from sagaloop.engine.ports import ApprovalRow, RunRecord
from sagaloop.sagas.approvals import (
    KEY_PREFIX,
    OPEN_STATUSES,
    ApprovalRequest,
    approval_key,
    call_id_of,
    published_approvals,
)
from sagaloop.ui.story import Story, pretty, story, wait_words
from sagaloop.ui.transcript import Request, requests_of

USAGE_FIELDS = ("requests", "input_tokens", "output_tokens", "tool_calls", "cost")


def when(value: datetime | None) -> str:
    """A stored time as the CLI shows it (UTC)."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def version(*parts: Any) -> str:
    """A short fingerprint of what a live region shows: it is sent again only when it moved."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


# --- runs ----------------------------------------------------------------------------------


APPROVALS_PAGE = 50
"""How many approvals a page of the console shows."""


# --- one run -------------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    """An attempt that failed, with where (a step's attempt, or a compensation's)."""

    seq: int
    at: datetime
    what: str
    type: str
    message: str
    traceback: str | None
    causes: list[dict[str, Any]]


@dataclasses.dataclass
class UsageLine:
    name: str
    used: Any
    limit: Any


@dataclasses.dataclass
class RunView:
    run: RunRecord
    tl: Timeline
    final: bool
    why: list[str]
    """Why it waits (the timeline's), an approval's line without what the page shows below."""
    failures: dict[int, list[Failure]]
    """The failed attempts of each step (and of its compensation), by position."""
    approvals: list[ApprovalCard]
    """Every approval the run asked, in the order it asked them."""
    published: dict[str, Any]
    """What the run published, less its approvals (shown as approvals) and its agent usage."""
    usage: list[UsageLine]
    budget: dict[str, Any] | None
    requests: int
    """How many model requests its history holds (an agent run: it has a transcript)."""
    story: Story
    """Its timeline, steps with inputs and results, compensations, approvals' audit, child
    runs and history, each paged (:mod:`sagaloop.ui.story`)."""
    version: str


def run_version(client: Client, run: RunRecord) -> str:
    """What changes whenever the run moves, or an answer wins one of its approvals (before
    the engine records it): its page is sent again only then."""
    claims = []
    if run.status not in s.FINAL_STATUSES:
        rows = client.store.open_approvals(app=None, run_id=run.run_id, limit=1000)
        claims = [(r.call_id, r.answer_id) for r in rows if r.answer_id is not None]
    return version(run.run_id, run.status, run.last_seq, run.processed_seq, run.updated_at, claims)


def run_view(client: Client, run_id: str, pages: dict[str, str] | None = None) -> RunView:
    """The run page of ``run_id``; ``pages``: which page of its timeline, steps and history
    to show (``tp``, ``sp``, ``hp``: see :func:`sagaloop.ui.story.story`)."""
    run = client.get(run_id)  # first: the history read next is at least as new as its version
    events = client.history(run_id)
    now = client.clock.now()
    tl = served(timeline(run, events, now), run.app, client.store, now)  # nothing waits unseen
    final = run.status in s.FINAL_STATUSES
    approvals = _run_approvals(client, run, tl)
    usage_value = tl.published.get(USAGE_KEY)
    usage, budget = _usage(usage_value)
    published = {
        key: value
        for key, value in tl.published.items()
        if call_id_of(key) is None and key != USAGE_KEY
    }
    return RunView(
        run=run,
        tl=tl,
        final=final,
        why=[_why_line(line, tl) for line in tl.waiting_for],
        failures=_failures(events),
        approvals=approvals,
        published=published,
        usage=usage,
        budget=budget,
        requests=len(requests_of(events)),
        story=story(client, run, events, tl, now, pages or {}),
        version=run_version(client, run),
    )


@dataclasses.dataclass
class ApprovalCard:
    """An approval as the console shows it: open (with buttons), answered (an answer won it,
    which the engine has not recorded yet: no buttons), or settled (its outcome)."""

    run_id: str
    saga: str
    call_id: str
    request: ApprovalRequest
    answer: dict[str, Any] | None
    """What the answer that won an open approval said (``approved``, ``by``, ``at``), while
    the engine has not recorded it yet (the approvals index's claim)."""
    refused: str | None
    """Why the last answer was refused, if one was."""
    answerable: bool
    """The run still runs: an open, unanswered approval gets buttons."""
    cursor: str = ""

    @property
    def open(self) -> bool:
        return self.request.status in OPEN_STATUSES

    @property
    def state(self) -> str:
        """``answered`` (awaiting the engine), else the request's status."""
        return "answered" if self.open and self.answer is not None else self.request.status

    @property
    def buttons(self) -> bool:
        return self.answerable and self.state in OPEN_STATUSES


def approval_card(row: ApprovalRow) -> ApprovalCard | None:
    """The card of an approval of the approvals index, or None if its request is unreadable."""
    p = answers.pending(row)
    if p is None:
        return None
    return ApprovalCard(
        run_id=row.run_id,
        saga=row.saga,
        call_id=row.call_id,
        request=ApprovalRequest.model_validate(row.request),
        answer=row.answer if row.answer_id is not None else None,
        refused=p.last_refused,
        answerable=True,
        cursor=p.cursor,
    )


def _run_approvals(client: Client, run: RunRecord, tl: Timeline) -> list[ApprovalCard]:
    """The approvals the run published, each with the answer that won it meanwhile (read from
    the index) while it is open, and why its last answer was refused."""
    cards = []
    final = run.status in s.FINAL_STATUSES
    for call_id, request in published_approvals(tl.published):
        answer = None
        if request.status in OPEN_STATUSES and not final:
            row = client.store.approval(None, run.run_id, call_id)
            if row is not None and row.answer_id is not None and row.status in OPEN_STATUSES:
                answer = row.answer or {}
        refused = [r.reason for r in tl.refused if r.name == approval_key(call_id)]
        cards.append(
            ApprovalCard(
                run_id=run.run_id,
                saga=run.saga,
                call_id=call_id,
                request=request,
                answer=answer,
                refused=request.last_refused or (refused[-1] if refused else None),
                answerable=not final,
            )
        )
    return sorted(cards, key=lambda c: c.request.requested_at)


def _why_line(line: str, tl: Timeline) -> str:
    """A line of why the run waits, an approval's in words: "waiting for approval of
    refund(cents=1250) (the approval below)", not the internal event name."""
    if line.startswith(f"waiting for event '{KEY_PREFIX}") and ", asking " in line:
        name = line.removeprefix("waiting for event '").split("'", 1)[0]
        wait = next((w for w in tl.waits if w.kind == "approval" and w.events == [name]), None)
        if wait is not None:
            return f"waiting for {wait_words(wait)} (the approval below)"
        return line.split(", asking ", 1)[0] + " (the approval below)"
    return line


def _failures(events: list[Event]) -> dict[int, list[Failure]]:
    found: dict[int, list[Failure]] = {}
    attempts: dict[int, int] = {}
    for ev in events:
        if ev.pos is None:
            continue
        if ev.kind == h.STEP_SCHEDULED:
            attempts[ev.pos] = 1
        elif ev.kind == h.STEP_DISPATCHED:
            attempts[ev.pos] = int(ev.data.get("attempt") or attempts.get(ev.pos, 1))
        error = ev.data.get("error")
        if ev.kind in (h.STEP_RETRYING, h.STEP_FAILED, h.STEP_HALTED) and error:
            what = f"attempt {attempts.get(ev.pos, 1)}"
        elif ev.kind in (h.COMPENSATION_RETRYING, h.COMPENSATION_FAILED) and error:
            what = "compensation"
        else:
            continue
        if not isinstance(error, dict):
            error = {"type": "error", "message": str(error)}
        found.setdefault(ev.pos, []).append(
            Failure(
                seq=ev.seq,
                at=ev.at,
                what=what,
                type=str(error.get("type")),
                message=str(error.get("message")),
                traceback=error.get("traceback"),
                causes=[c for c in error.get("causes") or [] if isinstance(c, dict)],
            )
        )
    return found


def _usage(value: Any) -> tuple[list[UsageLine], dict[str, Any] | None]:
    if not isinstance(value, dict):
        return [], None
    budget = value.get("budget") if isinstance(value.get("budget"), dict) else None
    lines = [
        UsageLine(name, value.get(name), (budget or {}).get(name))
        for name in USAGE_FIELDS
        if name in value
    ]
    return lines, budget


# --- a run's transcript ---------------------------------------------------------------------


@dataclasses.dataclass
class TranscriptView:
    run: RunRecord
    requests: list[Request]
    usage: list[UsageLine]
    budget: dict[str, Any] | None
    version: str


def transcript_view(client: Client, run_id: str) -> TranscriptView:
    run = client.get(run_id)
    events = client.history(run_id)
    usage, budget = _usage(client.get_published(run_id, USAGE_KEY))
    return TranscriptView(run, requests_of(events), usage, budget, run_version(client, run))


# --- dead letters ----------------------------------------------------------------------------


DEAD_LETTERS_PAGE = 500
"""How many dead letters the console shows (``sagaloop dead-letters list --limit`` shows more)."""


@dataclasses.dataclass
class DeadLetter:
    id: str | None
    """Its id for ``sagaloop dead-letters show/resend ID`` (None: the database's table)."""
    queue: str
    reason: str
    at: datetime | None
    body: str
    run_id: str | None
    type: str | None


def dead_letters(
    client: Client, read: Callable[[int], list[BrokerDeadLetter]] | None = None
) -> list[DeadLetter]:
    """The dead letters of the broker in use, oldest first, bodies shown as JSON: those
    ``read`` returns (RabbitMQ's queue ``<namespace>.dead``, say), else the database broker's
    table."""
    if read is not None:
        return [
            DeadLetter(
                d.id,
                d.queue,
                d.reason,
                d.at,
                _body(d.body, d.document),
                d.run_id,
                d.message_type,
            )
            for d in read(DEAD_LETTERS_PAGE)
        ]
    out = []
    for queue, body, reason in client.store.dead_letters()[:DEAD_LETTERS_PAGE]:
        try:
            parsed: Any = json.loads(body)
        except (ValueError, RecursionError):
            parsed = None
        run_id, kind = (
            (parsed.get("run_id"), parsed.get("type")) if isinstance(parsed, dict) else (None, None)
        )
        out.append(
            DeadLetter(
                None,
                queue,
                reason,
                None,
                _body(body, parsed),
                run_id if isinstance(run_id, str) else None,
                kind if isinstance(kind, str) else None,
            )
        )
    return out


def _body(body: bytes, parsed: Any) -> str:
    if isinstance(parsed, dict):
        return pretty(parsed)
    return body[:2000].decode("utf-8", errors="replace")
