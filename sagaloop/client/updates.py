"""``Client.update``: send an update to a run and wait for its answer, which the run's engine
records in the run's history (see ``sagaloop.engine.updates``)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sagaloop.client.checks import check_text, to_json
from sagaloop.client.polling import Pending, poll_until
from sagaloop.engine import state as s
from sagaloop.engine.messages import UpdatePayload, derived_id
from sagaloop.engine.state import RunState
from sagaloop.engine.updates import REFUSED
from sagaloop.errors import ErrorInfo, UpdateFailedError, UpdateRefusedError
from sagaloop.sagas.convert import ANY

if TYPE_CHECKING:
    from sagaloop.client.client import Client


def send(client: Client, run_id: str, name: str, data: Any, update_id: str | None) -> str:
    """Queue the update for the run's engine (unless it is answered already or the run has
    ended) and return its update id."""
    check_text(name, "update name", UpdatePayload, "name")
    update_id = uuid.uuid4().hex if update_id is None else update_id
    check_text(update_id, "update_id", UpdatePayload, "update_id")
    payload = {"name": name, "data": to_json(data, ANY, "update data"), "update_id": update_id}
    run = client.get(run_id)
    if run.status in s.FINAL_STATUSES or update_id in _updates(client, run_id):
        return update_id  # answered from the history (or refused: the run ended)
    message_id = derived_id("update", run_id, update_id)  # a retry is the same message
    client._send(client._message("update", run_id, payload, message_id), live=False, run=run)
    return update_id


def _updates(client: Client, run_id: str) -> dict[str, Any]:
    state = RunState(run_id)
    for event in client.store.load_history(None, run_id):
        state.apply(event)
    return state.updates


def answer(client: Client, run_id: str, name: str, update_id: str) -> Any:
    """The answer of the update, if the run recorded it (its result; ``UpdateFailedError`` or
    ``UpdateRefusedError`` raised); else :class:`Pending`."""
    status = client.get(run_id).status  # first: a run that ended meanwhile is read to its end
    answers = _updates(client, run_id)
    if (found := answers.get(update_id)) is not None:
        if "error" not in found:
            return found.get("result")
        error = ErrorInfo.from_json(found["error"])
        kind = UpdateRefusedError if found.get(REFUSED) else UpdateFailedError
        raise kind(run_id, name, update_id, error)
    if status in s.FINAL_STATUSES:
        if update_id in answers:  # accepted: its handler had not finished
            why = ErrorInfo("RunEnded", f"the run ended ({status}) before the handler finished")
            raise UpdateFailedError(run_id, name, update_id, why)
        why = ErrorInfo("UpdateRefused", f"the run has ended ({status}): it takes no update")
        raise UpdateRefusedError(run_id, name, update_id, why)
    doing = "runs its handler" if update_id in answers else "has not taken it yet"
    return Pending(f"update {name!r} ({update_id}) of run {run_id!r}: the run {doing}")


def update(
    client: Client,
    run_id: str,
    name: str,
    data: Any,
    *,
    update_id: str | None,
    timeout: float | timedelta | None,
    poll: float,
) -> Any:
    update_id = send(client, run_id, name, data, update_id)
    return poll_until(lambda: answer(client, run_id, name, update_id), timeout=timeout, poll=poll)
