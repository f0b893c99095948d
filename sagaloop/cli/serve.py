"""Service commands: ``dev``, ``engine``, ``worker``; and ``health`` and ``schema``."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from sagaloop.cli.common import Obj, app_option, errors
from sagaloop.cli.services import Runtime
from sagaloop.cli.settings import mask_url
from sagaloop.engine import crashpoints
from sagaloop.engine.messages import EventMessage, StartMessage
from sagaloop.engine.ports import Broker
from sagaloop.errors import SagaloopError, SchemaOutdatedError, SchemaTooNewError
from sagaloop.store.sql import SqlStore

logger = logging.getLogger("sagaloop.service")


def _wait_for_database(obj: Obj, stop: threading.Event, *, upgrade: bool) -> SqlStore:
    """Connect and verify the schema, retrying with backoff while the database is down."""
    delay = 0.5
    while True:
        try:
            return obj.store(upgrade=upgrade)
        except (SchemaOutdatedError, SchemaTooNewError) as e:
            raise click.ClickException(str(e)) from e
        except SagaloopError as e:
            if stop.is_set():
                raise click.ClickException(f"stopped while waiting for the database: {e}") from e
            logger.warning(
                "database %s unavailable (%s); retrying in %.1f s",
                mask_url(obj.settings.database_url),
                e,
                delay,
            )
            stop.wait(delay)
            delay = min(delay * 2, 10.0)


def _wait_for_broker(obj: Obj, store: SqlStore, stop: threading.Event) -> Broker:
    """Connect to the broker, retrying with backoff while it is down."""
    delay = 0.5
    while True:
        try:
            return obj.broker(store, connect_timeout=10)
        except SagaloopError as e:
            if stop.is_set():
                raise click.ClickException(f"stopped while waiting for the broker: {e}") from e
            logger.warning("broker unavailable (%s); retrying in %.1f s", e, delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)


def _serve(obj: Obj, app_spec: str | None, role: str, *, upgrade: bool, **roles: Any) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with errors():
        if obj.settings.crash_at:
            crashpoints.arm(obj.settings.crash_at)
        app = obj.app(app_spec)
        store = _wait_for_database(obj, stop, upgrade=upgrade)
        broker = _wait_for_broker(obj, store, stop)
        runtime = Runtime(
            app,
            store,
            broker,
            heartbeat=obj.settings.lease / 3,
            relay_lease=timedelta(seconds=obj.settings.lease),
            retention=timedelta(days=obj.settings.retention_days) if role != "worker" else None,
            name=f"{role}@{_host()}",
            **roles,
        )
    runtime.start()
    logger.info(
        "%s: app %r, store %s, broker %s",
        role,
        app.name,
        mask_url(obj.settings.database_url),
        mask_url(obj.settings.broker_url),
    )
    stop.wait()
    logger.info("%s: stopping (finishing the messages in hand)", role)
    runtime.stop()
    broker.close()
    store.close()
    logger.info("%s: stopped", role)


def _host() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


_concurrency = click.option(
    "--concurrency",
    default=4,
    type=click.IntRange(1, 256),
    show_default=True,
    help="Steps run at once by this process.",
)
_poll = click.option(
    "--poll",
    default=0.1,
    type=click.FloatRange(0.01, 10),
    show_default=True,
    help="Seconds between looks at the database for work made by other processes.",
)


@click.command()
@app_option
@_concurrency
@_poll
@click.pass_obj
def dev(obj: Obj, app_spec: str | None, concurrency: int, poll: float) -> None:
    """Run the engine, the timers and workers for every queue in one process (the embedded
    default). Applies pending schema migrations first. Stops cleanly on SIGTERM or Ctrl-C."""
    _serve(obj, app_spec, "dev", upgrade=True, concurrency=concurrency, poll=poll)


@click.command()
@app_option
@_poll
@click.pass_obj
def engine(obj: Obj, app_spec: str | None, poll: float) -> None:
    """Run the engine: activations, timers, the outbox relay and retention. Run as many as you
    like; activations of one run are serialized by the database."""
    _serve(obj, app_spec, "engine", upgrade=False, queues=[], poll=poll)


@click.command()
@app_option
@click.option(
    "--queue",
    "queues",
    required=True,
    help="Step queues to consume, comma-separated (as declared with @app.step(queue=...)).",
)
@_concurrency
@_poll
@click.pass_obj
def worker(obj: Obj, app_spec: str | None, queues: str, concurrency: int, poll: float) -> None:
    """Run steps from the given queues."""
    names = [q.strip() for q in queues.split(",") if q.strip()]
    with errors():
        app = obj.app(app_spec)
    unknown = sorted(set(names) - set(app.queues))
    if unknown:
        raise click.BadParameter(
            f"app {app.name!r} has no step on {unknown}; its queues: {app.queues}",
            param_hint="--queue",
        )
    _serve(
        obj,
        app_spec,
        "worker",
        upgrade=False,
        engine=False,
        timers=False,
        queues=names,
        concurrency=concurrency,
        poll=poll,
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--max-outbox-age",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Unhealthy when the oldest unsent message is older than this many seconds.",
)
@click.pass_obj
def health(obj: Obj, as_json: bool, max_outbox_age: float) -> None:
    """Check the database, the schema and the broker; exit 1 when something is wrong. Usable as
    an orchestrator's liveness or readiness probe."""
    checks: dict[str, Any] = {}
    ok = True
    store = None
    try:
        store = obj.store()
        checks["database"] = "ok"
    except (SagaloopError, click.ClickException) as e:
        checks["database"] = f"error: {e}"
        ok = False
    if store is not None:
        oldest = store.oldest_outbox_message()
        age = (datetime.now(UTC) - oldest).total_seconds() if oldest else 0.0
        checks["oldest_unsent_message_s"] = round(age, 3)
        if obj.settings.broker_url != "database" and age > max_outbox_age:
            checks["outbox"] = f"error: a message waits {age:.0f} s to be published"
            ok = False
        checks["runs"] = store.count_runs()
        checks["dead_letters"] = len(store.dead_letters())
        try:
            broker = obj.broker(store, connect_timeout=5)
            broker.declare([])
            broker.close()
            checks["broker"] = "ok"
        except (SagaloopError, click.ClickException) as e:
            checks["broker"] = f"error: {e}"
            ok = False
        store.close()
    checks["healthy"] = ok
    if as_json:
        click.echo(json.dumps(checks, indent=2))
    else:
        for key, value in checks.items():
            click.echo(f"{key:<24} {value}")
    sys.exit(0 if ok else 1)


@click.command()
def schema() -> None:
    """Print the JSON Schema of the start and event messages (the public message contract)."""
    click.echo(
        json.dumps(
            {
                "start": StartMessage.model_json_schema(),
                "event": EventMessage.model_json_schema(),
            },
            indent=2,
        )
    )
