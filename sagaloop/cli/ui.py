"""``sagaloop ui``: the web console (the app is :mod:`sagaloop.ui`); and ``with_ui_port``, which
gives ``sagaloop dev`` a ``--ui-port`` that serves the console beside it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import click

from sagaloop.brokers.dead_letters import DeadLetter, DeadLetters
from sagaloop.cli.common import Obj, app_option, errors
from sagaloop.client import Client
from sagaloop.errors import BrokerError, ValidationError
from sagaloop.sagas.app import App

F = TypeVar("F", bound=Callable[..., Any])


def broker_of(obj: Obj) -> Callable[[], AbstractContextManager[Any]] | None:
    """What opens the configured broker for the console, as ``sagaloop dead-letters`` does
    (a connection per use: the console serves pages on threads); None for the database and
    memory brokers (the console uses the database broker over its own store)."""
    if obj.settings.broker_url in ("database", "memory"):
        return None

    @contextmanager
    def opened() -> Iterator[Any]:
        try:
            store = obj.store()
        except click.ClickException as e:
            raise BrokerError(e.message) from e
        try:
            try:
                broker = obj.broker(store, connect_timeout=5)
            except click.ClickException as e:
                raise BrokerError(e.message) from e
            try:
                yield broker
            finally:
                broker.close()
        finally:
            store.close()

    return opened


def dead_letters_of(obj: Obj) -> Callable[[int], list[DeadLetter]] | None:
    """What reads the dead letters of the configured broker for the console, as
    ``sagaloop dead-letters list`` does; None for the database and memory brokers (the
    console reads the table)."""
    opener = broker_of(obj)
    if opener is None:
        return None

    def read(limit: int) -> list[DeadLetter]:
        with opener() as broker:
            if not isinstance(broker, DeadLetters):
                raise BrokerError(
                    f"the broker {type(broker).__name__} cannot list its dead letters"
                )
            return broker.list_dead_letters(limit)

    return read


def console(obj: Obj, client: Client, app: App | None, token: str | None, **options: Any) -> Any:
    """The console's ASGI app as ``sagaloop ui`` serves it, over the configured broker."""
    from sagaloop.ui import create_app

    return create_app(
        client, app, token, dead_letters=dead_letters_of(obj), broker=broker_of(obj), **options
    )


def _console() -> Any:
    """:mod:`sagaloop.ui.server`, imported when a command needs it (the extra may be missing)."""
    try:
        from sagaloop.ui import server
    except ImportError as e:
        raise click.ClickException(str(e)) from e
    return server


@click.command("ui")
@app_option
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--token",
    envvar="SAGALOOP_UI_TOKEN",
    help="The token every request must carry (required beyond 127.0.0.1; prefer "
    "$SAGALOOP_UI_TOKEN, which no process listing shows). Open the console once as "
    "http://HOST:PORT/?token=TOKEN: a cookie keeps it.",
)
@click.option(
    "--refresh",
    default=2.0,
    show_default=True,
    type=click.FloatRange(0.1, 600),
    help="Seconds between an open page's looks for what moved.",
)
@click.pass_obj
def ui(
    obj: Obj, app_spec: str | None, host: str, port: int, token: str | None, refresh: float
) -> None:
    """Serve the web console: runs with filters and counts, each run's timeline, agent
    transcripts, approvals to approve or deny, send event, cancel and retry, dead letters.
    Runs execute in the app's engine and workers (`sagaloop dev`) on the same database: the
    console only reads and signals them. It also approves edited arguments, cancels now,
    resends dead letters and shows the workers and queues (/workers). Needs the `ui` extra
    (from a checkout: `pip install -e '.[ui]'`)."""
    server = _console()
    with errors():
        from sagaloop.ui.security import check_bind

        check_bind(host, token)
        app = obj.app(app_spec) if app_spec or obj.settings.app else None
        client = Client(obj.store(), app)
    shown = f"[{host}]" if ":" in host else host
    login = "?token=<your token>" if token else ""
    click.echo(f"sagaloop ui: http://{shown}:{port}/{login} (Ctrl-C stops it)", err=True)
    server.serve(
        client,
        app,
        host=host,
        port=port,
        token=token,
        refresh=refresh,
        dead_letters=dead_letters_of(obj),
        broker=broker_of(obj),
    )


def with_ui_port(command: F) -> F:
    """Give ``sagaloop dev`` ``--ui-port PORT``: the console on 127.0.0.1:PORT, on a thread of
    its process, for as long as it runs (put it just above the ``def``). Like ``dev``, it
    applies pending schema migrations first. It honours the token as ``sagaloop ui`` does
    (``--ui-token``, ``$SAGALOOP_UI_TOKEN``): with one set, every request must carry it."""

    @functools.wraps(command)
    def wrapper(
        *args: Any, ui_port: int | None = None, ui_token: str | None = None, **kwargs: Any
    ) -> Any:
        if ui_port is None:
            return command(*args, **kwargs)
        obj: Obj = click.get_current_context().obj
        server = _console()
        with errors():
            from sagaloop.ui.security import check_bind

            check_bind("127.0.0.1", ui_token)
            app_spec = kwargs.get("app_spec")
            app = obj.app(app_spec) if app_spec or obj.settings.app else None
            client = Client(obj.store(upgrade=True), app)
            try:
                stop = server.serve_in_thread(
                    client,
                    app,
                    host="127.0.0.1",
                    port=ui_port,
                    token=ui_token,
                    dead_letters=dead_letters_of(obj),
                    broker=broker_of(obj),
                )
            except OSError as e:
                raise ValidationError(f"{e}: is port {ui_port} taken?") from e
        login = "?token=<your token>" if ui_token else ""
        click.echo(f"sagaloop ui: http://127.0.0.1:{ui_port}/{login}", err=True)
        try:
            return command(*args, **kwargs)
        finally:
            stop()

    port_option = click.option(
        "--ui-port",
        type=click.IntRange(1, 65535),
        default=None,
        help="Also serve the web console on 127.0.0.1:PORT (needs sagaloop[ui]).",
    )
    token_option = click.option(
        "--ui-token",
        envvar="SAGALOOP_UI_TOKEN",
        default=None,
        show_envvar=True,
        help="With --ui-port: the token every request to the console must carry, as for "
        "`sagaloop ui` (prefer $SAGALOOP_UI_TOKEN, which no process listing shows).",
    )
    return port_option(token_option(wrapper))  # type: ignore[return-value]
