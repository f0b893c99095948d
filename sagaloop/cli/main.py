"""The ``sagaloop`` command: the composition root, the only place that wires adapters."""

from __future__ import annotations

import importlib
import json
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pythonjsonlogger.json import JsonFormatter

from sagaloop.cli.common import Obj, errors, json_arg
from sagaloop.cli.render import TailLines, pending_text, printable, runs_text, timeline_text
from sagaloop.engine.state import ALL_STATUSES

if TYPE_CHECKING:  # imported where used: the client loads the store (SQLAlchemy)
    from sagaloop.client import Client
    from sagaloop.sagas.app import App

F = TypeVar("F", bound=Callable[..., Any])
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
DRIVER_LOGGERS = ("pika", "kombu")
DRIVER_LEVELS = (logging.CRITICAL, logging.WARNING, logging.DEBUG)
"""The level of the drivers' own loggers by the count of ``-v``. pika logs every failed
connection attempt at ERROR, five lines or more each, which sagaloop reports itself once and
without passwords: silent by default, its warnings and errors with ``-v``, everything with
``-v -v``."""


LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "approvals": (
        "sagaloop.cli.approvals",
        "List the approvals that runs wait for (pending or escalated), oldest first, a page at "
        "a time.",
    ),
    "approve": (
        "sagaloop.cli.approvals",
        "Approve the approval CALL_ID that the run RUN_ID waits for.",
    ),
    "complete-step": (
        "sagaloop.cli.completion",
        "Complete the step attempt TOKEN names (its ctx.task_token) with --result, or fail it "
        "with --fail (the step's retry policy applies).",
    ),
    "dead-letters": (
        "sagaloop.cli.dead_letters",
        "List, show, resend and purge the dead letters of the configured broker: RabbitMQ's "
        "queue <namespace>.dead, or the database broker's table.",
    ),
    "demo": (
        "sagaloop.cli.demo",
        "Run the refund agent in real processes, kill one with SIGKILL at the worst moment, and "
        "check from the payment provider's books that the refund happened exactly once; then a "
        "refund reversed, and one approved by a person (about 10 s; leaves nothing behind).",
    ),
    "deny": ("sagaloop.cli.approvals", "Deny the approval CALL_ID that the run RUN_ID waits for."),
    "dev": (
        "sagaloop.cli.serve",
        "Run the engine, the timers and workers for every queue in one process (the embedded "
        "default).",
    ),
    "engine": (
        "sagaloop.cli.serve",
        "Run the engine: activations, in-process steps, timers, the outbox relay and retention.",
    ),
    "export": (
        "sagaloop.cli.deploys",
        "Write the history of the run RUN_ID as a JSON document (format, version, app, saga, "
        "run id, status, its commands by position, its events): what `sagaloop replay` and "
        "`sagaloop.testing.replay` read.",
    ),
    "fork": (
        "sagaloop.cli.deploys",
        "Start a new run whose history is that of RUN_ID up to the command at position --at "
        "(recorded results reused, nothing before it run again) and print its id: the app's "
        "code as it is now goes on from there.",
    ),
    "health": (
        "sagaloop.cli.serve",
        "Exit 1 when something is wrong; print a table, or JSON with --json.",
    ),
    "mcp": (
        "sagaloop.cli.mcp",
        "Serve the app's sagas to MCP clients: a tool per saga that starts a run and returns its "
        "id at once, and run_status, send_event, list_approvals, approve and deny.",
    ),
    "publish": (
        "sagaloop.cli.messaging",
        "Publish the event NAME to the app's runs subscribed to or waiting on it (and start the "
        "runs of the sagas declared with ``on_event=NAME``); print its event id.",
    ),
    "replay": (
        "sagaloop.cli.deploys",
        "Replay histories (files `sagaloop export` wrote, or bare lists of events; a folder: its "
        "*.json files) against the app's code as it is now, the deploy gate.",
    ),
    "schedule": (
        "sagaloop.cli.schedules",
        "The schedules that start sagas on a cron or an interval (stored in the database).",
    ),
    "schema": (
        "sagaloop.cli.serve",
        "Print the JSON Schema of the start, event, publish and update messages (the public "
        "message contract).",
    ),
    "update": (
        "sagaloop.cli.messaging",
        "Send the update NAME to a run (its ``ctx.on_update`` handler) and print the answer as "
        "JSON.",
    ),
    "ui": (
        "sagaloop.cli.ui",
        "Serve the web console: runs with filters and counts, each run's timeline, agent "
        "transcripts, approvals to approve or deny, send event, cancel and retry, dead letters.",
    ),
    "worker": ("sagaloop.cli.serve", "Run steps from the given queues."),
}
"""The commands defined outside this module: by name, the module that defines it (as an
attribute named like the command, ``-`` read ``_``) and its short help, for ``sagaloop --help``.
A module is imported when its command runs (or shows its own help), so that ``sagaloop --help``
and the commands that do not need them load neither SQLAlchemy, pydantic, the drivers, the
console nor the agents (issue 26; tests/unit/test_cli_startup.py checks the short helps)."""


