"""How an exception is stored as text (``ErrorInfo.from_exception``): its message and causes cut
to a storable size, and its traceback as Python prints it, each run of frameworks' and
sagaloop's frames folded into one line, from the first frame of the user's code that sagaloop
called."""

from __future__ import annotations

import sys
import traceback as tb
from collections.abc import Collection
from types import CodeType, FrameType, TracebackType

FOLDED_PACKAGES = frozenset(
    {
        "sagaloop",
        "pydantic_ai",
        "pydantic_graph",
        "pydantic_evals",
        "pydantic",
        "pydantic_core",
        "agents",
        "openai",
        "anthropic",
        "httpx",
        "httpcore",
        "h11",
        "h2",
        "anyio",
        "sniffio",
        "mcp",
        "opentelemetry",
        "logfire",
        "griffe",
        "tenacity",
        "typing_extensions",
    }
)
"""Packages whose frames a stored traceback folds into one line (with the standard library's):
the frameworks around an agent and sagaloop itself, so that the user's own frames are what
it shows. The full traceback is in the log at DEBUG (``-v``)."""


def _package_of(frame: FrameType) -> str | None:
    """The package a frame belongs to when it is folded; None for the user's own code."""
    module = frame.f_globals.get("__name__")
    if not isinstance(module, str):
        return None
    top = module.partition(".")[0]
    if top in FOLDED_PACKAGES or top in sys.stdlib_module_names:
        return top
    return None


def _frame_lines(trace: TracebackType | None) -> list[str]:
    """The frames of ``trace``, each run of folded frames as one ``... N frames of ...``
    line; the innermost frame (where it was raised) shown unless it is sagaloop's."""
    frames = list(tb.walk_tb(trace))
    out: list[str] = []
    folded: list[str] = []

    def fold() -> None:
        if folded:
            names = ", ".join(dict.fromkeys(folded))
            count = f"{len(folded)} frame{'s' if len(folded) > 1 else ''}"
            out.append(f"  ... {count} of {names} ...")
            folded.clear()

    for i, (frame, lineno) in enumerate(frames):
        package = _package_of(frame)
        if package is not None and (i < len(frames) - 1 or package == "sagaloop"):
            folded.append(package)
            continue
        fold()
        summary = tb.StackSummary.extract([(frame, lineno)], capture_locals=False)
        out += "".join(summary.format()).rstrip("\n").splitlines()
    fold()
    return out


_FOLLOWING = "the following exception:"


def folded(
    exc: BaseException, trace: TracebackType | None, seen: set[int], max_causes: int
) -> list[str]:
    """``exc`` formatted as Python does (its cause or context first, ``max_causes`` of them),
    frames folded."""
    seen.add(id(exc))
    lines: list[str] = []
    cause, context = exc.__cause__, None if exc.__suppress_context__ else exc.__context__
    if len(seen) <= max_causes:
        if cause is not None and id(cause) not in seen:
            lines += folded(cause, cause.__traceback__, seen, max_causes)
            lines += ["", f"The above exception was the direct cause of {_FOLLOWING}", ""]
        elif context is not None and id(context) not in seen:
            lines += folded(context, context.__traceback__, seen, max_causes)
            lines += ["", "During handling of the above exception, another exception occurred:", ""]
    if trace is not None:
        lines += ["Traceback (most recent call last):", *_frame_lines(trace)]
    lines += "".join(tb.format_exception_only(type(exc), exc)).rstrip("\n").splitlines()
    return lines


def frames_from(trace: TracebackType | None, called: Collection[CodeType]) -> TracebackType | None:
    """``trace`` from its first frame that runs one of ``called`` (all of it if none does)."""
    at = trace
    while called and at is not None:
        if at.tb_frame.f_code in called:
            return at
        at = at.tb_next
    return trace


# --- an exception as stored text (ErrorInfo.from_exception) ----------------------------------


def message_of(exc: BaseException, name: str) -> str:
    """``str(exc)``, or a placeholder when its ``__str__`` raises (``name``: its type's)."""
    try:
        return str(exc)
    except BaseException as e:  # a __str__ that raises: user code, whatever it raises
        return f"<the message of this {name} could not be read: {type(e).__name__}>"


MAX_CAUSES = 5


def causes_of(exc: BaseException) -> list[tuple[str, str]]:
    """The type and message of each exception in ``exc``'s cause chain, ``MAX_CAUSES`` at most."""
    out: list[tuple[str, str]] = []
    seen = {id(exc)}
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    while cause is not None and id(cause) not in seen and len(out) < MAX_CAUSES:
        seen.add(id(cause))
        name = storable(type(cause).__name__, 200)
        out.append((name, storable(message_of(cause, name), 1000)))
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    return out


def traceback_text(exc: BaseException, called: Collection[CodeType], limit: int) -> str | None:
    """``exc``'s traceback as :func:`folded` lays it out, from the first frame running one of
    ``called``, its end kept within ``limit`` characters; None if it cannot be formatted."""
    try:
        start = frames_from(exc.__traceback__, called)
        lines = folded(exc, start, set(), MAX_CAUSES)
    except BaseException:
        return None
    text = "\n".join(line if len(line) <= 300 else f"{line[:300]}..." for line in lines)
    return storable(text, limit, keep_end=True)


def storable(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` with lone surrogates escaped (``\\ud83d``) and cut to ``limit`` characters."""
    try:
        text.encode()
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode()
    if len(text) <= limit:
        return text
    if keep_end:
        return "...\n" + text[len(text) - limit :]
    return f"{text[:limit]}... (cut: {len(text)} characters in all)"
