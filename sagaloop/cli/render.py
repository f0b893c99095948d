"""Rendering of timelines, run lists and the other tables for terminals: in colour (rich) when
stdout is a terminal, plain text when it is not (a pipe, a file, a test) or NO_COLOR is set."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: ``sagaloop --help`` loads none of the client nor store
    from sagaloop.client.timeline import Timeline
    from sagaloop.engine.history import Event
    from sagaloop.engine.ports import Debounced, RunRecord

STYLES = {
    **dict.fromkeys(("completed", "reconciled", "compensated", "ok", "yes", "approved"), "green"),
    **dict.fromkeys(("running", "waiting", "scheduled", "pending"), "cyan"),
    **dict.fromkeys(("retrying", "compensating", "in doubt", "escalated", "stale"), "yellow"),
    "cancelling": "yellow",
    **dict.fromkeys(("failed", "needs_attention", "in doubt (halted)", "no", "denied"), "bold red"),
    **dict.fromkeys(("compensation failed", "down"), "bold red"),
    "cancelled": "magenta",
}
"""The colour of a table cell that holds one of these words: statuses, states, answers."""


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What a terminal acts on instead of showing: C0 controls (ESC starts CSI and OSC sequences),
DEL, C1 controls (U+009B is a CSI of its own), and the marks, embeddings, overrides and
isolates of bidirectional text, which reorder what is shown around them."""
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str, *, newlines: bool = False) -> str:
    """``text`` (run data: an error, a model's reason, an id, streamed text) fit for a
    terminal: every control character and bidi control shown as its escape (``\\x1b``,
    ``\\u202e``, ``\\n``), so no run can move the cursor, rewrite a line, set the window title
    or reorder what an operator reads. ``newlines`` keeps line breaks (a traceback's). The one
    function for it: every human-readable output of the CLI goes through it."""

    def escape(found: re.Match[str]) -> str:
        char = found.group()
        if char == "\n" and newlines:
            return char
        code = ord(char)
        return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")

    return _UNPRINTABLE.sub(escape, text)


def in_colour() -> bool:
    """Whether to draw tables with rich: stdout is a terminal, NO_COLOR (https://no-color.org)
    is unset or empty, and the terminal is not ``dumb``."""
    isatty = getattr(sys.stdout, "isatty", None)
    return (
        not os.environ.get("NO_COLOR")
        and os.environ.get("TERM") != "dumb"
        and callable(isatty)
        and bool(isatty())
    )


def _style(cell: str) -> str | None:
    return STYLES.get(cell) or ("bold red" if cell.startswith("error") else None)


