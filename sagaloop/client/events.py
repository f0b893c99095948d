"""What :class:`~sagaloop.client.client.Client` does for events and debounced starts: a start
of a debounced saga joining its key's window, the window a run id waits in, an event published
to an app, and the check that a run would take an event sent to it. ``Client.update`` is
``updates``; approvals' answers are ``approvals``."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from sagaloop.client.checks import check_message, check_text, to_json
from sagaloop.engine.event_fit import check_event
from sagaloop.engine.messages import (
    ENGINE_CONSUMER,
    Envelope,
    PublishPayload,
    derived_id,
    engine_queue,
    inbox_key,
)
from sagaloop.engine.ports import Debounced, DebounceStore, Outgoing, RunRecord
from sagaloop.engine.state import RunState
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import SagaDef
from sagaloop.sagas.convert import ANY
from sagaloop.sagas.published import PublishedEvent

if TYPE_CHECKING:
    from sagaloop.client.client import Client


def debounce(
    client: Client,
    definition: SagaDef[Any, Any],
    input: Any,
    *,
    run_id: str | None,
    event: tuple[str, Any] | None,
) -> str:
    """A start of a debounced saga: recorded in its key's window (opened if none is), whose
    run starts once the window is due (``sagaloop.runtime.debounce``). Returns the window's
    run id: the run that will have this start's input, unless a later start of the window
    replaces it."""
    policy, name = definition.debounce, definition.name
    assert policy is not None
    if run_id is not None or event is not None:
        raise ValidationError(
            f"saga {name!r} is debounced: its run id is its window's and its start takes "
            "no event (send the event to the run once it started)"
        )
    if not isinstance(client.store, DebounceStore):
        raise ValidationError(f"saga {name!r} is debounced: it needs a SqlStore")
    input_json = to_json(input, definition.input, f"input of saga {name!r}")
    new_id = uuid.uuid4().hex  # the run's, if this start opens the window
    check_message(Envelope(type="start", run_id=new_id, saga=name, payload={"input": input_json}))
    value = definition.input.from_json(input_json, what=f"input of saga {name!r}")
    window = client.store.debounce(
        str(client.app_name),
        name,
        policy.key_of(value),
        input_json,
        client.clock.now(),
        policy.wait,
        policy.bound,
        run_id=new_id,
    )
    return window.run_id


def window(client: Client, run_id: str) -> Debounced | None:
    """The debounce window that will start ``run_id`` (of the client's app when scoped)."""
    if not isinstance(client.store, DebounceStore):
        return None
    found = client.store.find_debounced(run_id)
    if found is not None and client.own_app_only and found.app != client.app_name:
        return None
    return found


def debounced_text(window: Debounced) -> str:
    """What a debounced start not started yet is, in a line."""
    starts = "start" if window.starts == 1 else "starts"
    return (
        f"a debounced start of saga {window.saga!r} (key {window.key!r}, {window.starts} "
        f"{starts} gathered), due at {window.due_at:%Y-%m-%d %H:%M:%S} UTC"
    )


def publish(
    client: Client, name: str, data: Any, *, key: str | None, event_id: str | None
) -> PublishedEvent:
    """``Client.publish_event``: the publish message, checked, on the app's engine queue."""
    if not client.app_name:
        raise ValidationError("Client(store, app) needs the app to publish events")
    check_text(name, "event name", PublishPayload, "name")
    if key is not None:
        check_text(key, "key", PublishPayload, "key")
    event_id = check_text(uuid.uuid4().hex if event_id is None else event_id, "event_id")
    payload: dict[str, Any] = {"name": name, "data": to_json(data, ANY, "event data")}
    if key is not None:
        payload["key"] = key
    env = client._message("publish", event_id, payload, derived_id("publish", event_id))
    with client.store.transaction() as tx:
        queue = engine_queue(client.app_name)
        client.store.enqueue(tx, [Outgoing(queue, env)], client.clock.now())
    return PublishedEvent(name, payload["data"], key, event_id)


def taken(client: Client, run: RunRecord, env: Envelope) -> bool:
    """Whether ``run``'s engine processed ``env`` already (its inbox has it): a send retried
    after the event it repeats ended the run."""
    key = inbox_key(run.app, env)
    return bool(client.store.inbox_get(None, ENGINE_CONSUMER, key)[0])


def check_fits(client: Client, run: RunRecord, name: str, data: Any) -> None:
    """Refuse an event that the run would refuse (:func:`event_fit.check_event`): a name its
    saga does not declare, or data that does not fit the model of the wait open for it or,
    before the wait begins, the declared one. The saga's declaration is read from the client's
    App if it declares the run's saga, else from the run's start."""
    state = RunState(run.run_id)
    for event in client.store.load_history(None, run.run_id):
        state.apply(event)
    app = client.app
    saga = app.get_saga(run.saga) if app is not None and run.app == app.name else None
    check_event(state, name, data, saga.events if saga is not None else None)
