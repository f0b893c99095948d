"""What every CLI command shares: settings, the store, the broker, error reporting."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from sagaloop._secrets import passwords_of, scrub
from sagaloop.errors import SagaloopError, ValidationError

if TYPE_CHECKING:  # imported where used (issue 26): SQLAlchemy, pydantic and the drivers load
    # when a command opens the store or the broker, not for ``sagaloop --help`` or a usage error
    from sagaloop.cli.settings import Settings
    from sagaloop.engine.ports import Broker, Streams
    from sagaloop.sagas.app import App
    from sagaloop.store.sql import SqlStore

OPTIONS = {
    "database_url": "--database-url",
    "broker_url": "--broker-url",
    "log_format": "--log-format",
    "verbose": "-v",
}
"""The settings that a global option of the command line sets too (over the environment)."""


class Obj:
    """The click context object: settings read once, at start-up, from the ``SAGALOOP_...``
    environment variables, with the global options given on the command line over them."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        broker_url: str | None = None,
        log_format: str | None = None,
        verbose: int | None = None,
    ) -> None:
        given: dict[str, Any] = {
            "database_url": database_url or None,
            "broker_url": broker_url or None,
            "log_format": log_format,
            "verbose": verbose or None,
        }
        self.settings = load_settings({k: v for k, v in given.items() if v is not None})

    def scrub(self, text: str) -> str:
        """``text`` fit to print: without the configured database and broker passwords, nor any
        piece of them (see sagaloop._secrets)."""
        settings = self.settings
        return scrub(text, *passwords_of(settings.database_url), *passwords_of(settings.broker_url))

    def store(
        self, *, upgrade: bool = False, verify: bool = True, connections: int | None = None
    ) -> SqlStore:
        """The configured store (``connections``: its pool's size, by default ``open_store``'s;
        a service's is its ``Tuning.connections``)."""
        # SQLAlchemy: see the module
        from sagaloop.runtime.connect import CONNECTIONS, URLError, open_store

        url = self.settings.database_url
        size = CONNECTIONS if connections is None else connections
        try:
            return open_store(url, upgrade=upgrade, verify=verify, connections=size)
        except URLError as e:
            raise click.ClickException(self.scrub(str(e))) from e

    def app(self, spec: str | None) -> App:
        spec = spec or self.settings.app
        if not spec:
            raise click.ClickException("name the app with --app MODULE (or SAGALOOP_APP)")
        from sagaloop.cli.settings import load_app  # it imports the app's module: saga code

        return load_app(spec)

    def broker(self, store: SqlStore, *, connect_timeout: float | None = None) -> Broker:
        from sagaloop.runtime.connect import URLError, open_broker

        settings = self.settings
        try:
            return open_broker(
                settings.broker_url,
                store,
                lease=timedelta(seconds=settings.lease),
                namespace=settings.namespace,
                queue_type=settings.queue_type,
                connect_timeout=connect_timeout,
                what="SAGALOOP_BROKER_URL",
            )
        except URLError as e:
            raise click.ClickException(self.scrub(str(e))) from e
        except ImportError as e:  # the redis package is missing: the message says what to do
            raise click.ClickException(str(e)) from e
        except ValidationError as e:  # a namespace RabbitMQ's permissions could not fence
            raise click.ClickException(str(e)) from None

    def streams(self) -> Streams:
        """The per-run live channel: RabbitMQ's with an amqp:// broker, else this process's."""
        from sagaloop.runtime.connect import open_streams

        try:
            return open_streams(self.settings.broker_url, namespace=self.settings.namespace)
        except ValidationError as e:  # a usage error (one line), not retried like an outage
            raise click.ClickException(str(e)) from None


def load_settings(given: dict[str, Any]) -> Settings:
    """The settings: ``given`` (the command line's) over the environment. A value that does not
    fit is a usage error naming the variable (or option) to fix, not a traceback."""
    from sagaloop.cli.settings import SettingError, Settings  # plain Python: no pydantic

    try:
        return Settings.read(given)
    except SettingError as e:
        field = e.field
        variable = f"SAGALOOP_{field.upper()}"
        if field in given:
            where = OPTIONS.get(field, variable)
        else:
            where = f"{variable} ({OPTIONS[field]})" if field in OPTIONS else variable
        raise click.BadParameter(f"{e.value!r:.80}: {e.message}", param_hint=where) from None


@contextmanager
def errors() -> Iterator[None]:
    """Report sagaloop's errors as one line and a non-zero exit."""
    try:
        yield
    except SagaloopError as e:
        raise click.ClickException(str(e)) from e


def json_arg(value: str | None, what: str) -> Any:
    """The JSON text of an option (``@path`` reads it from the file ``path``), parsed as the
    engine parses messages: ``NaN`` and ``Infinity`` (which Python's json accepts) and numbers
    too large for a float are refused."""
    if value is None:
        return None
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text()
        except OSError as e:
            raise click.BadParameter(
                f"cannot read {value[1:]!r}: {e.strerror or e}", param_hint=what
            ) from None

    def refuse(constant: str) -> Any:
        raise click.BadParameter(
            f"{constant} is not JSON: JSON has no NaN or Infinity (send null or a string)",
            param_hint=what,
        )

    def number(text: str) -> float:
        parsed = float(text)
        if math.isinf(parsed):
            raise click.BadParameter(
                f"{text} is too large for a float (it would be Infinity, which JSON has not)",
                param_hint=what,
            )
        return parsed

    try:
        return json.loads(value, parse_constant=refuse, parse_float=number)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"not valid JSON: {e.msg} at position {e.pos}", param_hint=what
        ) from None
    except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, deep nesting
        raise click.BadParameter(f"not JSON sagaloop accepts: {e}", param_hint=what) from None


app_option = click.option("--app", "app_spec", help="The app: MODULE or MODULE:ATTRIBUTE.")