class _Cli(click.Group):
    """The ``sagaloop`` group: its global options are taken after the command too, and every
    error a command reports leaves through ``Obj.scrub``, so it holds no configured password nor
    any piece of one, whichever driver phrased it, and through ``printable``, so no control
    character of the run data it may quote reaches the terminal. The commands of
    :data:`LAZY_COMMANDS` are imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in LAZY_COMMANDS:
            module = importlib.import_module(LAZY_COMMANDS[cmd_name][0])
            self.add_command(getattr(module, cmd_name.replace("-", "_")), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """As click's, with the stored short help of a command not imported yet."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        shown = [
            self.commands.get(name) or click.Command(name, help=LAZY_COMMANDS[name][1])
            for name in names
        ]
        rows = [(c.name or "", c.get_short_help_str(limit)) for c in shown if not c.hidden]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._global_first(ctx, args))

    def _global_first(self, ctx: click.Context, args: list[str]) -> list[str]:
        """``args`` with the group's options that follow the command name moved before it:
        ``status RUN --database-url X -v`` is ``--database-url X -v status RUN``. Nothing after
        ``--`` moves, nor the value of an option of the command, nor an option that the command
        (or its subcommand) declares itself under the same name."""
        own = _options(self)
        at = 0  # the command name's index
        while at < len(args) and args[at].startswith("-") and args[at] != "--":
            at += 2 if own.get(args[at]) else 1
        if at >= len(args) or args[at] == "--":
            return args
        command: click.Command | None = self.get_command(ctx, args[at])
        local = _options(command) if command is not None else {}
        moved: list[str] = []
        kept = [args[at]]
        i = at + 1
        while i < len(args):
            arg = args[i]
            if arg == "--":
                kept += args[i:]
                break
            if not arg.startswith("-"):  # an argument, or a subcommand (with its own options)
                if isinstance(command, click.Group):
                    command = command.get_command(ctx, arg)
                    local = _options(command) if command is not None else {}
                kept.append(arg)
                i += 1
                continue
            name = arg.split("=", 1)[0] if arg.startswith("--") else arg
            ours = name not in local and (
                name in own or (_repeated_short(arg, own) and arg[:2] not in local)
            )
            options = own if ours else local
            width = 2 if options.get(name) and "=" not in arg else 1  # with its value
            if ours and i + width > len(args):
                raise click.UsageError(f"Option '{name}' requires an argument.", ctx)
            (moved if ours else kept).extend(args[i : i + width])
            i += width
        return args[:at] + moved + kept

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            text = e.format_message()
            scrubbed = ctx.obj.scrub(text) if isinstance(ctx.obj, Obj) else text
            scrubbed = printable(scrubbed, newlines=True)  # it may quote run data
            if scrubbed == text:
                raise
            kind = click.UsageError if isinstance(e, click.UsageError) else click.ClickException
            raise kind(scrubbed) from None


def _options(command: click.Command) -> dict[str, bool]:
    """The option names of ``command``, each with whether it takes a value."""
    return {
        name: not (param.is_flag or param.count)
        for param in command.params
        if isinstance(param, click.Option)
        for name in (*param.opts, *param.secondary_opts)
    }


