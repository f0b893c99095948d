"""The fan-out of a published event (``Client.publish_event``, ``ctx.publish_event``): the
engine delivers it to every run subscribed to or waiting on its name and key, and starts the
sagas declared with ``on_event``, in the transaction of the ``publish`` message's inbox row."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sagaloop.engine.messages import Envelope, PublishPayload, derived_id, engine_queue, start_queue
from sagaloop.engine.ports import Outgoing, Store, SubscriptionStore, Tx
from sagaloop.errors import MessageError
from sagaloop.sagas.app import App
from sagaloop.sagas.published import PublishedEvent


def fan_out(
    store: Store,
    app: App,
    tx: Tx,
    env: Envelope,
    event: PublishPayload,
    now: datetime,
) -> None:
    """Deliver a published event, in the transaction that records it as processed: an
    ``event`` message to every run subscribed to (or waiting on) its name and key, and a
    start of each saga declared with ``on_event`` its name. Their ids derive from the
    event's, so a fan-out done again (a crash before the commit) sends the same messages,
    which their consumers take once."""
    assert isinstance(store, SubscriptionStore)
    event_id, name, key = env.run_id, event.name, event.key
    payload: dict[str, Any] = {"name": name, "data": event.data}
    if key is not None:
        payload["key"] = key
    queue = engine_queue(app.name)
    out: list[Outgoing] = []
    for run_id in store.subscribers(tx, app.name, name, key):
        message_id = derived_id("delivered", event_id, run_id)
        message = Envelope(
            type="event",
            message_id=message_id,
            run_id=run_id,
            payload=payload,
            created_at=now,
            trace=env.trace,
        )
        out.append(Outgoing(queue, message))
    published = PublishedEvent(name, event.data, key, event_id)
    for saga in app.sagas.values():
        if saga.on_event != name:
            continue
        run_id = derived_id("on_event", saga.name, event_id)
        if saga.run_id_of is not None:
            try:
                run_id = saga.run_id_of(published)
            except Exception as e:
                raise MessageError(
                    f"the run_id function of saga {saga.name!r} raised for event "
                    f"{event_id!r}: {e!r:.300}"
                ) from e
            if not isinstance(run_id, str) or not 0 < len(run_id) <= 200:
                raise MessageError(
                    f"the run_id function of saga {saga.name!r} gave {run_id!r:.60} for "
                    f"event {event_id!r}: a run id is 1 to 200 characters"
                )
        start = Envelope(
            type="start",
            message_id=derived_id("on_event", saga.name, event_id),
            run_id=run_id,
            saga=saga.name,
            payload={"input": event.data},
            created_at=now,
            trace=env.trace,
        )
        out.append(Outgoing(start_queue(app.name), start))
    store.enqueue(tx, out, now)
