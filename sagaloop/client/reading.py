"""Reading a run as it goes: ``Client.stream`` (its history, then what its steps stream live)
and ``Client.wait_published`` (a value it publishes), both reading the store as
:meth:`~sagaloop.client.Client.result` does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sagaloop.client.checks import check_text, same_json, to_json
from sagaloop.client.polling import NOTHING, NotPublishedError, Pending, poll_until
from sagaloop.engine import state as s
from sagaloop.sagas.convert import ANY

if TYPE_CHECKING:
    from sagaloop.client.client import Client


def stream(
    client: Client, run_id: str, *, follow: bool, poll: float, timeout: float | None
) -> Iterator[dict[str, Any]]:
    """See :meth:`Client.stream`."""
    client.get(run_id)  # RunNotFoundError
    live = client.streams.subscribe(run_id) if follow and client.streams is not None else None
    deadline = None if timeout is None else time.monotonic() + timeout
    seq = 0
    try:
        while True:
            # read before the history: a run that finished in between is read to its end
            finished = not follow or client.get(run_id).status in s.FINAL_STATUSES
            for ev in client.store.load_history(None, run_id, after_seq=seq):
                seq = ev.seq
                yield {
                    "source": "history",
                    "seq": ev.seq,
                    "at": ev.at,
                    "position": ev.pos,
                    "kind": ev.kind,
                    "name": ev.name,
                    "data": ev.data,
                }
            if finished:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            if live is None:
                time.sleep(poll)
                continue
            for item in live.get(poll):
                yield {"source": "live", **item} if isinstance(item, dict) else item
    finally:
        if live is not None:
            live.close()


def wait_published(
    client: Client,
    run_id: str,
    key: str,
    *,
    timeout: float | timedelta | None,
    after: Any,
    poll: float,
) -> Any:
    """See :meth:`Client.wait_published`."""
    check_text(key, "key")
    after = after if after is NOTHING else to_json(after, ANY, "after")

    def read() -> Any:
        # the status first: a run that finished in between is read to its end
        status = client.get(run_id).status
        published = client._published(run_id)
        if key in published and (after is NOTHING or not same_json(published[key], after)):
            return published[key]
        if status in s.FINAL_STATUSES:
            raise NotPublishedError(run_id, status, key, published.get(key, NOTHING))
        what = "a value" if after is NOTHING else f"a value other than {after!r:.60}"
        return Pending(f"run {run_id!r} is {status} and has not published {what} under {key!r}")

    return poll_until(read, timeout=timeout, poll=poll)
