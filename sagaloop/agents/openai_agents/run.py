"""The saga side of one :class:`~sagaloop.agents.openai_agents.SagaRunner` run, shared by the
runner, its model (:mod:`sagaloop.agents.openai_agents.model`) and its MCP servers
(:mod:`sagaloop.agents.openai_agents.mcp`): the run's state, and the approval gate that lets a
call the budget refused through unasked."""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from agents.exceptions import UserError

from sagaloop.agents._model_call import AgentRun

if TYPE_CHECKING:
    from sagaloop.agents.openai_agents.runner import SagaRunner


@dataclasses.dataclass(kw_only=True)
class OpenAIRun(AgentRun):
    """The saga side of one ``SagaRunner.run``."""

    runner: SagaRunner
    context: Any
    model: str | None
    last_text: str | None = None
    edits: dict[str, str] = dataclasses.field(default_factory=dict)
    """Arguments an approver edited, by tool call id."""


current: ContextVar[OpenAIRun | None] = ContextVar("sagaloop_openai_agents_run", default=None)


def in_run(what: str) -> OpenAIRun:
    run = current.get()
    if run is None:
        raise UserError(f"{what} of a SagaRunner's agent runs only inside SagaRunner.run")
    return run


def tool_call(call_id: str, arguments: str) -> tuple[OpenAIRun | None, str, str | None]:
    """For one call of a function tool: the run making it (None outside a ``SagaRunner``
    run), its arguments as an approver may have edited them, and the refusal it answers with
    instead of running (its batch is over the budget), if any."""
    run = current.get()
    if run is None:
        return None, arguments, None
    if run.refusal is not None:
        return run, arguments, run.refusal
    return run, run.edits.pop(call_id, arguments), None


def unless_refused(needs: Any) -> Any:
    """A tool's ``needs_approval`` that asks nobody about a call whose batch the budget
    refused (the call answers with the refusal, and does not run)."""
    if needs is False:
        return False

    async def gated(ctx: Any, params: dict[str, Any], call_id: str) -> bool:
        run = current.get()
        if run is not None and run.refusal is not None:
            return False
        return bool(needs if isinstance(needs, bool) else await needs(ctx, params, call_id))

    return gated
