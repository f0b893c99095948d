"""Service commands: ``dev``, ``engine``, ``worker``; and ``health`` and ``schema``."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn, TypeVar

import click

from sagaloop._secrets import mask_url
from sagaloop.cli.common import Obj, app_option, errors
from sagaloop.cli.render import pairs_text
from sagaloop.cli.ui import with_ui_port
from sagaloop.engine.messages import EventMessage, PublishMessage, StartMessage, UpdateMessage
from sagaloop.engine.ports import Broker
from sagaloop.errors import (
    AccessRefusedError,
    SagaloopError,
    SchemaOutdatedError,
    SchemaTooNewError,
)
from sagaloop.runtime import crashpoints, liveness
from sagaloop.runtime import registry as processes
from sagaloop.runtime.assembly import Roles, Tuning
from sagaloop.runtime.service import EXIT_ACCESS_REFUSED, EXIT_THREAD_DIED, GRACE, Service
from sagaloop.store.sql import SqlStore

logger = logging.getLogger("sagaloop.service")


def _refused(obj: Obj, role: str, e: AccessRefusedError, what: str, url: str) -> NoReturn:
    """Say in one line what the server refused, and exit with ``EXIT_ACCESS_REFUSED``: waiting
    would not help (unlike an unreachable or busy server, which is waited for)."""
    setting = f"SAGALOOP_{what.upper()}_URL" + (" (or --database-url)" * (what == "database"))
    logger.critical(
        "%s",
        obj.scrub(
            f"{role}: cannot connect to the {what} {mask_url(url)}: {e.reason}; check "
            f"{setting}. Stopping with exit status {EXIT_ACCESS_REFUSED} (see "
            "docs/troubleshooting.md)"
        ),
    )
    sys.exit(EXIT_ACCESS_REFUSED)


def _wait_for_database(
    obj: Obj,
    stop: threading.Event,
    *,
    upgrade: bool,
    role: str = "sagaloop",
    connections: int,
) -> SqlStore:
    """Connect and verify the schema, retrying with backoff while the database is down or
    busy; exit at once if it refuses the login or the database (see :func:`_refused`).
    ``connections``: the store's pool size (a service's ``Tuning.connections``)."""
    delay = 0.5
    while True:
        try:
            return obj.store(upgrade=upgrade, connections=connections)
        except (SchemaOutdatedError, SchemaTooNewError) as e:
            raise click.ClickException(str(e)) from e
        except AccessRefusedError as e:
            _refused(obj, role, e, "database", obj.settings.database_url)
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


def _wait_for_broker(
    obj: Obj, store: SqlStore, stop: threading.Event, *, role: str = "sagaloop"
) -> Broker:
    """Connect to the broker, retrying with backoff while it is down; exit at once if it
    refuses the login or the virtual host (see :func:`_refused`)."""
    delay = 0.5
    while True:
        try:
            return obj.broker(store, connect_timeout=10)
        except AccessRefusedError as e:
            _refused(obj, role, e, "broker", obj.settings.broker_url)
        except SagaloopError as e:
            if stop.is_set():
                raise click.ClickException(f"stopped while waiting for the broker: {e}") from e
            logger.warning("broker unavailable (%s); retrying in %.1f s", e, delay)
            stop.wait(delay)
            delay = min(delay * 2, 10.0)


@dataclasses.dataclass(frozen=True)
class Serving:
    """The options every service command takes (``dev``, ``engine``, ``worker``)."""

    app_spec: str | None
    concurrency: int
    poll: float
    grace: float = GRACE
    metrics: tuple[int | None, str] = (None, "127.0.0.1")


def _serve(obj: Obj, serving: Serving, role: str, *, upgrade: bool, roles: Roles) -> None:
    app_spec, concurrency, poll = serving.app_spec, serving.concurrency, serving.poll
    metrics, grace = serving.metrics, serving.grace
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with errors():
        if obj.settings.crash_at:
            crashpoints.arm(obj.settings.crash_at)
        app = obj.app(app_spec)
        tuning = Tuning(
            concurrency=concurrency,
            poll=poll,
            heartbeat=obj.settings.lease / 3,
            lease=timedelta(seconds=obj.settings.lease),
            activation_deadline=obj.settings.activation_deadline,
        )
        store = _wait_for_database(
            obj, stop, upgrade=upgrade, role=role, connections=tuning.connections
        )
        broker = _wait_for_broker(obj, store, stop, role=role)
        retention = timedelta(days=obj.settings.retention_days) if role != "worker" else None
        runtime = Service(
            app,
            store,
            broker,
            roles=dataclasses.replace(roles, retention=retention, registry=True),
            tuning=tuning,
            name=f"{role}@{_host()}",
            streams=obj.streams(),
        )
        metrics_server = _start_metrics(store, broker, *metrics)
    runtime.start(role=role, on_death=stop.set)
    queues = app.queues if roles.queues is None else roles.queues
    work = (["the engine and timers"] if roles.engine else []) + (
        [f"steps of queue(s) {', '.join(queues)}"] if queues else []
    )
    logger.info(
        "%s: app %r ready: database %s, broker %s; running %s (Ctrl-C or SIGTERM stops it)",
        role,
        app.name,
        mask_url(obj.settings.database_url),
        mask_url(obj.settings.broker_url),
        " and ".join(work),
    )
    stop.wait()
    logger.info("%s: stopping (finishing the messages in hand, for at most %g s)", role, grace)
    cut_off = runtime.stop(grace)
    if cut_off:
        _exit_cut_off(role, grace, cut_off, runtime.deaths)
    broker.close()  # what the process still held goes back to the queue
    if metrics_server is not None:
        metrics_server.stop()
    store.close()
    if runtime.deaths:
        _exit_dead(role, runtime.deaths)
    logger.info("%s: stopped", role)


def _exit_cut_off(role: str, grace: float, cut_off: list[str], deaths: dict[str, str]) -> NoReturn:
    """Exit now, although threads still run (a step that ignores its timeout, or has none):
    Python cannot stop them, and waiting longer would outlast the supervisor's patience. What
    they ran is in doubt, exactly as after a crash: their messages are not acknowledged, so
    they are delivered again (in-process steps: once their claim runs out) and reconciled."""
    logger.warning(
        "%s: still running after the grace of %g s: %s; exiting now: these attempts are in "
        "doubt, as after a crash (their messages are delivered again)",
        role,
        grace,
        "; ".join(cut_off),
    )
    if deaths:
        _say_dead(role, deaths)
    logging.shutdown()  # flush the handlers: os._exit does not
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_THREAD_DIED if deaths else 0)


def _start_metrics(store: SqlStore, broker: Broker, port: int | None, host: str) -> Any:
    """The Prometheus endpoint of ``--metrics-port`` (None without it)."""
    if port is None:
        return None
    try:
        from sagaloop.observability.metrics import SagaloopCollector, serve_metrics
    except ImportError as e:  # the extra is missing: the message says what to install
        raise click.ClickException(str(e)) from e
    server = serve_metrics(port, host, collector=SagaloopCollector(store, broker))
    logger.info("metrics at %s", server.url)
    return server


def _exit_dead(role: str, deaths: dict[str, str]) -> None:
    """Say on stderr which threads died and why, and exit with ``EXIT_THREAD_DIED``."""
    _say_dead(role, deaths)
    sys.exit(EXIT_THREAD_DIED)


def _say_dead(role: str, deaths: dict[str, str]) -> None:
    why = "; ".join(f"thread {name!r} died: {what}" for name, what in deaths.items())
    click.echo(
        f"sagaloop {role}: stopped because a thread died ({why}). Its messages are delivered "
        f"again; exiting with status {EXIT_THREAD_DIED} so that a supervisor restarts it (see "
        "docs/troubleshooting.md, 'A service exits with status 70').",
        err=True,
    )


def _host() -> str:
    import os
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


FC = TypeVar("FC", bound=Callable[..., Any])


def _concurrency_option(help: str) -> Callable[[FC], FC]:
    return click.option(
        "--concurrency", default=4, type=click.IntRange(1, 256), show_default=True, help=help
    )


_concurrency = _concurrency_option("Steps run at once by this process.")
_metrics_port = click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (the metrics extra, from a checkout: "
    "pip install -e '.[metrics]'; see docs/operations.md, 'Metrics').",
)
_metrics_host = click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="The address of the metrics endpoint (0.0.0.0: every interface).",
)
_grace = click.option(
    "--grace",
    default=GRACE,
    type=click.FloatRange(0, 3600),
    show_default=True,
    envvar="SAGALOOP_GRACE",
    help="Seconds a stopping process (SIGTERM, Ctrl-C) waits for the steps it runs before it "
    "exits anyway; what still ran is then in doubt, as after a crash (docs/operations.md).",
)
_poll = click.option(
    "--poll",
    default=0.1,
    type=click.FloatRange(0.01, 10),
    show_default=True,
    help="Seconds between looks at the database for work made by other processes.",
)


def _service_options(concurrency: Callable[[FC], FC]) -> Callable[[FC], FC]:
    """The options of a service command, in the order ``--help`` shows them."""

    def add(command: FC) -> FC:
        for option in (_metrics_host, _metrics_port, _grace, _poll, concurrency, app_option):
            command = option(command)
        return command

    return add


def _serving(command: Callable[..., None]) -> Callable[..., None]:
    """Hands a service command its options as one :class:`Serving` (put it just above the
    ``def``); the command's own options pass through."""

    @functools.wraps(command)
    def collect(
        obj: Obj,
        *,
        app_spec: str | None,
        concurrency: int,
        poll: float,
        grace: float,
        metrics_port: int | None,
        metrics_host: str,
        **rest: Any,
    ) -> None:
        metrics = (metrics_port, metrics_host)
        command(obj, Serving(app_spec, concurrency, poll, grace, metrics), **rest)

    return collect


