"""A budget over a run tree (issue 22, section 2): a parent and the child runs it calls share
one budget, counted once across crashes and replays. Offline (FunctionModel); the harness
replays every activation, and the model counts its requests from outside the engine."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent, models
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaloop import App, SagaContext
from sagaloop.agents import USAGE_KEY, Budget
from sagaloop.agents.pydantic_ai import SagaAgent
from sagaloop.agents.tree import BudgetTree, Share
from sagaloop.engine import history as h
from sagaloop.testing import Harness

models.ALLOW_MODEL_REQUESTS = False


class Counted:
    """A model that looks one thing up, then answers: two requests per agent run."""

    def __init__(self) -> None:
        self.requests = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.requests += 1
        if sum(isinstance(m, ModelResponse) for m in messages) == 0:
            return ModelResponse(parts=[ToolCallPart("look", {"q": "x"})])
        return ModelResponse(parts=[TextPart("found")])


class Task(BaseModel):
    topic: str
    budget: Share | None = None


def tree_app(
    tree_limit: Budget, child_share: Budget, *, fan_out: bool
) -> tuple[App, Counted, BudgetTree]:
    app = App("tree")
    model = Counted()
    agent = Agent(FunctionModel(model), name="researcher")

    @agent.tool_plain
    def look(q: str) -> str:
        return q

    researcher = SagaAgent(agent, app=app, budget=Budget(requests=2))
    tree = BudgetTree(app)

    @app.saga(name="research")
    async def research(ctx: SagaContext, task: Task) -> str:
        tree.limit(ctx, task.budget)
        return str((await researcher.run(task.topic)).output)

    @app.saga(name="supervisor")
    async def supervisor(ctx: SagaContext, topics: list[str]) -> list[str]:
        tree.limit(ctx, tree_limit)

        async def one(topic: str) -> str:
            share = tree.share(ctx, child_share)
            try:
                return str(await tree.call(ctx, research, Task(topic=topic, budget=share), share))
            except Exception as e:  # a child that ran out: the others go on
                return type(e).__name__

        if fan_out:
            return list(await ctx.gather(*(one(t) for t in topics)))
        return [await one(t) for t in topics]

    return app, model, tree


TOPICS = ["a", "b", "c", "d", "e"]


def test_children_running_at_once_share_the_parents_budget() -> None:
    """Without a tree, 5 children with Budget(requests=2) each made 10 requests."""
    app, model, _ = tree_app(Budget(requests=6), Budget(requests=2), fan_out=True)
    env = Harness(app)
    run_id = env.start("supervisor", TOPICS)
    env.run_until_idle()
    assert env.get(run_id).status == "completed", env.get(run_id).error
    assert env.result(run_id) == ["found", "found", "found", "StepFailedError", "StepFailedError"]
    assert model.requests == 6, "the tree's limit, not 5 x 2"
    shown = env.client.get_published(run_id, USAGE_KEY)
    assert shown["requests"] == 6 and shown["tree"]["requests"] == 6
    env.restart()  # replayed from the history: the same figures, nothing asked again
    env.run_until_idle()
    assert model.requests == 6
    assert env.client.get_published(run_id, USAGE_KEY)["requests"] == 6


def test_a_settled_child_gives_back_what_it_did_not_use() -> None:
    """Each child may take all that is left (share without a limit); what it does not use
    comes back when it ends, so the next one gets it."""
    app, model, _ = tree_app(Budget(requests=5), Budget(), fan_out=False)
    env = Harness(app)
    run_id = env.start("supervisor", TOPICS[:3])
    env.run_until_idle()
    assert env.result(run_id) == ["found", "found", "StepFailedError"]
    assert model.requests == 5  # 2 + 2 + the third child's one request of the 1 left
    [third] = [e.data["run_id"] for e in env.history(run_id) if e.kind == h.CHILD_STARTED][2:]
    error = env.get(third).error
    assert (
        error is not None
        and error["type"] == "BudgetExceeded"
        and "requests 1 of 1" in (error["message"])
    )


def test_the_tree_is_counted_once_across_restarts() -> None:
    app, model, _ = tree_app(Budget(requests=6), Budget(requests=2), fan_out=True)
    env = Harness(app)
    run_id = env.start("supervisor", TOPICS)
    for _ in range(12):  # somewhere in the middle of the children
        env.step_once()
        env.restart()
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert model.requests == 6
    assert env.client.get_published(run_id, USAGE_KEY)["requests"] == 6


def test_the_usage_step_name_is_pinned() -> None:
    _, _, tree = tree_app(Budget(), Budget(), fan_out=False)
    assert tree.usage_step.name == "agent__budget__run_usage"


def test_a_tree_covers_openai_agents_runs_too() -> None:
    from agents import Agent as OAAgent
    from agents.items import ModelResponse as OAResponse
    from agents.testing import ModelStep, ScriptedModel, assistant_message
    from agents.usage import Usage as OAUsage

    from sagaloop.agents.openai_agents import SagaRunner

    said = OAResponse(
        output=[assistant_message("done")], usage=OAUsage(requests=1), response_id=None
    )
    model = ScriptedModel([ModelStep.respond(lambda call: said)] * 5)
    app = App("oa-tree")
    agent: OAAgent[Any] = OAAgent(name="helper", model=model)
    runner = SagaRunner(app, agent)
    tree = BudgetTree(app)

    @app.saga(name="child")
    async def child(ctx: SagaContext, task: Task) -> str:
        tree.limit(ctx, task.budget)
        return str((await runner.run(agent, task.topic)).final_output)

    @app.saga(name="parent")
    async def parent(ctx: SagaContext, topics: list[str]) -> list[str]:
        tree.limit(ctx, Budget(requests=2))
        shares = [tree.share(ctx, Budget(requests=1)) for _ in topics]
        out = await ctx.gather(
            *(
                tree.call(ctx, child, Task(topic=t, budget=s), s)
                for t, s in zip(topics, shares, strict=True)
            ),
            return_exceptions=True,
        )
        return [o if isinstance(o, str) else type(o).__name__ for o in out]

    env = Harness(app)
    run_id = env.start("parent", ["a", "b", "c"])
    env.run_until_idle()
    assert env.result(run_id) == ["done", "done", "StepFailedError"]
    assert len(model.calls) == 2
    assert env.client.get_published(run_id, USAGE_KEY)["requests"] == 2