def _repeated_short(arg: str, options: dict[str, bool]) -> bool:
    """``-vv``: a short flag of ``options`` repeated."""
    return (
        len(arg) > 2
        and arg[0] == "-"
        and arg[1] != "-"
        and set(arg[1:]) == {arg[1]}
        and (options.get(f"-{arg[1]}") is False)
    )


class _ScrubbingFormatter(logging.Formatter):
    """Log lines (tracebacks included) without the configured passwords: the last net under the
    masking that every message quoting a URL or a driver's error already does; and without a
    control character of the run data they quote (:func:`printable`)."""

    def __init__(self, scrub: Callable[[str], str]) -> None:
        super().__init__(LOG_FORMAT)
        self._scrub = scrub

    def format(self, record: logging.LogRecord) -> str:
        # printable: a log line may quote run data (a step's error, a model's text)
        return printable(self._scrub(super().format(record)), newlines=True)


class _ScrubbingJsonFormatter(JsonFormatter):
    """``--log-format json``: one JSON object per line for log shippers (python-json-logger),
    with ``time``, ``level``, ``logger``, ``message``, the record's extra fields (``run_id``,
    ``saga``, ``step``, ``attempt``...) and ``exc_info``. Each string in it is scrubbed before
    it is serialized (JSON escapes would hide a password from a scrub of the line), and the
    line after, as a last net."""

    def __init__(self, scrub: Callable[[str], str]) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            timestamp="time",
        )
        self._scrub = scrub

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return {key: self._clean(value) for key, value in log_data.items()}

    def _clean(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._scrub(value)
        if isinstance(value, dict):
            return {self._clean(k): self._clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._clean(v) for v in value]
        return value

    def format(self, record: logging.LogRecord) -> str:
        return self._scrub(super().format(record))


@click.group(cls=_Cli)
@click.option(
    "--database-url",
    default=None,
    help="SQLAlchemy URL of the store (default: $SAGALOOP_DATABASE_URL or sqlite:///sagaloop.db).",
)
@click.option(
    "--broker-url",
    default=None,
    help="database, memory, an amqp:// URL of RabbitMQ (several, comma-separated, for a "
    "cluster) or a redis:// URL (default: $SAGALOOP_BROKER_URL or database).",
)
@click.option(
    "-v",
    "--verbose",
    count=True,
    default=None,
    help="Log debug output of sagaloop; twice (-v -v) of pika and kombu too (default: "
    "$SAGALOOP_VERBOSE or 0).",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"], case_sensitive=False),
    default=None,
    help="Log lines on stderr as text, or as one JSON object each for log shippers "
    "(default: $SAGALOOP_LOG_FORMAT or text).",
)
@click.version_option(package_name="sagaloop")
@click.pass_context
def cli(
    ctx: click.Context,
    database_url: str | None,
    broker_url: str | None,
    verbose: int | None,
    log_format: str | None,
) -> None:
    """sagaloop: durable AI-agent loops as sagas.

    The options below go before or after the command (sagaloop status RUN -v); each has its
    SAGALOOP_... environment variable."""
    ctx.obj = obj = Obj(database_url, broker_url=broker_url, log_format=log_format, verbose=verbose)
    settings = obj.settings
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _ScrubbingJsonFormatter(obj.scrub)
        if settings.log_format == "json"
        else _ScrubbingFormatter(obj.scrub)
    )
    level = settings.verbose
    logging.basicConfig(level=logging.DEBUG if level else logging.INFO, handlers=[handler])
    for name in DRIVER_LOGGERS:
        logging.getLogger(name).setLevel(DRIVER_LEVELS[min(level, len(DRIVER_LEVELS) - 1)])


def _client(obj: Obj, app: App | None = None) -> Client:
    from sagaloop.client import Client  # the store's SQLAlchemy, not for ``--help``

    return Client(obj.store(), app)


# --- client commands ---------------------------------------------------------------------------


