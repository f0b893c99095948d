"""Port of Temporal's patching sample: a workflow changed in four stages with ``patched`` and
``deprecate_patch`` while runs of each stage are in flight.

Original: github.com/temporalio/samples-python, ``patching/`` (``workflow_1_initial.py``,
``workflow_2_patched.py``, ``workflow_3_patch_deprecated.py``, ``workflow_4_patch_complete.py``,
``activities.py``), whose assertions are its README's: the result each stage's worker gives
for the runs of that stage and of the stage before.

What maps to what:

- each stage's ``MyWorkflow`` -> the saga ``my-workflow`` of one version of the app (four
  ``App`` objects of the same name: the code a deploy brings); ``pre_patch_activity`` and
  ``post_patch_activity`` -> steps;
- ``workflow.patched("my-patch")`` -> ``ctx.patched("my-patch")``;
  ``workflow.deprecate_patch("my-patch")`` -> ``ctx.deprecate_patch("my-patch")``;
- "stop the worker, start it again with the next workflow" -> close the harness and open one
  with the next version on the same database (a SQLite file), which goes on with the runs of
  the previous one;
- ``starter.py --query-workflow ID`` (the ``result`` query, which replays the run's history on
  the worker's current code) -> the run's result, computed by the next version's code for a
  run that was in flight when it was deployed (its step queued, not run), and
  ``sagaloop.testing.replay`` of each finished run's history against the next version;
- "once we know that all workflows that started with the initial code are no longer
  running" -> the replays that the README's order rules out fail with ``NonDeterminismError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine.messages import engine_queue, step_queue
from sagaloop.errors import NonDeterminismError
from sagaloop.testing import Harness, replay

NAME = "port-patching"


def pre_patch_activity(ctx: StepContext) -> str:
    return "pre-patch"


def post_patch_activity(ctx: StepContext) -> str:
    return "post-patch"


def initial() -> App:
    app = App(NAME)
    pre = app.step(name="pre_patch_activity")(pre_patch_activity)

    @app.saga(name="my-workflow")
    async def run(ctx: SagaContext) -> str:
        return await ctx.call(pre)

    return app


def patched() -> App:
    app = App(NAME)
    pre = app.step(name="pre_patch_activity")(pre_patch_activity)
    post = app.step(name="post_patch_activity")(post_patch_activity)

    @app.saga(name="my-workflow")
    async def run(ctx: SagaContext) -> str:
        if ctx.patched("my-patch"):
            return await ctx.call(post)
        else:
            return await ctx.call(pre)

    return app


def patch_deprecated() -> App:
    app = App(NAME)
    post = app.step(name="post_patch_activity")(post_patch_activity)

    @app.saga(name="my-workflow")
    async def run(ctx: SagaContext) -> str:
        ctx.deprecate_patch("my-patch")
        return await ctx.call(post)

    return app


def patch_complete() -> App:
    app = App(NAME)
    post = app.step(name="post_patch_activity")(post_patch_activity)

    @app.saga(name="my-workflow")
    async def run(ctx: SagaContext) -> str:
        return await ctx.call(post)

    return app


class Deployment:
    """The worker of one stage on the shared database."""

    def __init__(self, url: str, app: App) -> None:
        self.app = app
        self.env = Harness(app, url=url)

    def start_in_flight(self, run_id: str) -> str:
        """Start a run and let only the engine work: its step is queued, not run, when the
        worker stops (the run is in flight across the deploy)."""
        self.env.queues = [engine_queue(self.app.name)]
        self.env.start("my-workflow", run_id=run_id)
        self.env.run_until_idle(skip_time=False)
        self.env.queues = None
        assert self.env.get(run_id).status == "running"
        return run_id

    def finish(self) -> None:
        self.env.run_until_idle()

    def query(self, run_id: str) -> str:
        return str(self.env.result(run_id))

    def close(self) -> None:
        self.env.close()


def test_patching_stages(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'patching.db'}"
    histories = {}

    # Stage 1 - initial code: a run starts.
    stage1 = Deployment(url, initial())
    stage1.start_in_flight("initial-workflow-id")
    stage1.close()

    # Stage 2 - patch the workflow: the old run takes the old path, a new run the new one.
    stage2 = Deployment(url, patched())
    stage2.finish()
    assert stage2.query("initial-workflow-id") == "pre-patch"
    stage2.start_in_flight("patched-workflow-id")
    histories["initial"] = stage2.env.history("initial-workflow-id")
    stage2.close()

    # Stage 3 - deprecation: the runs of stage 2 and new runs work.
    stage3 = Deployment(url, patch_deprecated())
    stage3.finish()
    assert stage3.query("patched-workflow-id") == "post-patch"
    stage3.start_in_flight("patch-deprecated-workflow-id")
    histories["patched"] = stage3.env.history("patched-workflow-id")
    stage3.close()

    # Stage 4 - patch complete: the runs of stage 3 and new runs work.
    stage4 = Deployment(url, patch_complete())
    stage4.finish()
    assert stage4.query("patch-deprecated-workflow-id") == "post-patch"
    stage4.start_in_flight("patch-complete-workflow-id")
    stage4.finish()
    assert stage4.query("patch-complete-workflow-id") == "post-patch"
    histories["patch-deprecated"] = stage4.env.history("patch-deprecated-workflow-id")
    histories["patch-complete"] = stage4.env.history("patch-complete-workflow-id")
    stage4.close()

    # The query replays each finished run on the next stage's code, which takes its path.
    replay(patched(), histories["initial"])
    replay(patch_deprecated(), histories["patched"])
    replay(patch_complete(), histories["patch-deprecated"])
    replay(patch_complete(), histories["patch-complete"])
    # Why the README waits for the runs of the stage before the last one to end first: the
    # deprecated patch cannot run the initial code's runs, and with the patch gone the
    # patched runs' marker is refused.
    with pytest.raises(NonDeterminismError):
        replay(patch_deprecated(), histories["initial"])
    with pytest.raises(NonDeterminismError):
        replay(patch_complete(), histories["patched"])


def test_a_run_of_the_initial_code_in_flight_when_the_patch_is_deprecated_is_parked(
    tmp_path: Path,
) -> None:
    """What the README's order of stages avoids, were it not followed: the deprecated patch
    meets a run of the initial code (its step run by a worker of the initial code still up,
    its engine of stage 3 already). The run is parked, not moved to the new path."""
    url = f"sqlite:///{tmp_path / 'patching.db'}"
    stage1 = Deployment(url, initial())
    stage1.start_in_flight("initial-workflow-id")
    stage1.env.queues = [step_queue(NAME, "default")]  # its worker only: runs the step
    stage1.finish()
    stage1.close()
    stage3 = Deployment(url, patch_deprecated())
    stage3.finish()
    run = stage3.env.get("initial-workflow-id")
    assert run.status == "needs_attention", run
    assert "call('pre_patch_activity') at position 0" in str(run.reason), run.reason
    stage3.close()
