"""Approvals: a person's yes or no to what a run is about to do, bound to the exact arguments
asked about, used once, with a deadline (``await ctx.approval(...)``).

An approval is made of the primitives every saga has, so it replays like any saga code and
needs no history event of its own:

- the request is published under the key ``approval:{call_id}`` (``ctx.publish``), and so is
  every change of its state (an answer refused, an escalation, the decision);
- the run waits for the event ``approval:{call_id}`` (``ctx.wait_for_event``, with the request
  as its ``prompt``), whose data is an :class:`ApprovalAnswer` that names the hash of the
  arguments it answers: an answer to other arguments is refused and the wait goes on.

This module holds what the saga side, the client and the CLI share: names, models, hashing and
the saga side's loop. It does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

from sagaloop.errors import EventTimeoutError, ValidationError
from sagaloop.sagas.convert import ANY

if TYPE_CHECKING:
    from sagaloop.sagas.context import SagaContext

KEY_PREFIX: Final = "approval:"
"""The published key and the event name of an approval are this prefix and its call id."""
MAX_CALL_ID: Final = 200 - len(KEY_PREFIX)

PENDING: Final = "pending"
ESCALATED: Final = "escalated"
"""The deadline passed with ``on_timeout="escalate"``: the run goes on waiting, without one."""
APPROVED: Final = "approved"
DENIED: Final = "denied"
EXPIRED: Final = "expired"
"""The deadline passed with ``on_timeout="deny"``: the approval is denied."""
OPEN_STATUSES: Final = frozenset({PENDING, ESCALATED})
"""The statuses of an approval that an answer may still settle."""
DEADLINE_PASSED: Final = "deadline passed"

OnTimeout = Literal["deny", "escalate"]


def approval_key(call_id: str) -> str:
    """The published key, and the event name, of the approval ``call_id``."""
    return KEY_PREFIX + call_id


def call_id_of(key: str) -> str | None:
    """The call id of an approval's key, or None for a key that is not an approval's."""
    return key[len(KEY_PREFIX) :] if key.startswith(KEY_PREFIX) else None


def published_approvals(published: Mapping[str, Any]) -> Iterator[tuple[str, ApprovalRequest]]:
    """The approvals among a run's published values (``approval:<call_id>``), each with its
    call id, in the order they were published; a value that is not a readable request (a
    key published by hand) is skipped."""
    for key, value in published.items():
        call_id = call_id_of(key)
        if call_id is None:
            continue
        try:
            yield call_id, ApprovalRequest.model_validate(value)
        except ValueError:
            continue


def args_hash(args: Any) -> str:
    """The SHA-256 (hex) of the canonical JSON of ``args`` (a JSON value): keys sorted, no
    spaces, UTF-8. An answer names the hash of the arguments it approves."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class Approval(BaseModel):
    """What ``await ctx.approval(...)`` returns: the decision, and the arguments to use."""

    model_config = ConfigDict(frozen=True)

    call_id: str
    approved: bool
    args: Any
    """The arguments to use (JSON): the approver's edited ones if any, else those asked about."""
    edited: bool
    """True when the approver approved edited arguments (``approve --args``)."""
    reason: str | None
    """The approver's reason (a denial's), or ``"deadline passed"``."""
    by: str | None
    """Who answered, as the answer says (None when the deadline passed)."""
    args_hash: str
    """The hash of ``args`` (:func:`args_hash`)."""