def _rich(table: Any) -> str:
    """``table`` (a rich renderable) drawn in colour, for a terminal as wide as this one."""
    from rich.console import Console

    out = io.StringIO()
    width = shutil.get_terminal_size((120, 24)).columns
    Console(file=out, force_terminal=True, width=width, highlight=False).print(table)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    return "\n".join(lines).strip("\n")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns under their headers: plain, or drawn by rich where :func:`in_colour`. Each cell
    is shown :func:`printable`."""
    rows = [[printable(cell) for cell in row] for row in rows]
    if in_colour():
        from rich import box
        from rich.table import Table
        from rich.text import Text

        table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*(Text(cell, style=_style(cell) or "") for cell in row))
        return _rich(table)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*headers), line.format(*("-" * w for w in widths))]
    out += [line.format(*row) for row in rows]
    return "\n".join(x.rstrip() for x in out)


def pairs_text(rows: Sequence[tuple[str, str | None]]) -> str:
    """Names and values in two columns (``health``); a row without a value is a line of its
    own, under the row before it. Names and values are shown :func:`printable`."""
    rows = [(printable(name), None if value is None else printable(value)) for name, value in rows]
    if in_colour():
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 2, 0, 0))
        table.add_column(style="bold")
        table.add_column(overflow="fold")
        for name, value in rows:
            if value is None:
                table.add_row("", Text(name.strip()))
            else:
                table.add_row(name, Text(value, style=_style(value) or ""))
        return _rich(table)
    width = max((len(name) for name, value in rows if value is not None), default=0) + 2
    return "\n".join(name if value is None else f"{name:<{width}}{value}" for name, value in rows)


def short_json(value: Any, limit: int = 200) -> str:
    """:func:`sagaloop.client.timeline.short_json`, imported when first used: the client's
    package loads the store (SQLAlchemy), which ``sagaloop --help`` does without."""
    from sagaloop.client.timeline import short_json

    return short_json(value, limit)


def _t(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def timeline_text(tl: Timeline) -> str:
    head = [
        f"run       {printable(tl.run_id)}",
        f"saga      {printable(tl.saga)}",
        f"status    {printable(tl.status)}",
        f"started   {_t(tl.created_at)} UTC    updated {_t(tl.updated_at)} UTC",
    ]
    if tl.reason:
        head.append(f"reason    {printable(tl.reason)}")
    if tl.cancel_reason is not None:
        head.append(f"cancel    requested: {printable(str(tl.cancel_reason))}")
    rows = _command_rows(tl)
    parts = ["\n".join(head)]
    if rows:
        headers = ["#", "command", "state", "tries", "took", "worker", "undo", "idempotency key"]
        parts.append(text_table(headers, rows))
    errors = [
        f"  #{s.position} {printable(s.step)}: {printable(s.error)}"
        + (f"\n{_indent(s.traceback)}" if s.traceback else "")
        for s in tl.steps
        if s.error
    ]
    if errors:
        parts.append("last errors:\n" + "\n".join(errors))
    if tl.waiting_for:
        why = "\n".join(f"  - {printable(_why(w))}" for w in tl.waiting_for)
        parts.append(f"why it waits:\n{why}")
    if tl.refused:  # the last few, with why: the sender sees what became of a bad event
        shown_refused = [
            f"  - {printable(repr(r.name))}"
            + (f" (wait #{r.position})" if r.position is not None else "")
            + f": {printable(r.reason[:300])}"
            for r in tl.refused[-5:]
        ]
        last = f" (the last 5 of {len(tl.refused)})" if len(tl.refused) > 5 else ""
        parts.append(f"events refused{last}:\n" + "\n".join(shown_refused))
    if tl.abandoned:
        lines = [
            f"  - step {a.get('step')!r} (#{a.get('position')}, attempt {a.get('attempt')}) on "
            f"{a.get('process')} since {a.get('since')}"
            for a in tl.abandoned
        ]
        parts.append(
            "still running past its timeout (abandoned: its outcome is dropped when it ends):\n"
            + printable("\n".join(lines), newlines=True)
        )
    asked = [w for w in tl.waits if w.kind == "approval" and isinstance(w.prompt, dict)]
    if asked:
        parts.append(
            "approvals asked:\n" + "\n".join(_approval(w.events[0], w.prompt) for w in asked)
        )
    shown = {k: v for k, v in tl.published.items() if k not in {w.events[0] for w in asked}}
    if shown:
        values = [f"  {printable(key)} = {_value(value)}" for key, value in sorted(shown.items())]
        parts.append("published:\n" + "\n".join(values))
    if tl.status == "completed":
        parts.append("output: " + _value(tl.output, indent=""))
    elif tl.error:
        error = printable(f"error: {tl.error.get('type')}: {tl.error.get('message')}")
        trace = tl.error.get("traceback")
        parts.append(error + (f"\n{_indent(str(trace))}" if trace else ""))
    return "\n\n".join(parts)


LINE_VALUE = 100
"""A value whose JSON is this long or shorter is shown on one line; a longer one is
pretty-printed, cut at :data:`STATUS_VALUE` characters of JSON."""
STATUS_VALUE = 600


def _value(value: Any, indent: str = "    ") -> str:
    """A published value or an output for ``status``: its JSON on one line when short, else
    pretty-printed from there (each next line after ``indent``), cut at a value's edge with
    ``… (+N chars)`` past :data:`STATUS_VALUE` characters (``--json`` has it whole)."""
    from sagaloop.client.values import clip_json

    line = clip_json(value, LINE_VALUE)
    if len(line) <= LINE_VALUE and "… (+" not in line:
        return printable(line)
    first, *rest = clip_json(value, STATUS_VALUE, indent=2).splitlines()
    return "\n".join([printable(first), *(indent + printable(x) for x in rest)])


def _command_rows(tl: Timeline) -> list[list[str]]:
    """A row per command of ``tl`` by position (a position skipped in this table is one no
    command holds): a step with its attempts, duration, worker, undo and key; a wait, sleep,
    publish or approval by what it names (a timeline made without its commands: its steps)."""
    steps = {s.position: s for s in tl.steps}
    positions = [c.position for c in tl.commands] or sorted(steps)
    commands = {c.position: c for c in tl.commands}
    rows = []
    for position in positions:
        x, c = steps.get(position), commands.get(position)
        if x is not None:
            rows.append(
                [
                    str(x.position),
                    x.step,
                    x.state,
                    str(x.attempts),
                    f"{x.duration_s:.3f} s" if x.duration_s is not None else "-",
                    x.worker or "-",
                    x.compensation or "-",
                    x.idempotency_key,
                ]
            )
        elif c is not None:
            what = f"{c.command} {c.name!r}" if c.name else c.command
            rows.append([str(c.position), what, c.state, "-", "-", "-", "-", "-"])
    return rows


def _why(line: str) -> str:
    """A line of "why it waits"; an approval's without the request, shown below it."""
    from sagaloop.sagas.approvals import KEY_PREFIX

    if line.startswith(f"waiting for event '{KEY_PREFIX}"):
        return line.split(", asking ", 1)[0] + " (the approval below)"
    return line


