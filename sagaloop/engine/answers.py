"""Answering approvals from outside a run (``Client.approve``, ``deny``, ``send_event``): the
answer claims its request in the approvals index in the transaction that queues it, so that
one answer wins, and every other caller is told it lost, even while no engine runs.

The engine makes the same claim when it records an answer that no client claimed (one put on
the broker by another publisher), and refuses every answer that does not win (see
``sagas.approvals.answer_refusal``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pydantic

from sagaloop.engine import state as s
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import ApprovalRow, RunRecord
from sagaloop.errors import ApprovalTakenError, ValidationError
from sagaloop.sagas.approvals import (
    OPEN_STATUSES,
    ApprovalRequest,
    PendingApproval,
    read_answer,
    schema_error,
)


def listing_hint(run_id: str) -> str:
    return f"`sagaloop approvals --run {run_id}` lists those it waits for"


def open_request(run: RunRecord, call_id: str, row: ApprovalRow | None) -> ApprovalRequest:
    """The request of ``row`` if an answer may still settle it, else an error saying why
    nothing was sent."""
    if run.status in s.FINAL_STATUSES:
        raise ValidationError(
            f"run {run.run_id!r} is {run.status}: nothing waits for approval {call_id!r} any "
            "more, so nothing was sent"
        )
    if row is None:
        raise ValidationError(
            f"run {run.run_id!r} asked no approval {call_id!r}, so nothing was sent: "
            + listing_hint(run.run_id)
        )
    if row.status not in OPEN_STATUSES:
        raise ValidationError(
            f"approval {call_id!r} of run {run.run_id!r} is already {row.status} (an approval "
            f"is answered once), so nothing was sent: {listing_hint(run.run_id)}"
        )
    if row.answer_id is not None:
        raise taken(row)
    return ApprovalRequest.model_validate(row.request)


def taken(row: ApprovalRow) -> ApprovalTakenError:
    """The error of an answer that lost to ``row``'s winning answer."""
    answer = row.answer or {}
    said = "approved" if answer.get("approved") else "denied"
    by = f" by {answer['by']!r}" if answer.get("by") else ""
    at = f" at {answer['at']}" if answer.get("at") else ""
    return ApprovalTakenError(
        f"approval {row.call_id!r} of run {row.run_id!r} was already answered ({said}{by}{at}): "
        "one answer per request wins, so yours was not sent",
        run_id=row.run_id,
        call_id=row.call_id,
    )


def checked_answer(request: ApprovalRequest, request_id: str, data: Any) -> dict[str, Any]:
    """``data`` as an answer to ``request`` naming ``request_id`` (filled in when absent),
    with edited arguments checked against the request's schema; else a ValidationError."""
    if isinstance(data, dict) and "request_id" not in data:
        data = {**data, "request_id": request_id}
    answer = read_answer(data, request)
    if isinstance(answer, str):
        raise ValidationError(f"not an answer to this approval, so nothing was sent: {answer}")
    if answer.request_id != request_id:
        raise ValidationError(
            "the answer names another request_id than the approval's, so nothing was sent"
        )
    if answer.edited and request.args_schema is not None:
        check_args(answer.args, request.args_schema)
    edits = "args" in answer.model_fields_set
    return answer.model_dump(mode="json", exclude=None if edits else {"args"})


def check_args(args: Any, schema: dict[str, Any]) -> None:
    """Refuse edited arguments that do not fit the action's JSON Schema."""
    error = schema_error(args, schema)
    if error is not None:
        raise ValidationError(
            f"the edited arguments do not fit the action, so nothing was sent: {error}"
        )


def claim_answer(row: ApprovalRow, env: Envelope, data: dict[str, Any]) -> dict[str, Any]:
    """What the claim of ``row`` by the answer ``env`` records."""
    return {
        "approved": data.get("approved"),
        "by": data.get("by"),
        "at": env.created_at.isoformat(),
    }


def pending(row: ApprovalRow) -> PendingApproval | None:
    """The listing entry of an indexed approval, or None if its request is unreadable."""
    try:
        request = ApprovalRequest.model_validate(row.request)
    except pydantic.ValidationError:
        return None
    fields = request.model_dump()
    return PendingApproval(
        **fields,
        run_id=row.run_id,
        saga=row.saga,
        call_id=row.call_id,
        request_id=row.request_id,
        cursor=cursor(row.requested_at, row.run_id, row.call_id),
    )


def cursor(at: datetime, run_id: str, call_id: str) -> str:
    """An opaque position in the listing of approvals (``Client.approvals(after=...)``)."""
    return json.dumps([at.isoformat(), run_id, call_id], separators=(",", ":"))


def read_cursor(text: str) -> tuple[datetime, str, str]:
    try:
        at, run_id, call_id = json.loads(text)
        return datetime.fromisoformat(at), str(run_id), str(call_id)
    except (ValueError, TypeError) as e:
        raise ValidationError(
            f"{text[:60]!r} is not a cursor of the approvals listing (pass the `cursor` of "
            "the last approval of a page)"
        ) from e
