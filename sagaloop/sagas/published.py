"""Published events (``Client.publish_event``, ``ctx.publish_event``): delivered to the runs
subscribed to or waiting on their name and key, and starting the runs of the sagas declared
with ``@app.saga(on_event=...)``. See docs/concepts/events.md."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class PublishedEvent:
    """One published event: what ``Client.publish_event`` returns, and what the ``run_id``
    function of a saga declared with ``on_event=`` is given to name the run it starts."""

    name: str
    data: Any
    key: str | None
    event_id: str
    """The event's id: a publish with the same id is fanned out once."""