class ApprovalRequest(BaseModel):
    """The published value of an approval (``approval:{call_id}``): what is asked, and where
    the approval stands. The decision's fields are set once it is settled."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    status: str
    action: str
    args: Any = None
    args_hash: str
    reason: str | None = None
    """Why it is asked (the model's reasoning, say)."""
    deadline: datetime | None = None
    requested_at: datetime
    last_refused: str | None = None
    """Why the last answer refused was refused (it answered other arguments, say)."""
    answered_at: datetime | None = None
    by: str | None = None
    answer_reason: str | None = None
    """The reason the answer gave (a denial's), or ``"deadline passed"``."""
    edited: bool = False
    edited_args: Any = None
    """The arguments approved in place of ``args``, when ``edited``."""
    edited_args_hash: str | None = None
    args_schema: dict[str, Any] | None = None
    """The JSON Schema that edited arguments must fit (the tool's or step's), when known."""

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        for name in ("last_refused", "answered_at", "by", "answer_reason", "args_schema"):
            if data[name] is None:
                del data[name]
        if not self.edited:
            del data["edited"], data["edited_args"], data["edited_args_hash"]
        return data

    def prompt(self, run_id: str, call_id: str) -> dict[str, Any]:
        """What the run's wait asks (``sagaloop status`` shows it, cut to a line): the action
        and its arguments first, then how to answer, then the rest of the request."""
        run, call = shlex.quote(run_id), shlex.quote(call_id)
        data = self.to_json()
        return {
            "approve": self.action,
            "args": data["args"],
            "answer": f"sagaloop approve {run} {call}, or sagaloop deny {run} {call} --reason TEXT",
            "reason": self.reason,
            "deadline": None if self.status == ESCALATED else data["deadline"],
            "status": self.status,
            "args_hash": self.args_hash,
        }


class PendingApproval(ApprovalRequest):
    """An approval that a run waits for (``Client.approvals``)."""

    run_id: str
    saga: str
    call_id: str
    request_id: str
    """What an answer names (``ApprovalAnswer.request_id``)."""
    cursor: str
    """Pass it as ``after`` to list the approvals after this one."""


class ApprovalAnswer(BaseModel):
    """The data of the event ``approval:{call_id}``. ``args``, when present, are the edited
    arguments to use instead of those asked about (ignored in a denial)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    approved: StrictBool
    args_hash: StrictStr
    """The hash of the arguments asked about, as the request published it."""
    request_id: StrictStr | None = None
    """The id the engine gave the request when it recorded it (``sagaloop approvals
    --json``): the engine refuses an answer that does not name it, so no answer can be
    written before its request exists. ``Client.approve`` and ``deny`` fill it in."""
    args: Any = None
    reason: StrictStr | None = None
    by: StrictStr | None = None

    @property
    def edited(self) -> bool:
        return self.approved and "args" in self.model_fields_set


def read_answer(data: Any, request: ApprovalRequest) -> ApprovalAnswer | str:
    """The answer in ``data`` if it answers ``request``, else why it is refused."""
    try:
        answer = ApprovalAnswer.model_validate(data)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "the data"
        text = f"not an answer {{approved, args_hash, args?, reason?, by?}}: {where}: "
        return text + str(first["msg"])[:300]
    if answer.args_hash != request.args_hash:
        return (
            f"it answers the arguments of hash {answer.args_hash[:12]!r}, not those asked "
            f"about ({request.args_hash[:12]!r})"
        )
    return answer


def answer_refusal(
    request: ApprovalRequest | None,
    request_id: str | None,
    winner: str | None,
    message_id: str,
    data: Any,
) -> str | None:
    """Why the engine refuses, as it records it, an answer (message ``message_id``, event
    ``data``) to an approval whose latest published ``request`` and indexed ``request_id``
    and winning answer ``winner`` are these (None: none); None when the answer counts.

    An answer counts only if its request is recorded, open and named by its ``request_id``
    (which nobody can know before the request exists), if it fits the request, and if no
    other answer won the request before it."""
    if request is None or request_id is None:
        return (
            "no such approval was asked when this answer was recorded (an answer given before "
            "its request is never used)"
        )
    if request.status not in OPEN_STATUSES:
        return f"the approval is already {request.status} (an approval is answered once)"
    answer = read_answer(data, request)
    if isinstance(answer, str):
        return answer
    if answer.request_id is None:
        return (
            "it names no request_id: an answer written before its request, or without reading "
            "it, is never used (the request_id is in `sagaloop approvals --json`)"
        )
    if answer.request_id != request_id:
        return "it names another request_id than the request recorded"
    if winner is not None and winner != message_id:
        return "another answer won this approval first (one answer per request)"
    return None


def schema_error(args: Any, schema: dict[str, Any]) -> str | None:
    """Why ``args`` does not fit the JSON Schema ``schema`` (the first error, where and what),
    or None when it fits or the schema is not one this validator reads."""
    import jsonschema  # type: ignore[import-untyped]

    try:
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(args))
    except (jsonschema.exceptions.SchemaError, TypeError, ValueError):
        return None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the arguments"
    return f"{where}: {str(error.message)[:300]}"


def check_call_id(call_id: Any) -> str:
    """``call_id`` if it can name an approval, else a ValidationError saying why."""
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID or "\x00" in call_id:
        raise ValidationError(
            f"an approval's call_id is 1 to {MAX_CALL_ID} characters without NUL, not "
            f"{call_id!r:.60}"
        )
    try:
        call_id.encode()
    except UnicodeEncodeError:
        raise ValidationError(f"the call_id {call_id!r:.60} holds a lone surrogate") from None
    return call_id


async def request_approval(
    ctx: SagaContext,
    call_id: str,
    action: str,
    args: Any,
    *,
    timeout: timedelta | None,
    on_timeout: OnTimeout,
    reason: str | None,
    taken: set[str],
    args_schema: dict[str, Any] | None = None,
    check: Callable[[Any], Any] | None = None,
) -> Approval:
    """The saga side of ``ctx.approval``, on ``ctx``'s recorded primitives. ``taken``: the
    call ids this history already used (the context keeps them), refused again.
    ``args_schema``: published with the request, so that those who answer check edited
    arguments before they send them; ``check``: validates edited arguments here (raising
    ValidationError), an edit it refuses is refused as an answer and the wait goes on."""
    check_call_id(call_id)
    if call_id in taken:
        raise ValidationError(
            f"ctx.approval: call_id {call_id!r} was used by an earlier approval of this run: "
            "give each approval its own call_id (or leave it out)"
        )
    if not isinstance(action, str) or not 0 < len(action) <= 200:
        raise ValidationError("ctx.approval needs an action of 1 to 200 characters")
    if on_timeout not in ("deny", "escalate"):
        raise ValidationError(f"on_timeout is 'deny' or 'escalate', not {on_timeout!r}")
    if timeout is not None and timeout <= timedelta(0):
        raise ValidationError(f"an approval's timeout must be positive, not {timeout}")
    if reason is not None and not isinstance(reason, str):
        raise ValidationError("an approval's reason is text")
    taken.add(call_id)
    args_json = ANY.to_json(args, what=f"the arguments of approval {call_id!r} ({action})")
    digest = args_hash(args_json)
    now = ctx.now()
    key = approval_key(call_id)
    record = ApprovalRequest(
        status=PENDING,
        action=action,
        args=args_json,
        args_hash=digest,
        reason=reason,
        deadline=None if timeout is None else now + timeout,
        requested_at=now,
        args_schema=args_schema,
    )
    ctx.publish(key, record.to_json())
    while True:
        left = None
        if record.deadline is not None and record.status == PENDING:
            left = record.deadline - ctx.now()
        try:
            if left is not None and left <= timedelta(0):  # an answer refused at the last moment
                raise EventTimeoutError(key)
            prompt = record.prompt(ctx.run_id, call_id)
            data = await ctx.wait_for_event(key, timeout=left, prompt=prompt)
        except EventTimeoutError:
            if on_timeout == "escalate":
                record = record.model_copy(update={"status": ESCALATED})
                ctx.logger.warning("approval %r (%s) escalated: deadline passed", call_id, action)
                ctx.publish(key, record.to_json())
                continue
            update = {"status": EXPIRED, "answered_at": ctx.now(), "answer_reason": DEADLINE_PASSED}
            ctx.publish(key, record.model_copy(update=update).to_json())
            return Approval(
                call_id=call_id,
                approved=False,
                args=args_json,
                edited=False,
                reason=DEADLINE_PASSED,
                by=None,
                args_hash=digest,
            )
        answer = read_answer(data, record)
        if not isinstance(answer, str) and answer.edited and check is not None:
            try:
                check(answer.args)
            except ValidationError as e:
                answer = f"the edited arguments do not fit the action: {str(e)[:300]}"
        if isinstance(answer, str):
            ctx.logger.warning("approval %r: answer refused: %s", call_id, answer)
            record = record.model_copy(update={"last_refused": answer})
            ctx.publish(key, record.to_json())
            continue
        edited = answer.edited
        used = answer.args if edited else args_json
        used_hash = args_hash(used) if edited else digest
        decision = {
            "status": APPROVED if answer.approved else DENIED,
            "answered_at": ctx.now(),
            "by": answer.by,
            "answer_reason": answer.reason,
            "edited": edited,
            "edited_args": used if edited else None,
            "edited_args_hash": used_hash if edited else None,
        }
        ctx.publish(key, record.model_copy(update=decision).to_json())
        return Approval(
            call_id=call_id,
            approved=answer.approved,
            args=used,
            edited=edited,
            reason=answer.reason,
            by=answer.by,
            args_hash=used_hash,
        )