def _approval(event: str, request: dict[str, Any]) -> str:
    """What an approval asks, and how to answer it."""
    from sagaloop.sagas.approvals import KEY_PREFIX

    call_id = printable(event.removeprefix(KEY_PREFIX))
    args = printable(short_json(request.get("args"), 100))
    why = f": {printable(str(request['reason']))}" if request.get("reason") else ""
    status = printable(str(request.get("status") or "pending"))
    return (
        f"  {call_id}: {printable(str(request.get('approve')))} {args} ({status}){why}\n"
        f"    answer: {printable(str(request.get('answer')))}"
    )


def _indent(text: str, by: str = "      ") -> str:
    """A stored traceback, indented under the error it belongs to (:func:`printable`)."""
    return "\n".join(by + printable(line) for line in text.splitlines())


def runs_text(runs: Sequence[RunRecord], counts: dict[str, int]) -> str:
    rows = [[r.run_id, r.app, r.saga, r.status, _t(r.created_at), _t(r.updated_at)] for r in runs]
    table = text_table(["run", "app", "saga", "status", "started (UTC)", "updated (UTC)"], rows)
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no runs"
    summary = printable(summary)
    return f"{table}\n\n{summary} (total {sum(counts.values())})"


def pending_text(windows: Sequence[Debounced]) -> str:
    """The debounced starts not yet started (``sagaloop list``): one row per window."""
    rows = [
        [w.run_id, w.app, w.saga, w.key, str(w.starts), _t(w.first_at), _t(w.due_at)]
        for w in windows
    ]
    head = ["run (not started)", "app", "saga", "key", "starts", "first (UTC)", "due (UTC)"]
    return f"pending debounced starts:\n{text_table(head, rows)}"


VALUE_LIMIT = 200
"""The characters of JSON a value may take in a line of ``tail`` before it is cut (with
``… (+N chars)``: :func:`sagaloop.client.values.clip_json`)."""


class TailLines:
    """The lines of ``sagaloop tail``, one per item: a history event numbered by its command's
    position (``#3``, as ``status`` and ``fork --at`` number it; an event of no command, such
    as an event arriving, has none), or an item a step streamed live (``~ step: text``). A
    step's call reads ``name(args)`` and its outcome ``name -> result``; an agent's model
    request reads as what it sends anew and its answer (text, ``tool call name(args)``, ``tool
    result name: text``), as the console's transcript reads them
    (:func:`sagaloop.ui.transcript.requests_of`; without the ``ui`` extra, as any step). Every
    line is :func:`printable`: one item, one line."""

    def __init__(self) -> None:
        self.requests: dict[int, tuple[str, list[Event]]] = {}
        """Each model request's conversation and events so far, by position."""
        self.answered: dict[str, list[Event]] = {}
        """The events of each conversation's last answered request (what the next sends
        back is not shown again)."""
        self.systems: set[str] = set()
        """The instructions shown already (frameworks send them with every request)."""
        self.results: collections.deque[Event] = collections.deque(maxlen=64)
        """The last results of other steps (tools'): a request names their long strings by
        digest, as its transcript stores a tool's result once."""

    def line(self, item: dict[str, Any]) -> str:
        if item.get("source") != "history":
            data = item.get("data")
            text = data.get("text") if isinstance(data, dict) else None
            shown = text if isinstance(text, str) else short_json(data, VALUE_LIMIT)
            return printable(f"~ {item.get('step')}: {shown}")
        pos, kind, name = item.get("position"), str(item.get("kind")), item.get("name")
        data = item.get("data")
        data = data if isinstance(data, dict) else {}
        head = f"#{pos} " if isinstance(pos, int) else ""
        model = self._model(item, pos, kind, data) if isinstance(pos, int) else None
        return printable(head + (model or _event(kind, name, data)))

    def _model(self, item: dict[str, Any], pos: int, kind: str, data: dict[str, Any]) -> str | None:
        """The line of a model request's event (scheduled or completed), else None."""
        if kind not in (STEP_SCHEDULED, STEP_COMPLETED):
            return None
        requests_of = _requests_of()
        if requests_of is None:
            return None
        from sagaloop.engine.history import Event  # the engine's record: light, no I/O

        at = item.get("at") or datetime.fromtimestamp(0, UTC)
        ev = Event(int(item.get("seq") or 0), kind, at, pos, item.get("name"), data)
        if kind == STEP_SCHEDULED:
            alone = requests_of([ev])
            if not alone:
                return None  # a step that is not a model request
            conversation = alone[0].conversation
            answered = self.answered.get(conversation, [])
            request = requests_of([*answered, *self.results, ev])[-1]
            self.requests[pos] = (conversation, [ev])
            return f"model request {ev.name}: {_parts(self._sent(request.new))}"
        if pos not in self.requests:
            self.results.append(ev)
            return None
        conversation, events = self.requests.pop(pos)
        events.append(ev)
        self.answered[conversation] = events
        answer = requests_of(events)[-1].response
        return f"model answer {ev.name}: {_parts(answer)}"

    def _sent(self, parts: list[Any]) -> list[Any]:
        """What a model request sends that no line showed yet: the user's words, tool results
        and instructions the first time; not what the model said before (its answer's line
        showed it), which frameworks send back with every request."""
        out = []
        for part in parts:
            if part.kind in ("assistant", "tool call", "thinking"):
                continue
            if part.kind == "system":
                if part.text in self.systems:
                    continue
                self.systems.add(part.text)
            out.append(part)
        return out


