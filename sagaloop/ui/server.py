"""Serving the console with uvicorn: in the foreground (``sagaloop ui``), or on a thread of
another command (``sagaloop dev --ui-port``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sagaloop.brokers.dead_letters import DeadLetter
from sagaloop.client import Client
from sagaloop.sagas.app import App
from sagaloop.ui.app import REFRESH, create_app
from sagaloop.ui.ops import BrokerOpener
from sagaloop.ui.security import check_bind

try:
    import uvicorn
except ModuleNotFoundError as e:  # pragma: no cover - the extra is missing
    from sagaloop.extras import missing_extra

    raise missing_extra("the console", "ui", e) from e


def _server(
    client: Client,
    app: App | None,
    host: str,
    port: int,
    token: str | None,
    refresh: float = REFRESH,
    dead_letters: Callable[[int], list[DeadLetter]] | None = None,
    broker: BrokerOpener | None = None,
) -> uvicorn.Server:
    check_bind(host, token)
    config = uvicorn.Config(
        create_app(client, app, token, refresh=refresh, dead_letters=dead_letters, broker=broker),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,  # addresses may carry ?token=
        server_header=False,
    )
    return uvicorn.Server(config)


def serve(
    client: Client,
    app: App | None = None,
    *,
    host: str,
    port: int,
    token: str | None,
    refresh: float = REFRESH,
    dead_letters: Callable[[int], list[DeadLetter]] | None = None,
    broker: BrokerOpener | None = None,
) -> None:
    """Serve the console until SIGTERM or Ctrl-C (``dead_letters``, ``broker``: see
    :func:`~sagaloop.ui.create_app`)."""
    _server(client, app, host, port, token, refresh, dead_letters, broker).run()


def serve_in_thread(
    client: Client,
    app: App | None = None,
    *,
    host: str,
    port: int,
    token: str | None,
    dead_letters: Callable[[int], list[DeadLetter]] | None = None,
    broker: BrokerOpener | None = None,
) -> Callable[[], None]:
    """Serve the console on a daemon thread, once it listens; returns what stops it. Raises
    OSError when it cannot listen (the port is taken, say)."""
    server = _server(client, app, host, port, token, dead_letters=dead_letters, broker=broker)
    thread = threading.Thread(target=server.run, name="sagaloop-ui", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise OSError(f"the console could not listen on {host}:{port}")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return stop
