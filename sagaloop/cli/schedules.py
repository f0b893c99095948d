"""``sagaloop schedule add|list|pause|resume|delete``: the schedules stored in the database,
those declared in code (``@app.schedule``) and those made at run time."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import click

from sagaloop.cli.common import Obj, app_option, errors, json_arg
from sagaloop.cli.render import printable, text_table
from sagaloop.client import Client
from sagaloop.engine.ports import Schedule
from sagaloop.sagas.schedules import CATCH_UP_POLICIES


def _when(value: datetime | None) -> str:
    return f"{value:%Y-%m-%d %H:%M:%S}" if value is not None else "-"


def _spec(schedule: Schedule) -> str:
    kind, _, value = schedule.spec.partition(":")
    return value if kind == "cron" else f"every {value}s"


def schedules_text(rows: list[Schedule]) -> str:
    if not rows:
        return "no schedule (declare one with @app.schedule, or: sagaloop schedule add)"
    table = [
        [
            s.app,
            s.name,
            s.saga,
            _spec(s),
            "paused" if s.paused else _when(s.next_tick),
            _when(s.last_tick),
            s.last_run_id or "-",
            "yes" if s.paused else "no",
            s.origin,
        ]
        for s in rows
    ]
    headers = ["app", "name", "saga", "spec (UTC)", "next tick", "last tick", "last run"]
    return text_table([*headers, "paused", "from"], table)


@click.group("schedule")
def schedule() -> None:
    """The schedules that start sagas on a cron or an interval (stored in the database)."""


@schedule.command("add")
@click.argument("name")
@click.argument("saga")
@click.option("--cron", help="5 fields in UTC: minute hour day-of-month month day-of-week.")
@click.option("--every", type=click.IntRange(1), help="Or: an interval, in seconds.")
@click.option("--input", "input_json", help="The saga's input as JSON.")
@click.option(
    "--catch-up",
    type=click.Choice(CATCH_UP_POLICIES),
    default="latest",
    show_default=True,
    help="Ticks missed while no engine ran: one run for the latest, one for each, or none.",
)
@app_option
@click.pass_obj
def add(
    obj: Obj,
    name: str,
    saga: str,
    cron: str | None,
    every: int | None,
    input_json: str | None,
    catch_up: str,
    app_spec: str | None,
) -> None:
    """Start SAGA of the app at each tick of a new schedule NAME, from the next tick on."""
    value = json_arg(input_json, "--input")
    with errors():
        client = Client(obj.store(), obj.app(app_spec))
        info = client.schedules.create(
            name,
            saga,
            value,
            cron=cron,
            every=None if every is None else timedelta(seconds=every),
            catch_up=catch_up,
        )
    click.echo(printable(f"schedule {name} added: next tick {_when(info.next_ticks[0])} UTC"))


@schedule.command("list")
@click.option("--app-name", help="Only the schedules of this app (its name).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def list_(obj: Obj, app_name: str | None, as_json: bool) -> None:
    """List the schedules: name, spec, next tick, last run, paused."""
    with errors():
        rows = obj.store().list_schedules(app_name)
    if as_json:
        fields = ("app", "name", "saga", "spec", "input", "catch_up", "paused", "origin")
        dates = ("next_tick", "last_tick")
        out = [
            {
                **{f: getattr(s, f) for f in fields},
                **{d: None if getattr(s, d) is None else getattr(s, d).isoformat() for d in dates},
                "last_run_id": s.last_run_id,
                "note": s.note,
            }
            for s in rows
        ]
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(schedules_text(rows))


def _change(obj: Obj, name: str, app_name: str | None, what: str, note: str | None) -> None:
    with errors():
        schedules = Client(obj.store()).schedules
        if what == "delete":
            found = schedules.delete(name, app=app_name)
        else:
            change = schedules.pause if what == "pause" else schedules.resume
            found = change(name, note=note, app=app_name)
    done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[what]
    click.echo(printable(f"schedule {name} of app {found.app} {done}"))


def _change_command(what: str, doc: str) -> None:
    """Add ``sagaloop schedule WHAT NAME [--app-name APP]`` (pause and resume: ``[--note
    TEXT]``), with help ``doc``."""

    def command(obj: Obj, name: str, app_name: str | None, note: str | None = None) -> None:
        _change(obj, name, app_name, what, note)

    command.__doc__ = doc
    decorated = click.option("--app-name", help="The app (its name) when several have NAME.")(
        click.pass_obj(command)
    )
    if what != "delete":
        note_help = "Why (told back by client.schedules.describe); none: the note is cleared."
        decorated = click.option("--note", help=note_help)(decorated)
    schedule.command(what)(click.argument("name")(decorated))


_change_command("pause", "Pause the schedule NAME: it starts nothing until resumed.")
_change_command(
    "resume", "Resume the schedule NAME from its next tick (the ticks of the pause start nothing)."
)
_change_command(
    "delete", "Delete the schedule NAME made at run time (one declared in code: pause it instead)."
)