@click.command()
@_service_options(_concurrency)
@click.pass_obj
@with_ui_port
@_serving
def dev(obj: Obj, serving: Serving) -> None:
    """Run the engine, the timers and workers for every queue in one process (the embedded
    default). Applies pending schema migrations first. Stops cleanly on SIGTERM or Ctrl-C."""
    _serve(obj, serving, "dev", upgrade=True, roles=Roles())


@click.command()
@_service_options(_concurrency_option("In-process steps (local=True) run at once by this process."))
@click.pass_obj
@_serving
def engine(obj: Obj, serving: Serving) -> None:
    """Run the engine: activations, in-process steps, timers, the outbox relay and retention.
    Run as many as you like; activations of one run are serialized by the database."""
    _serve(obj, serving, "engine", upgrade=False, roles=Roles(queues=()))


@click.command()
@click.option(
    "--queue",
    "queues",
    required=True,
    help="Step queues to consume, comma-separated (as declared with @app.step(queue=...)).",
)
@_service_options(_concurrency)
@click.pass_obj
@_serving
def worker(obj: Obj, serving: Serving, queues: str) -> None:
    """Run steps from the given queues."""
    names = [q.strip() for q in queues.split(",") if q.strip()]
    with errors():
        app = obj.app(serving.app_spec)
    unknown = sorted(set(names) - set(app.queues))
    if unknown:
        raise click.BadParameter(
            f"app {app.name!r} has no step on {unknown}; its queues: {app.queues}",
            param_hint="--queue",
        )
    roles = Roles(engine=False, timers=False, queues=names)
    _serve(obj, serving, "worker", upgrade=False, roles=roles)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--live",
    is_flag=True,
    help="The liveness form: judge this host's service processes from their liveness files "
    "alone, never the database or the broker (a container's liveness probe).",
)
@click.option(
    "--max-outbox-age",
    default=60.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Unhealthy when the oldest unsent message is older than this many seconds.",
)
@click.option(
    "--local",
    is_flag=True,
    help="Readiness form: judge only the service processes of this host (in the database).",
)
@click.pass_context
def health(
    ctx: click.Context, as_json: bool, live: bool, max_outbox_age: float, local: bool
) -> None:
    """Exit 1 when something is wrong; print a table, or JSON with --json.

    Readiness (the default; for readiness probes and alerting): check the database, the schema,
    the broker, the outbox and the service processes (engine, worker, dev) of every app in the
    database, and count runs and dead letters.

    Liveness (--live; for liveness probes): check only this host's service processes, from the
    files they refresh every 5 s, never the database or the broker: a saturated or down
    database does not fail it, a stuck process or one reporting a problem does."""
    if live:
        explicit = [
            f"--{name.replace('_', '-')}"
            for name in ("local", "max_outbox_age")
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        ]
        if explicit:
            raise click.UsageError(
                f"--live judges the liveness files only; {' and '.join(explicit)} "
                f"{'belongs' if len(explicit) == 1 else 'belong'} to the readiness form "
                "(sagaloop health without --live)"
            )
        _health_live(as_json)
    obj: Obj = ctx.obj
    from sagaloop.brokers.dead_letters import DeadLetters

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
        ok = _check_start_backlog(store, checks) and ok
        # The broker's dead letters: the database's table for the database broker; for
        # another broker, its own (RabbitMQ: the queue <namespace>.dead; None when it cannot
        # be reached), and the table then holds the outbox rows the relay could not publish.
        in_database = obj.settings.broker_url == "database"
        checks["dead_letters"] = store.count_dead_letters() if in_database else None
        if not in_database:
            checks["outbox_dead_letters"] = store.count_dead_letters()
        try:
            broker = obj.broker(store, connect_timeout=5)
            try:
                broker.declare([])
                if not in_database and isinstance(broker, DeadLetters):
                    try:
                        checks["dead_letters"] = broker.count_dead_letters()
                    except SagaloopError as e:  # the services serve on without it (the node
                        # of RabbitMQ's dead-letter queue is down, say): unknown, not unhealthy
                        checks["dead_letters_unknown"] = str(e)
            finally:
                broker.close()
            checks["broker"] = "ok"
        except (SagaloopError, click.ClickException) as e:
            checks["broker"] = f"error: {e}"
            ok = False
        ok = _check_processes(store, checks, local=local) and ok
        store.close()
    checks["healthy"] = ok
    if as_json:
        click.echo(json.dumps(checks, indent=2))
        sys.exit(0 if ok else 1)

    def text(value: Any) -> str:
        if value is None:
            return "unknown"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, dict):
            return ", ".join(f"{k} {text(v)}" for k, v in value.items()) or "none"
        return str(value)

    rows: list[tuple[str, str | None]] = []
    for key, value in checks.items():
        if key != "processes":
            rows.append((key, text(value)))
            continue
        rows.append((key, f"{len(value)} registered"))
        for p in value:
            rows.append((f"  {p['name']} ({p['role']} of app {p['app']!r}): {p['state']}", None))
            if p.get("notes"):
                rows.append((f"    {p['notes']}", None))
    click.echo(pairs_text(rows))
    sys.exit(0 if ok else 1)


