"""``sagaloop export``, ``replay`` and ``fork``: safe deploys. Export the histories of runs in
flight, replay them against the code about to be deployed (the deploy gate), and fork a run at
a command position to see what changed code or prompts do from there."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sagaloop.cli.common import Obj, app_option, errors
from sagaloop.cli.render import printable
from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.state import ALL_STATUSES, FINAL_STATUSES
from sagaloop.errors import ActivationDeadlineError, NonDeterminismError

if TYPE_CHECKING:  # imported where used: the client loads the store, not for --help
    from sagaloop.client import Client

MAX_VALUE_DEPTH = 100
"""How deep a history's values may nest (``sagaloop.sagas.convert.MAX_VALUE_DEPTH``, which
imports pydantic: the same figure, checked equal by tests/unit/test_cli_startup.py)."""
IN_FLIGHT = tuple(x for x in ALL_STATUSES if x not in FINAL_STATUSES)
"""The statuses ``export --all`` takes by default: the runs a deploy replays."""
MAX_RUNS = 1_000_000
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,150}")
KINDS = frozenset(v for k, v in vars(h).items() if k.isupper() and isinstance(v, str))
"""The kinds of event a history may hold: those of :mod:`sagaloop.engine.history`."""
MAX_INDEX = 2**63 - 1
"""The largest seq or position a store holds (a BIGINT)."""


class InputError(click.ClickException):
    """A file that is not a history: exit status 2 (1 says that a history diverged)."""

    exit_code = 2


DIVERGED_FIX = (
    "to fix: the code about to be deployed must issue the recorded command where a run "
    "diverged: keep the old code path, or branch on ctx.patched('change-id') so runs that "
    "passed there with the old code take it (docs/concepts/versioning.md)"
)
"""What ``replay`` says after the histories the code diverged from."""


# --- export ----------------------------------------------------------------------------------


@click.command()
@click.argument("run_id", required=False)
@click.option(
    "--format",
    "format_",
    type=click.Choice(["json"]),
    default="json",
    show_default=True,
    help="The document's format.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path),
    help="Write to this file instead of stdout (with --all: into this folder, a file per run).",
)
@click.option(
    "--all",
    "all_runs",
    is_flag=True,
    help="Export every run that is not finished (or those of --status), one file each.",
)
@click.option("--saga", help="With --all: only runs of this saga.")
@click.option(
    "--status",
    "statuses",
    type=click.Choice(ALL_STATUSES),
    multiple=True,
    help="With --all: only runs in this status (repeat it for more).",
)
@click.pass_obj
def export(
    obj: Obj,
    run_id: str | None,
    format_: str,
    output: Path | None,
    all_runs: bool,
    saga: str | None,
    statuses: Sequence[str],
) -> None:
    """Write the history of the run RUN_ID as a JSON document (format, version, app, saga, run
    id, status, its commands by position, its events): what `sagaloop replay` and
    `sagaloop.testing.replay` read. With --all -o DIR, one file per run in DIR."""
    if all_runs == (run_id is not None):
        raise click.UsageError("name a RUN_ID, or give --all (with -o DIR)")
    if not all_runs and (saga is not None or statuses):
        raise click.UsageError("--saga and --status go with --all")
    if all_runs and output is None:
        raise click.UsageError("--all writes a file per run: name their folder with -o DIR")
    with errors():
        from sagaloop.client import Client  # SQLAlchemy: loaded when the command runs

        client = Client(obj.store())
        if run_id is not None:
            text = _document(client, run_id)
            if output is None:
                click.echo(text)
            else:
                _write(output, text)
            return
        assert output is not None
        runs = [
            run
            for status in statuses or IN_FLIGHT
            for run in client.list(status=status, saga=saga, limit=MAX_RUNS)
        ]
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.ClickException(f"cannot create {output}: {e.strerror or e}") from None
        for run in runs:
            _write(output / file_name(run.run_id), _document(client, run.run_id))
    click.echo(f"exported {len(runs)} run{'' if len(runs) == 1 else 's'} to {output}")


def _document(client: Client, run_id: str) -> str:
    from sagaloop.testing.histories import history_document

    run = client.get(run_id)
    document = history_document(run, client.history(run_id))
    return json.dumps(document, indent=2, ensure_ascii=False)


def file_name(run_id: str) -> str:
    """The file ``export --all`` writes the run ``run_id`` to: ``RUN_ID.json`` when the id
    is a plain name, else a readable part and a hash of the id (ids may hold ``/``)."""
    if PLAIN_NAME.fullmatch(run_id):
        return f"{run_id}.json"
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id)[:60].strip("._") or "run"
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable}-{digest}.json"


def _write(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        raise click.ClickException(f"cannot write {path}: {e.strerror or e}") from None


# --- replay ----------------------------------------------------------------------------------


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@app_option
@click.pass_obj
def replay(obj: Obj, files: Sequence[Path], app_spec: str | None) -> None:
    """Replay histories (files `sagaloop export` wrote, or bare lists of events; a folder: its
    *.json files) against the app's code as it is now, the deploy gate. Prints a line per
    file: ok, or the first divergence. Exit status 1 if a history diverged, 2 if a file is not
    a history. Needs no database."""
    from sagaloop.testing.histories import replay as replay_history  # the app's code: pydantic

    histories = [(path, *_read(path)) for path in _files(files)]
    with errors():
        app = obj.app(app_spec)
    diverged = broken = 0
    for path, events, run_id in histories:
        try:
            replay_history(app, events, run_id=run_id)
        except (NonDeterminismError, ActivationDeadlineError, ValueError) as e:
            diverged += 1
            said = e.divergence if isinstance(e, NonDeterminismError) else str(e)
            click.echo(printable(f"{path}: diverged: {' '.join(said.split())}"))
        except Exception as e:  # the last net: what the checks of _checked did not foresee
            broken += 1
            reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
            click.echo(printable(f"{path}: not a history sagaloop can replay: {reason}"))
        else:
            shown = f"{path}: ok (run {run_id or 'replay'!r}, {len(events)} events)"
            click.echo(printable(shown))
    if diverged:
        click.echo(DIVERGED_FIX)
    if broken or diverged:
        raise click.exceptions.Exit(InputError.exit_code if broken else 1)


def _files(paths: Sequence[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted(p for p in path.glob("*.json") if p.is_file())
            if not inside:
                raise InputError(f"{path}: no .json file in this folder")
            found += inside
        else:
            found.append(path)
    return found


def _read(path: Path) -> tuple[list[Event], str | None]:
    from sagaloop.testing.histories import read_history

    try:
        text = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read it: {e.strerror or e}") from None
    try:
        events, run_id = read_history(_checked(text))
    except (ValueError, RecursionError) as e:
        raise InputError(f"{path}: {' '.join(str(e).split())[:300]}") from None
    if not any(e.kind == h.RUN_STARTED for e in events):
        raise InputError(
            f"{path}: the history has no run_started event: export the whole history of a run"
        )
    return events, run_id


def _checked(text: bytes) -> Any:
    """The JSON of an export (or a bare list of events), parsed as the engine parses messages
    and checked before anything reads it: ValueError, saying what is wrong, for a file that is
    not a history, so that a hand-edited or hostile file is one line and exit status 2, and
    never a traceback or a divergence. Refused: NaN, Infinity and numbers too large for a
    float; values nested deeper than sagaloop stores; strings that are not text; events that
    are not ``{seq, kind, at, pos, name, data}`` with these types, an unknown kind, seqs that
    are not 1, 2, 3... in order, and a run id or version of the wrong type."""

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON: JSON has no NaN or Infinity")

    def number(written: str) -> float:
        parsed = float(written)
        if math.isinf(parsed):
            raise ValueError(f"the number {written[:40]} is too large for a float")
        return parsed

    try:
        document = json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"not a history: nested deeper than {MAX_VALUE_DEPTH} levels") from None
    except ValueError as e:  # bytes that are not UTF-8, an integer of over 4300 digits
        raise ValueError(f"not JSON sagaloop reads: {e}") from None
    events = document.get("events") if isinstance(document, dict) else document
    if isinstance(document, dict):
        version = document.get("version", 1)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"the history format version must be an integer, not {version!r:.40}")
        run_id = document.get("run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise ValueError(f"the run_id must be a string, not {type(run_id).__name__}")
    if isinstance(events, list):
        for index, event in enumerate(events):
            _check_event(index, event)
    return document


def _check_event(index: int, event: Any) -> None:
    """ValueError unless ``event`` is the ``index``-th event of an export, with these types."""
    where = f"event {index} of the history"
    if not isinstance(event, dict):
        raise ValueError(f"{where} is not an object but {type(event).__name__}")
    for key, types in (("seq", int), ("kind", str), ("at", str), ("data", dict)):
        if not isinstance(event.get(key), types) or isinstance(event.get(key), bool):
            found = type(event.get(key)).__name__ if key in event else "missing"
            raise ValueError(f"{where}: {key} must be {types.__name__}, not {found}")
    for key, types in (("pos", int), ("name", str)):
        value = event.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise ValueError(
                f"{where}: {key} must be {types.__name__} or null, not {type(value).__name__}"
            )
    if event["seq"] != index + 1:
        seq = str(event["seq"])[:40]
        raise ValueError(f"{where}: its seq is {seq}, not {index + 1} (1, 2, 3...)")
    if not 0 <= (event.get("pos") or 0) <= MAX_INDEX:
        raise ValueError(f"{where}: pos {str(event['pos'])[:40]} is out of range")
    if event["kind"] not in KINDS:
        raise ValueError(f"{where}: unknown kind {event['kind'][:40]!r}")
    try:
        datetime.fromisoformat(event["at"])
    except ValueError:
        raise ValueError(f"{where}: at {event['at'][:40]!r} is not an ISO 8601 time") from None
    stack: list[tuple[Any, int]] = [(event, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                raise ValueError(f"{where}: a string holds a lone surrogate") from None
        elif isinstance(value, dict | list):
            if depth > MAX_VALUE_DEPTH:
                raise ValueError(f"{where}: nested deeper than {MAX_VALUE_DEPTH} levels")
            items = [*value, *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


# --- fork ------------------------------------------------------------------------------------


@click.command()
@click.argument("run_id")
@click.option(
    "--at",
    "--from",
    "position",
    type=int,
    required=True,
    help="The command position to cut at (--from is the same): what the commands before it "
    "did is kept, the code goes on from there (the # of `sagaloop status` and `sagaloop "
    "tail`, the positions of `sagaloop export`).",
)
@click.option("--run-id", "new_run_id", help="The new run's id (default: a random one).")
@app_option
@click.pass_obj
def fork(
    obj: Obj, run_id: str, position: int, new_run_id: str | None, app_spec: str | None
) -> None:
    """Start a new run whose history is that of RUN_ID up to the command at position --at
    (recorded results reused, nothing before it run again) and print its id: the app's code
    as it is now goes on from there."""
    with errors():
        from sagaloop.client import Client

        app = obj.app(app_spec)
        click.echo(Client(obj.store(), app).fork(run_id, position, run_id=new_run_id))