@cli.command()
@click.argument("saga")
@click.option("--input", "input_json", help="The saga's input as JSON.")
@click.option("--run-id", help="Choose the run id (a second start with it returns the same run).")
@click.option("--event", "event_name", help="Also deliver this event, in the same transaction.")
@click.option("--data", "event_data", help="The --event's data as JSON.")
@click.option("--event-id", help="Starts with the same --event-id deliver the event once.")
@click.option(
    "--app",
    "app_spec",
    help="The app: MODULE or MODULE:ATTRIBUTE (or $SAGALOOP_APP). Needed, and its code "
    "imported: it names the engine that starts the run, validates the input against the "
    "saga's model before anything is written, and sends a debounced saga's start to its "
    "window (none of which the command can know without the code).",
)
@click.pass_obj
def start(
    obj: Obj,
    saga: str,
    input_json: str | None,
    run_id: str | None,
    event_name: str | None,
    event_data: str | None,
    event_id: str | None,
    app_spec: str | None,
) -> None:
    """Start a run of SAGA and print its id. With --event, deliver that event to the run too
    (to the run already there if the run id exists: signal-with-start)."""
    value = json_arg(input_json, "--input")
    data = json_arg(event_data, "--data")
    if event_name is None and (event_data is not None or event_id is not None):
        raise click.BadParameter("--data and --event-id go with --event NAME", param_hint="--data")
    event = None if event_name is None else (event_name, data)
    with errors():
        app = obj.app(app_spec)
        run = _client(obj, app).start(saga, value, run_id=run_id, event=event, event_id=event_id)
        click.echo(printable(run))


@cli.command("send-event")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", help="The event's data as JSON.")
@click.option("--event-id", help="Sends with the same id are delivered once (safe to retry).")
@click.option(
    "--app",
    "app_spec",
    help="The app (MODULE or MODULE:ATTRIBUTE): validates the event against the saga's "
    "declared events and models before sending (its code imported). Without it (faster: no "
    "code imported), the event is checked against what the run recorded (the names it "
    "declares, the open wait), and the engine validates the rest: data that does not fit is "
    "refused and recorded, and `sagaloop status` shows why.",
)
@click.pass_obj
def send_event(
    obj: Obj, run_id: str, name: str, data: str | None, event_id: str | None, app_spec: str | None
) -> None:
    """Send the event NAME to a run. Refused, with nothing sent, if the run would refuse it:
    a name its saga does not declare (``@app.saga(events=...)``), or data that does not fit
    the model of its wait or, before the wait begins, the declared one."""
    value = json_arg(data, "--data")
    with errors():
        app = obj.app(app_spec) if app_spec else None
        _client(obj, app).send_event(run_id, name, value, event_id=event_id)
        click.echo(printable(f"event {name!r} sent to {run_id}"))


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def status(obj: Obj, run_id: str, as_json: bool) -> None:
    """Show a run's timeline and why it waits."""
    with errors():
        tl = _client(obj).status(run_id)
    click.echo(json.dumps(tl.to_json(), indent=2) if as_json else timeline_text(tl))