def _health_live(as_json: bool) -> NoReturn:
    """``sagaloop health --live``: this host's service processes, from their liveness files."""
    directory = liveness.run_dir()
    verdict = liveness.judge(liveness.read_all(directory), datetime.now(UTC))
    if as_json:
        click.echo(verdict.model_dump_json(indent=2))
        sys.exit(0 if verdict.healthy else 1)
    rows: list[tuple[str, str | None]] = [
        ("run_dir", str(directory)),
        ("processes", f"{len(verdict.processes)} live"),
    ]
    for p in verdict.processes:
        head = f"  {p.name} ({p.role} of app {p.app!r}), pid {p.pid}"
        rows.append((f"{head}: refreshed {p.beat_age_s} s ago", None))
        rows += [(f"    problem: {problem}", None) for problem in p.problems]
    rows += [("healthy", "yes" if verdict.healthy else "no"), ("reason", verdict.reason)]
    click.echo(pairs_text(rows))
    sys.exit(0 if verdict.healthy else 1)


def _check_start_backlog(store: SqlStore, checks: dict[str, Any]) -> bool:
    """Per app, the runs that wait for an engine to take them up, and the limit past which
    ``Client.start`` refuses new runs; False when an app is at it (see docs/operations.md,
    "Overload")."""
    from sagaloop.client.admission import START_BACKLOG, limit_from_env

    limit = limit_from_env("SAGALOOP_START_BACKLOG", None, START_BACKLOG)
    backlogs = store.start_backlogs()
    checks["start_backlog"] = backlogs
    checks["start_backlog_limit"] = limit
    full = sorted(app for app, n in backlogs.items() if limit and n >= limit)
    if full:
        checks["admission"] = (
            f"error: app(s) {', '.join(map(repr, full))} at the start backlog limit ({limit}): "
            "new runs are refused until the engines take the backlog up"
        )
    return not full


