"""``sagaloop publish`` and ``sagaloop update``: an event published to the app's subscribed runs,
and an update sent to a run whose answer is printed."""

from __future__ import annotations

import json

import click

from sagaloop.cli.common import Obj, app_option, errors, json_arg
from sagaloop.cli.render import printable
from sagaloop.client import Client


@click.command("publish")
@click.argument("name")
@click.option("--data", help="The event's data as JSON.")
@click.option("--key", help="The event's key: it reaches the runs waiting on or subscribed to it.")
@click.option("--event-id", help="Publishes with the same id are fanned out once (safe to retry).")
@app_option
@click.pass_obj
def publish(
    obj: Obj,
    name: str,
    data: str | None,
    key: str | None,
    event_id: str | None,
    app_spec: str | None,
) -> None:
    """Publish the event NAME to the app's runs subscribed to or waiting on it (and start the
    runs of the sagas declared with ``on_event=NAME``); print its event id."""
    value = json_arg(data, "--data")
    with errors():
        app = obj.app(app_spec)
        event = Client(obj.store(), app).publish_event(name, value, key=key, event_id=event_id)
        click.echo(printable(event.event_id))


@click.command("update")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", help="The update's data as JSON.")
@click.option("--update-id", help="Sends with the same id are applied once and answered the same.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the answer.",
)
@click.pass_obj
def update(
    obj: Obj, run_id: str, name: str, data: str | None, update_id: str | None, timeout: float
) -> None:
    """Send the update NAME to a run (its ``ctx.on_update`` handler) and print the answer as
    JSON. Exit 1, saying why, if the run refused the update or its handler raised; on a
    timeout the update may still be applied: send it again with the same --update-id."""
    value = json_arg(data, "--data")
    with errors():
        try:
            client = Client(obj.store())
            answer = client.update(run_id, name, value, update_id=update_id, timeout=timeout)
        except TimeoutError as e:
            raise click.ClickException(f"no answer yet: {e}") from e
    click.echo(json.dumps(answer, ensure_ascii=False))
