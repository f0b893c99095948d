"""A budget shared by a run tree: a saga run and the child runs it calls or starts.

A supervisor that fans out to agent runs in child sagas needs one budget over all of them.
Each run counts its own usage from its own history (:mod:`sagaloop.agents.budgets`); a tree
adds two things, both recorded, so a replay or a restart counts the same figures once:

- **down**: before a child starts, the parent *reserves* a share of what its tree limit has
  left (:meth:`BudgetTree.share`), in saga code, from what its history recorded. The share
  travels in the child's input; the child makes it its own tree limit
  (:meth:`BudgetTree.limit`). While the child runs, the reservation counts as spent in the
  parent, so concurrent children can never be given more than the parent had left.
- **up**: when the child has ended, the parent *settles* the share
  (:meth:`BudgetTree.settle`, done by :meth:`BudgetTree.call`): a step reads the usage the
  child published last in its own history (its agents publish it after each model request
  and tool batch, with what it reserved for its own children), and the recorded result
  replaces the reservation.

A share left unsettled (a started child the parent never waits for) stays spent in full.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict

from sagaloop.agents._core import publish_usage, usage_of
from sagaloop.agents.budgets import USAGE_KEY, Budget, Usage
from sagaloop.engine import history as h
from sagaloop.errors import ValidationError
from sagaloop.sagas.app import App, SagaDef, StepDef
from sagaloop.sagas.context import SagaContext, StepContext

__all__ = ["BudgetTree", "Share"]

_FIELDS = ("requests", "input_tokens", "output_tokens", "tool_calls", "cost")
_ENDED = frozenset({h.SAGA_FINISHED, h.RUN_FINISHED})


class Share(BaseModel):
    """The part of a run tree's budget a parent reserved for one child run: give it to the
    child in its input, and the child to :meth:`BudgetTree.limit`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parent: str
    """The run that reserved it."""
    run_id: str
    """The child run it is for (its run id)."""
    budget: Budget
    """The limits of the child's run tree."""


class BudgetTree:
    """A budget shared by a run and the runs it calls or starts.

    Declare it where the app's steps are declared (it registers the step
    ``agent__budget__run_usage``, which reads a child run's published usage)::

        tree = BudgetTree(app)

        @app.saga(name="supervisor")
        async def supervisor(ctx: SagaContext, topics: list[str]) -> list[str]:
            tree.limit(ctx, Budget(requests=10))  # the whole tree's
            shares = [tree.share(ctx, Budget(requests=4)) for _ in topics]
            return await ctx.gather(
                *(tree.call(ctx, research, Task(topic=t, budget=s), s)
                  for t, s in zip(topics, shares))
            )

        @app.saga(name="research")
        async def research(ctx: SagaContext, task: Task) -> str:
            tree.limit(ctx, task.budget)  # its share: counted with its agents' budgets
            return (await researcher.run(task.topic)).output
    """

    def __init__(self, app: App, *, queue: str = "tools") -> None:
        self.app = app
        self.usage_step: StepDef[Any, Any] = app.step(name="agent__budget__run_usage", queue=queue)(
            _run_usage
        )

    def limit(self, ctx: SagaContext, budget: Budget | Share | None) -> None:
        """This run's tree limit: a :class:`Budget` in the root of the tree, the
        :class:`Share` its parent gave it in a child. Checked before each model request and
        each tool batch of the run's agent runs (with their own budgets), against what the run
        used plus what it reserved for its children. Call it before the run's agents run."""
        if isinstance(budget, Share):
            if budget.run_id != ctx.run_id:
                raise ValidationError(
                    f"this share of run {budget.parent!r}'s budget is for run {budget.run_id!r},"
                    f" not {ctx.run_id!r}: start the child with BudgetTree.call or .start"
                )
            budget = budget.budget
        usage_of(ctx).allowance = budget
        publish_usage(ctx, None)

    def share(self, ctx: SagaContext, budget: Budget, *, run_id: str | None = None) -> Share:
        """Reserve ``budget`` for one child run (``run_id``, else a fresh one: give it to
        :meth:`call` or :meth:`start`): each of its limits, at most what this run's tree limit
        has left after what the run used and reserved; a limit ``budget`` leaves open gets all
        that is left. The reservation counts as spent until :meth:`settle`."""
        state = usage_of(ctx)
        limits = budget.model_dump()
        reserved = Usage()
        allowance = state.allowance
        if allowance is not None:
            committed = state.committed()
            for name in _FIELDS:
                cap = getattr(allowance, name)
                if cap is None:
                    continue
                left = max(cap - getattr(committed, name), 0)
                asked = limits[name]
                limits[name] = left if asked is None else min(asked, left)
            if allowance.wall_clock is not None:
                spent = ctx.now() - state.started
                left_time = max(allowance.wall_clock - spent, timedelta(0))
                asked_time = budget.wall_clock
                limits["wall_clock"] = (
                    left_time if asked_time is None else min(asked_time, left_time)
                )
            if budget.on_exceed == "fail" and "on_exceed" not in budget.model_fields_set:
                limits["on_exceed"] = allowance.on_exceed
        for name in _FIELDS:
            if limits[name] is not None:
                setattr(reserved, name, limits[name])
        child = run_id or ctx.uuid4().hex
        if child in state.reserved:
            raise ValidationError(f"run {child!r} already has a share of this run's budget")
        state.reserved[child] = reserved
        return Share(parent=ctx.run_id, run_id=child, budget=Budget.model_validate(limits))

    async def call(
        self, ctx: SagaContext, saga: SagaDef[Any, Any], input: Any, share: Share
    ) -> Any:
        """``ctx.call(saga, input)`` as the child run ``share.run_id``; when it has ended
        (completed or failed) its usage replaces the reservation (:meth:`settle`)."""
        try:
            return await ctx.call(saga, input, run_id=share.run_id)
        finally:
            await self.settle(ctx, share)

    def start(
        self, ctx: SagaContext, saga: SagaDef[Any, Any] | str, input: Any, share: Share
    ) -> str:
        """``ctx.start(saga, input)`` as the child run ``share.run_id``: its share stays
        spent in full until :meth:`settle` finds the run ended."""
        return ctx.start(saga, input, run_id=share.run_id)

    async def settle(self, ctx: SagaContext, share: Share) -> Usage | None:
        """Read what the child run of ``share`` used (a step: recorded once), and count it in
        place of its reservation. None while the child has not ended: the reservation stays."""
        state = usage_of(ctx)
        if share.run_id not in state.reserved:
            return None  # settled already, or not this run's
        found = await ctx.call(self.usage_step, share.run_id)
        if found is None:
            return None
        used = Usage.model_validate(found)
        del state.reserved[share.run_id]
        state.usage = state.usage.plus(used)
        publish_usage(ctx, None)
        return used


def _run_usage(ctx: StepContext, run_id: str) -> dict[str, Any] | None:
    """The usage a run published last (with what it reserved for its own children), once it
    has ended; None while it runs."""
    events = ctx.history(run_id)
    if not any(e.kind in _ENDED for e in events):
        return None
    shown: dict[str, Any] = {}
    for event in events:
        if event.kind == h.PUBLISHED and event.name == USAGE_KEY:
            shown = dict((event.data or {}).get("value") or {})
    source = shown.get("tree") or shown
    return Usage.model_validate({k: source.get(k, 0) for k in _FIELDS}).model_dump()