def _check_processes(store: SqlStore, checks: dict[str, Any], *, local: bool) -> bool:
    """List the registered processes in ``checks``; False when one of them reports a problem
    (see ``sagaloop.runtime.registry.assess``)."""
    try:
        rows = store.processes()
    except SagaloopError as e:
        checks["services"] = f"error: cannot read the process registry: {e}"
        return False
    now = datetime.now(UTC)
    listed, problems = processes.assess(rows, now, host=socket.gethostname() if local else None)
    if not local:  # the fleet: does every app with runs in flight have an engine and workers?
        try:
            in_flight = store.runs_in_flight()
        except SagaloopError as e:
            checks["runs_in_flight"] = f"error: {e}"
            return False
        unserved, missing = processes.fleet(rows, now, in_flight)
        checks["unserved_queues"] = {
            app: ", ".join(queues) for app, queues in sorted(unserved.items())
        }
        problems += missing
    checks["processes"] = listed
    checks["services"] = "error: " + "; ".join(problems) if problems else "ok"
    return not problems


@click.command()
def schema() -> None:
    """Print the JSON Schema of the start, event, publish and update messages (the public message
    contract)."""
    click.echo(
        json.dumps(
            {
                "start": StartMessage.model_json_schema(),
                "event": EventMessage.model_json_schema(),
                "publish": PublishMessage.model_json_schema(),
                "update": UpdateMessage.model_json_schema(),
            },
            indent=2,
        )
    )
