"""What every CLI command shares: settings, the store, the broker, error reporting."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import click

from sagaloop.cli.settings import Settings, load_app, mask_url
from sagaloop.engine.ports import Broker
from sagaloop.errors import SagaloopError
from sagaloop.sagas.app import App
from sagaloop.store.connect import scrub
from sagaloop.store.sql import SqlStore


class Obj:
    """The click context object: settings read once, at start-up."""

    def __init__(self, database_url: str | None) -> None:
        self.settings = Settings()
        if database_url:
            self.settings.database_url = database_url

    def store(self, *, upgrade: bool = False, verify: bool = True) -> SqlStore:
        try:
            store = SqlStore(self.settings.database_url)
        except Exception as e:
            raise click.ClickException(
                f"cannot use database {mask_url(self.settings.database_url)}: {e}"
            ) from e
        if upgrade:
            store.upgrade()
        elif verify:
            store.check_schema()
        return store

    def app(self, spec: str | None) -> App:
        spec = spec or self.settings.app
        if not spec:
            raise click.ClickException("name the app with --app MODULE (or SAGALOOP_APP)")
        return load_app(spec)

    def broker(self, store: SqlStore, *, connect_timeout: float | None = None) -> Broker:
        url = self.settings.broker_url
        lease = timedelta(seconds=self.settings.lease)
        if url == "database":
            from sagaloop.brokers.database import DatabaseBroker

            return DatabaseBroker(store, lease=lease)
        if url == "memory":
            from sagaloop.brokers.memory import MemoryBroker

            return MemoryBroker(lease=lease)
        if url.startswith(("amqp://", "amqps://")):
            from sagaloop.brokers.rabbitmq import RabbitBroker

            try:
                return RabbitBroker(
                    url,
                    namespace=self.settings.namespace,
                    queue_type=self.settings.queue_type,
                    lease=lease,
                    connect_timeout=timedelta(seconds=connect_timeout) if connect_timeout else None,
                )
            except ValueError as e:  # pika cannot parse the URL (a bad port, say)
                raise click.ClickException(
                    f"invalid SAGALOOP_BROKER_URL {mask_url(url)!r}: {scrub(str(e))}"
                ) from e
        raise click.ClickException(
            f"unsupported SAGALOOP_BROKER_URL {mask_url(url)!r}: use database, memory or amqp://"
        )


@contextmanager
def errors() -> Iterator[None]:
    """Report sagaloop's errors as one line and a non-zero exit."""
    try:
        yield
    except SagaloopError as e:
        raise click.ClickException(str(e)) from e


def json_arg(value: str | None, what: str) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(
            f"not valid JSON: {e.msg} at position {e.pos}", param_hint=what
        ) from None


app_option = click.option("--app", "app_spec", help="The app: MODULE or MODULE:ATTRIBUTE.")
