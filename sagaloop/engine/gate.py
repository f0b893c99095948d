"""The engine's side of the approval gate (the rules: ``sagas.approvals.answer_refusal`` and
docs/concepts/approvals.md): an answer is judged as it is recorded, and the approvals index
moves with what an activation writes, in its transaction."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pydantic

from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import Envelope
from sagaloop.engine.plan import ActivationConflict
from sagaloop.engine.ports import RunRecord, Store, Tx
from sagaloop.engine.state import RunState
from sagaloop.sagas.approvals import ApprovalRequest, answer_refusal, call_id_of

if TYPE_CHECKING:
    from sagaloop.engine.decide import Effects
    from sagaloop.engine.plan import Live

logger = logging.getLogger("sagaloop.engine.activation")


class AnsweredMeanwhile(ActivationConflict):
    """Another answer claimed the request between prepare and apply: prepare again (the
    activation then refuses this one)."""


def answer_trigger(
    store: Store, run_id: str, message_id: str, name: str, data: Any
) -> Callable[[RunState], list[NewEvent]]:
    """What the event ``name`` (an answer to approval ``call_id_of(name)``) appends to the
    run's history: ``event_arrived`` with the claim that apply makes, or ``event_rejected``
    with the reason. The index is read now, outside the transaction."""
    call_id = call_id_of(name)
    assert call_id is not None
    row = store.approval(None, run_id, call_id)

    def gate(st: RunState) -> list[NewEvent]:
        reason = answer_refusal(
            _request(st.published.get(name)),
            None if row is None else row.request_id,
            None if row is None else row.answer_id,
            message_id,
            data,
        )
        if reason is not None:
            logger.warning("run %s: answer to %r refused: %s", run_id, name, reason)
            return [NewEvent(h.EVENT_REJECTED, name=name, data={"reason": reason})]
        claim = {"message_id": message_id, "request_id": data["request_id"]}
        return [NewEvent(h.EVENT_ARRIVED, name=name, data={"data": data, "claim": claim})]

    return gate


def index_effects(
    store: Store, tx: Tx, run: RunRecord, effects: Effects, env: Envelope, live: Live | None
) -> None:
    """:func:`index` for what an activation of ``env`` writes (``live``: the run as it staged
    it); a run continued as new ends its approvals (they were the old run's)."""
    if effects.restart is not None:
        store.end_approvals(tx, run.run_id)
        return
    asked = live is None or any(call_id_of(k) for k in live.state.published)
    message_id = env.message_id
    index(store, tx, run, effects.events, at=effects.at, message_id=message_id, asked=asked)


def index(
    store: Store,
    tx: Tx,
    run: RunRecord,
    events: Sequence[NewEvent],
    *,
    at: datetime,
    message_id: str,
    asked: bool,
) -> None:
    """Keep the approvals index in step with the ``events`` an activation (of the message
    ``message_id``) writes for ``run``: the answer it gave the run claims its request (one
    claimed since the index was read wins: AnsweredMeanwhile), published requests are
    indexed, and a finished (or cancelling) run's are forgotten (``asked``: the run ever
    asked one). Only events :func:`indexed` names are looked at."""
    for ev in events:
        if not indexed(ev):
            continue
        call_id = call_id_of(ev.name or "")
        if ev.kind == h.EVENT_ARRIVED and call_id is not None and "claim" in ev.data:
            claim, said = ev.data["claim"], ev.data["data"]
            answer = {"approved": said.get("approved"), "by": said.get("by"), "at": at.isoformat()}
            won = store.claim_approval(
                tx,
                run.run_id,
                call_id,
                request_id=claim["request_id"],
                message_id=claim["message_id"],
                answer=answer,
            )
            if not won:
                raise AnsweredMeanwhile(f"approval {call_id!r} was answered meanwhile")
        elif ev.kind == h.PUBLISHED and call_id is not None:
            value = ev.data.get("value")
            if isinstance(value, dict):  # a refused answer's claim is given back
                store.publish_approval(tx, run, call_id, value, now=at, release=message_id)
        elif ev.kind in (h.RUN_FINISHED, h.CANCEL_DELIVERED) and asked:
            store.end_approvals(tx, run.run_id)  # cancelling: the code waits for them no more


def indexed(ev: NewEvent) -> bool:
    """Whether :func:`index` may write for ``ev`` (so an activation without one has nothing
    to index: its checkpoint may be its transaction's last write, see ``Engine.alone``)."""
    if ev.kind in (h.RUN_FINISHED, h.CANCEL_DELIVERED):
        return True
    return ev.kind in (h.EVENT_ARRIVED, h.PUBLISHED) and call_id_of(ev.name or "") is not None


def _request(value: Any) -> ApprovalRequest | None:
    """The approval request published as ``value``, or None if it is not one."""
    try:
        return ApprovalRequest.model_validate(value)
    except pydantic.ValidationError:
        return None
