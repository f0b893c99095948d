"""`sagaloop replay` of an export that a hostile hand edited: whatever is wrong in it (a number
too large for a float, NaN, a value of the wrong type, nesting deeper than sagaloop stores,
items that are not objects, seqs out of order) is one line naming the file and exit status 2,
never a traceback, and never exit 1 (which says that the code diverged)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_env import run
from test_deploys_cli import env, waiting  # noqa: F401  (the fixture and its helper)

from sagaloop.cli.deploys import DIVERGED_FIX
from sagaloop.testing import Harness

Doc = dict[str, Any]


def first(key: str, value: Any) -> Callable[[Doc], Any]:
    def change(doc: Doc) -> Doc:
        doc["events"][0][key] = value
        return doc

    return change


def step(key: str, value: Any) -> Callable[[Doc], Any]:
    def change(doc: Doc) -> Doc:
        doc["events"][1][key] = value
        return doc

    return change


def deep(levels: int) -> Callable[[Doc], Any]:
    def change(doc: Doc) -> str:
        text = json.dumps(doc)
        nested = "[" * levels + "]" * levels
        return text.replace('"data": {', f'"data": {{"deep": {nested}, ', 1)

    return change


def text(old: str, new: str) -> Callable[[Doc], Any]:
    """An edit of the document's text (what JSON cannot say with a Python value)."""

    def change(doc: Doc) -> str:
        written = json.dumps(doc)
        assert old in written, old
        return written.replace(old, new, 1)

    return change


HOSTILE: dict[str, Callable[[Doc], Any]] = {
    "seq-1e999": text('"seq": 1,', '"seq": 1e999,'),
    "seq-NaN": text('"seq": 1,', '"seq": NaN,'),
    "seq-Infinity": text('"seq": 1,', '"seq": -Infinity,'),
    "seq-huge": first("seq", 10**40),
    "seq-float": first("seq", 1.5),
    "seq-bool": first("seq", True),
    "seq-string": first("seq", "1"),
    "seq-null": first("seq", None),
    "seq-out-of-order": first("seq", 3),
    "seq-negative": first("seq", -1),
    "pos-1e999": text('"pos": 0,', '"pos": 1e999,'),
    "pos-huge": step("pos", 10**40),
    "pos-float": step("pos", 0.5),
    "pos-string": step("pos", "0"),
    "pos-list": step("pos", [0]),
    "kind-number": first("kind", 7),
    "kind-unknown": step("kind", "step_exploded"),
    "name-list": step("name", ["reserve"]),
    "name-object": step("name", {"a": 1}),
    "at-number": first("at", 1e300),
    "at-garbage": first("at", "yesterday"),
    "at-list": first("at", ["2100-01-01"]),
    "data-list": first("data", [["input", "o-1"]]),
    "data-string": first("data", "input"),
    "data-number": first("data", 5),
    "data-NaN": text('"input": "o-1"', '"input": NaN'),
    "data-1e999": text('"input": "o-1"', '"input": 1e999'),
    "data-big-int": text('"input": "o-1"', '"input": ' + "9" * 5000),
    "deep-1000": deep(1000),
    "deep-100000": deep(100_000),
    "event-null": lambda doc: {**doc, "events": [*doc["events"], None]},
    "event-number": lambda doc: {**doc, "events": [5, *doc["events"]]},
    "event-list": lambda doc: {**doc, "events": [[1, "run_started"], *doc["events"]]},
    "events-object": lambda doc: {**doc, "events": {"0": doc["events"][0]}},
    "events-string": lambda doc: {**doc, "events": "run_started"},
    "version-bool": lambda doc: {**doc, "version": True},
    "version-1e999": text('"version": 1', '"version": 1e999'),
    "run-id-object": lambda doc: {**doc, "run_id": {"x": 1}},
    "top-number": lambda doc: "1e999",
    "top-null": lambda doc: "null",
    "json-lines": lambda doc: "\n".join(json.dumps(e) for e in doc["events"]),
    "lone-surrogate": text('"input": "o-1"', '"input": "\\ud800"'),
}
EDITED: dict[str, Callable[[Doc], Any]] = {
    "started-without-input": first("data", {}),
    "started-input-wrong": first("data", {"input": {"not": "a string"}}),
    "completed-without-result": lambda doc: {
        **doc,
        "events": [*doc["events"][:2], {**doc["events"][2], "data": {}}, *doc["events"][3:]],
    },
    "step-name-null": step("name", None),
    "step-pos-null": step("pos", None),
    "waiting-name-null": lambda doc: {
        **doc,
        "events": [*doc["events"][:3], {**doc["events"][3], "name": None}],
    },
}
"""Edits that leave a well-formed history, of another run: replayed, they diverge (exit 1)."""


def replayed(harness: Harness, tmp_path: Path, case: str, edit: Callable[[Doc], Any]) -> Any:
    waiting(harness, "o-1")
    good = tmp_path / "good.json"
    assert run("export", "o-1", "-o", str(good)).exit_code == 0
    changed = edit(json.loads(good.read_text()))
    path = tmp_path / f"{case}.json"
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    return path, run("replay", str(path), "--app", "deploys_cli")


@pytest.mark.parametrize("case", sorted(EDITED))
def test_an_edited_history_diverges_in_one_line(
    env: Harness,  # noqa: F811
    tmp_path: Path,
    case: str,
) -> None:
    path, result = replayed(env, tmp_path, case, EDITED[case])
    assert result.exit_code == 1, result.output[-2000:]
    said, fix = result.output.splitlines()  # the divergence, then once what to do about it
    assert said.startswith(f"{path}: diverged: ") and fix == DIVERGED_FIX


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_export_is_one_line_and_exit_2(
    env: Harness,  # noqa: F811
    tmp_path: Path,
    case: str,
) -> None:
    path, result = replayed(env, tmp_path, case, HOSTILE[case])
    assert result.exit_code == 2, result.output[-2000:]
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: "), result.output[-2000:]
    assert "Traceback" not in result.output
    assert len(lines[0]) < 400, lines[0]
    # the export as written still replays
    assert run("replay", str(tmp_path / "good.json"), "--app", "deploys_cli").exit_code == 0


def test_what_the_checks_miss_is_still_one_line_and_exit_2(
    env: Harness,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sagaloop.testing import histories

    def explode(*args: Any, **kwargs: Any) -> None:
        raise KeyError("input")

    monkeypatch.setattr(histories, "replay", explode)  # imported by `replay` when it runs
    path, result = replayed(env, tmp_path, "unforeseen", lambda doc: doc)
    assert result.exit_code == 2, result.output
    assert result.output == f"{path}: not a history sagaloop can replay: KeyError: 'input'\n"
