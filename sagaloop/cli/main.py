"""The ``sagaloop`` command: the composition root, the only place that wires adapters."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import click

from sagaloop.cli.demo import demo
from sagaloop.cli.render import runs_text, timeline_text
from sagaloop.cli.settings import Settings, load_app, mask_url
from sagaloop.engine.client import Client
from sagaloop.engine.ports import Broker
from sagaloop.engine.state import ALL_STATUSES
from sagaloop.errors import SagaloopError
from sagaloop.sagas.app import App
from sagaloop.store.sql import SqlStore

F = TypeVar("F", bound=Callable[..., Any])


class _Obj:
    def __init__(self, database_url: str | None) -> None:
        self.settings = Settings()
        if database_url:
            self.settings.database_url = database_url

    def store(self, *, upgrade: bool = False) -> SqlStore:
        try:
            store = SqlStore(self.settings.database_url)
        except Exception as e:
            raise click.ClickException(
                f"cannot use database {mask_url(self.settings.database_url)}: {e}"
            ) from e
        if upgrade:
            store.upgrade()
        else:
            store.check_schema()
        return store

    def app(self, spec: str | None) -> App:
        spec = spec or self.settings.app
        if not spec:
            raise click.ClickException("name the app with --app MODULE (or SAGALOOP_APP)")
        return load_app(spec)


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except SagaloopError as e:
        raise click.ClickException(str(e)) from e


def _json_arg(value: str | None, what: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"not valid JSON: {e.msg} at position {e.pos}", param_hint=what
        ) from None


_app_option = click.option("--app", "app_spec", help="The app: MODULE or MODULE:ATTRIBUTE.")


@click.group()
@click.option(
    "--database-url",
    default=None,
    help="SQLAlchemy URL of the store (default: $SAGALOOP_DATABASE_URL or sqlite:///sagaloop.db).",
)
@click.option("-v", "--verbose", is_flag=True, help="Log debug output.")
@click.version_option(package_name="sagaloop")
@click.pass_context
def cli(ctx: click.Context, database_url: str | None, verbose: bool) -> None:
    """sagaloop: durable AI-agent loops as sagas."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    ctx.obj = _Obj(database_url)


def _client(obj: _Obj, app: App | str) -> Client:
    return Client(obj.store(), app)


# --- services ----------------------------------------------------------------------------------


@cli.command()
@_app_option
@click.option("--concurrency", default=4, type=click.IntRange(1, 256), show_default=True)
@click.option(
    "--poll",
    default=0.1,
    type=click.FloatRange(0.01, 10),
    show_default=True,
    help="Seconds between looks at the database queue when idle.",
)
@click.pass_obj
def dev(obj: _Obj, app_spec: str | None, concurrency: int, poll: float) -> None:
    """Run the engine, the timers and workers for every queue in one process, on the embedded
    default. Applies pending schema migrations first. Stops cleanly on SIGTERM or Ctrl-C."""
    from sagaloop.cli.services import Runtime

    with _errors():
        app = obj.app(app_spec)
        store = obj.store(upgrade=True)
        broker = _broker(obj, store)
        runtime = Runtime(
            app,
            store,
            broker,
            concurrency=concurrency,
            poll=poll,
            heartbeat=obj.settings.lease / 3,
            name="dev",
        )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    runtime.start()
    logging.getLogger("sagaloop").info(
        "dev: app %r on %s, queues %s", app.name, mask_url(obj.settings.database_url), app.queues
    )
    stop.wait()
    logging.getLogger("sagaloop").info("dev: stopping")
    runtime.stop()


def _broker(obj: _Obj, store: SqlStore) -> Broker:
    url = obj.settings.broker_url
    if url == "database":
        from sagaloop.brokers.database import DatabaseBroker

        return DatabaseBroker(store, lease=timedelta(seconds=obj.settings.lease))
    if url == "memory":
        from sagaloop.brokers.memory import MemoryBroker

        return MemoryBroker()
    raise click.ClickException(f"unsupported SAGALOOP_BROKER_URL {mask_url(url)!r}")


# --- client commands ---------------------------------------------------------------------------


@cli.command()
@click.argument("saga")
@click.option("--input", "input_json", help="The saga's input as JSON.")
@click.option("--run-id", help="Choose the run id (a second start with it returns the same run).")
@_app_option
@click.pass_obj
def start(
    obj: _Obj, saga: str, input_json: str | None, run_id: str | None, app_spec: str | None
) -> None:
    """Start a run of SAGA and print its id."""
    value = _json_arg(input_json, "--input")
    with _errors():
        app = obj.app(app_spec)
        click.echo(_client(obj, app).start(saga, value, run_id=run_id))


@cli.command("send-event")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", help="The event's data as JSON.")
@click.option("--event-id", help="Sends with the same id are delivered once (safe to retry).")
@click.pass_obj
def send_event(obj: _Obj, run_id: str, name: str, data: str | None, event_id: str | None) -> None:
    """Send the event NAME to a run."""
    value = _json_arg(data, "--data")
    with _errors():
        _client(obj, obj.settings.app or "").send_event(run_id, name, value, event_id=event_id)
        click.echo(f"event {name!r} sent to {run_id}")


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def status(obj: _Obj, run_id: str, as_json: bool) -> None:
    """Show a run's timeline and why it waits."""
    with _errors():
        tl = _client(obj, "").status(run_id)
    click.echo(json.dumps(tl.to_json(), indent=2) if as_json else timeline_text(tl))


@cli.command("list")
@click.option(
    "--status", "status_", type=click.Choice(ALL_STATUSES), help="Only runs in this status."
)
@click.option("--saga", help="Only runs of this saga.")
@click.option("--limit", default=50, type=click.IntRange(1, 10_000), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_obj
def list_runs(obj: _Obj, status_: str | None, saga: str | None, limit: int, as_json: bool) -> None:
    """List runs, newest first, with counts by status."""
    with _errors():
        store = obj.store()
        runs = store.list_runs(status=status_, saga=saga, limit=limit)
        counts = store.count_runs(saga=saga)
    if as_json:
        rows = [
            {
                "run_id": r.run_id,
                "saga": r.saga,
                "status": r.status,
                "created_at": r.created_at.isoformat(),
                "updated_at": r.updated_at.isoformat(),
            }
            for r in runs
        ]
        click.echo(json.dumps({"runs": rows, "counts": counts}, indent=2))
    else:
        click.echo(runs_text(runs, counts))


@cli.command()
@click.argument("run_id")
@click.option("--reason", help="Recorded in the history.")
@click.pass_obj
def cancel(obj: _Obj, run_id: str, reason: str | None) -> None:
    """Cancel a run: it stops at its next suspension point and compensates."""
    with _errors():
        _client(obj, "").cancel(run_id, reason)
    click.echo(f"cancellation of {run_id} requested")


@cli.command()
@click.argument("run_id")
@click.pass_obj
def retry(obj: _Obj, run_id: str) -> None:
    """Resume a run in needs_attention once its cause is fixed."""
    with _errors():
        _client(obj, "").retry(run_id)
    click.echo(f"retry of {run_id} requested")


@cli.group()
def db() -> None:
    """Manage the database schema."""


@db.command()
@click.pass_obj
def upgrade(obj: _Obj) -> None:
    """Apply pending schema migrations."""
    with _errors():
        store = SqlStore(obj.settings.database_url)
        before, after = store.upgrade()
    if before == after:
        click.echo(f"schema is up to date (version {after})")
    else:
        click.echo(f"schema upgraded from version {before} to {after}")


cli.add_command(demo)


def main() -> None:
    cli(prog_name="sagaloop")


if __name__ == "__main__":
    main()