@cli.command()
@click.argument("run_id")
@click.option("--no-follow", is_flag=True, help="Print what the history holds, then stop.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def tail(obj: Obj, run_id: str, no_follow: bool, as_json: bool) -> None:
    """Follow a run: its history, then what happens and what its steps stream live (an agent's
    model tokens), until it finishes. On the embedded default, live items reach only readers in
    the process that runs the steps; the history is followed everywhere."""
    with errors():
        from sagaloop.client import Client

        client = Client(obj.store(), streams=obj.streams())
        lines = TailLines()
        for item in client.stream(run_id, follow=not no_follow):
            click.echo(json.dumps(item, default=str) if as_json else lines.line(item))


@cli.command("list")
@click.option(
    "--status", "status_", type=click.Choice(ALL_STATUSES), help="Only runs in this status."
)
@click.option("--saga", help="Only runs of this saga.")
@click.option("--limit", default=50, type=click.IntRange(1, 10_000), show_default=True)
@click.option("--search", help="Only runs whose id starts with this.")
@click.option("--input", "input_text", help="Only runs whose input's JSON text contains this.")
@click.option(
    "--sort",
    type=click.Choice(["-updated", "updated", "-created", "created"]),  # RunOrder's values
    default="-updated",
    show_default=True,
    help="By last update or creation; a leading '-': newest first.",
)
@click.option("--after", help="The cursor a previous page printed: the page after it.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def list_runs(
    obj: Obj,
    status_: str | None,
    saga: str | None,
    limit: int,
    search: str | None,
    input_text: str | None,
    sort: str,
    after: str | None,
    as_json: bool,
) -> None:
    """List runs, newest first, with counts by status. A full page prints the cursor of the
    next one (--after)."""
    from sagaloop.engine.listing import run_cursor, run_order

    with errors():
        client = _client(obj)
        order = run_order(sort)
        runs = client.list(
            status=status_,
            saga=saga,
            limit=limit,
            id_prefix=search,
            input_text=input_text,
            order=order,
            after=after,
        )
        more = run_cursor(runs[-1], order) if len(runs) == limit else None
        counts = client.store.count_runs(saga=saga)
        pending = client.pending(saga) if status_ is None else []
    if as_json:
        rows = [
            {
                "run_id": r.run_id,
                "app": r.app,
                "saga": r.saga,
                "status": r.status,
                "created_at": r.created_at.isoformat(),
                "updated_at": r.updated_at.isoformat(),
            }
            for r in runs
        ]
        out: dict[str, Any] = {"runs": rows, "counts": counts}
        if more:
            out["next"] = more
        if pending:  # debounced starts whose run has not started: not runs yet
            out["pending"] = [
                {
                    "run_id": w.run_id,
                    "app": w.app,
                    "saga": w.saga,
                    "key": w.key,
                    "starts": w.starts,
                    "first_at": w.first_at.isoformat(),
                    "due_at": w.due_at.isoformat(),
                }
                for w in pending
            ]
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(runs_text(runs, counts))
        if more:
            click.echo(f"next page: --after {more}")
        if pending:
            click.echo("\n" + pending_text(pending))


@cli.command()
@click.argument("run_id")
@click.option("--reason", help="Recorded in the history.")
@click.option(
    "--now", is_flag=True, help="No cleanup: stop the saga code where it waits (even mid-cleanup)."
)
@click.pass_obj
def cancel(obj: Obj, run_id: str, reason: str | None, now: bool) -> None:
    """Cancel a run: its saga code gets CancelledError where it waits and may clean up
    (within the saga's cancel_grace), then the run compensates and ends cancelled."""
    with errors():
        _client(obj).cancel(run_id, reason, now=now)
    click.echo(printable(f"cancellation of {run_id} requested"))


@cli.command()
@click.argument("run_id")
@click.option(
    "--budget",
    help="JSON limits that replace those an agent run stopped at, e.g. '{\"requests\": 40}' "
    "(a run whose Budget has on_exceed='wait').",
)
@click.pass_obj
def retry(obj: Obj, run_id: str, budget: str | None) -> None:
    """Resume a run in needs_attention once its cause is fixed, or, with --budget, an agent run
    that waits for a larger budget."""
    with errors():
        if budget is not None:
            _client(obj).send_event(run_id, "budget", json_arg(budget, "--budget"))
            click.echo(printable(f"budget of {run_id} raised"))
            return
        _client(obj).retry(run_id)
    click.echo(printable(f"retry of {run_id} requested"))


@cli.group()
def db() -> None:
    """Manage the database schema."""


@db.command()
@click.pass_obj
def upgrade(obj: Obj) -> None:
    """Apply pending schema migrations."""
    from sagaloop.store.sql import SqlStore

    with errors():
        store = SqlStore(obj.settings.database_url)
        before, after = store.upgrade()
    if before == after:
        click.echo(f"schema is up to date (version {after})")
    else:
        click.echo(f"schema upgraded from version {before} to {after}")


def main() -> None:
    cli(prog_name="sagaloop")


if __name__ == "__main__":
    main()
