"""Answering an approval (``ctx.approval``) from a client: the answer is checked by the rules
in ``sagaloop.engine.answers``, and claims the request in the transaction that queues it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sagaloop.engine import answers
from sagaloop.engine.messages import derived_id, engine_queue
from sagaloop.engine.ports import Outgoing
from sagaloop.errors import ValidationError
from sagaloop.sagas.approvals import approval_key, check_call_id

if TYPE_CHECKING:
    from sagaloop.client.client import Client


def answer_approval(
    client: Client,
    run_id: str,
    call_id: str,
    data: Any,
    *,
    event_id: str | None = None,
    hashed: bool = True,
) -> None:
    """Send ``data`` as the answer to approval ``call_id`` if it wins the request: the
    claim and the queued event commit together, or neither does. ``hashed=False``: the
    answer is to the arguments as asked (the request's hash is filled in)."""
    check_call_id(call_id)
    if isinstance(data, dict) and data.get("by") is not None:
        if not isinstance(data["by"], str):
            raise ValidationError(f"who answers (by) is text, not {data['by']!r:.60}")
    elif isinstance(data, dict) and "by" in data:
        data = {k: v for k, v in data.items() if k != "by"}
    run = client.get(run_id)
    row = client.store.approval(None, run_id, call_id)
    sent = None if event_id is None else derived_id("event", run_id, event_id)
    if row is not None and sent is not None and row.answer_id == sent:
        return  # this very answer, sent already
    request = answers.open_request(run, call_id, row)
    assert row is not None
    if not hashed:
        data = {**data, "args_hash": request.args_hash}
    answer = answers.checked_answer(request, row.request_id, data)
    env = client._event(run_id, approval_key(call_id), answer, event_id=event_id)
    with client.store.transaction() as tx:
        won = client.store.claim_approval(
            tx,
            run_id,
            call_id,
            request_id=row.request_id,
            message_id=env.message_id,
            answer=answers.claim_answer(row, env, answer),
        )
        if won:
            client.store.enqueue(tx, [Outgoing(engine_queue(run.app), env)], client.clock.now())
    if not won:  # answered or settled since it was read: say which
        now = client.store.approval(None, run_id, call_id)
        answers.open_request(client.get(run_id), call_id, now)
        raise answers.taken(now or row)