STEP_SCHEDULED, STEP_COMPLETED = "step_scheduled", "step_completed"


def _requests_of() -> Callable[[list[Event]], list[Any]] | None:
    """:func:`sagaloop.ui.transcript.requests_of`, or None without the ``ui`` extra."""
    try:
        from sagaloop.ui.transcript import requests_of
    except ImportError:  # the console's dependencies are not installed
        return None
    return requests_of


def _event(kind: str, name: Any, data: dict[str, Any]) -> str:
    """A history event other than a model request's: a step's call and result, or ``kind
    name {data}``."""
    if kind == STEP_SCHEDULED:
        return f"call {name}({_args(_tool_args(data.get('args')))})"
    if kind == STEP_COMPLETED:
        return f"{name} -> {short_json(data.get('result'), VALUE_LIMIT)}"
    what = f"{kind} {name}" if name else kind
    return f"{what} {short_json(data, VALUE_LIMIT)}" if data else what


def _tool_args(args: Any) -> Any:
    """An agent's tool step's arguments (``{"call": {"args": ..., "context": ...}}``): the
    tool's own, without the run context; any other step's as they are."""
    call = args.get("call") if isinstance(args, dict) and len(args) == 1 else None
    if isinstance(call, dict) and "context" in call and isinstance(call.get("args"), dict):
        return call["args"]
    return args


def _args(args: Any) -> str:
    """A call's arguments (``{"name": value}``) as ``name=value, ...``, each value's JSON cut
    at a value's edge."""
    if not isinstance(args, dict) or not args:
        return "" if args in (None, {}, []) else short_json(args, VALUE_LIMIT)
    each = max(VALUE_LIMIT // len(args), 40)
    return ", ".join(f"{k}={short_json(v, each)}" for k, v in args.items())


def _parts(parts: Sequence[Any]) -> str:
    """Transcript parts in one line: ``user: text``, ``tool call name(args)``, ``tool result
    name: text``, ``assistant: text``; each text cut to the limit."""
    shown = []
    for p in parts:
        text = _cut(" ".join(p.text.split()))
        if p.kind in ("tool call", "other"):  # JSON (indented by the parser): compact, cut
            with contextlib.suppress(ValueError):
                text = short_json(json.loads(p.text), VALUE_LIMIT)
        if p.kind == "tool call":
            shown.append(f"tool call {p.label}({text})")
        elif p.kind == "tool result":
            shown.append(f"tool result {p.label}: {text}" if p.label else f"tool result: {text}")
        else:
            shown.append(f"{p.kind}: {text}")
    return " | ".join(shown) or "-"


def _cut(text: str) -> str:
    """``text`` within :data:`VALUE_LIMIT` characters, cut at a word's end with a marker."""
    if len(text) <= VALUE_LIMIT:
        return text
    kept = text[:VALUE_LIMIT].rsplit(" ", 1)[0] if " " in text[:VALUE_LIMIT] else text[:VALUE_LIMIT]
    return f"{kept} … (+{len(text) - len(kept)} chars)"


def stream_line(item: dict[str, Any]) -> str:
    """One line of ``sagaloop tail`` for ``item`` alone (:class:`TailLines` keeps what reads
    a model request's answer as one)."""
    return TailLines().line(item)
