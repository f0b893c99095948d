"""Port of Temporal's message passing introduction sample: its signal handlers and
``wait_condition``.

Original: github.com/temporalio/samples-python, ``message_passing/introduction/workflows.py``
(``GreetingWorkflow``, commit 1ed6b30af316b88d4827dc7768b97d9cf1509843), ``activities.py``,
``starter.py`` (the sequence of ``test_the_starters_sequence``) and
``tests/message_passing/introduction/test_introduction_sample.py`` (the other tests, with their
assertions).

What maps to what:

- the ``approve`` signal and its handler -> ``ctx.on_event("approve", approve,
  model=ApproveInput)``: the handler mutates the saga's state as the event arrives;
- ``workflow.wait_condition(lambda: approved and workflow.all_handlers_finished())`` ->
  ``ctx.wait_condition(lambda: approved and ctx.all_handlers_finished())``;
- the ``set_language`` update (sync) and its validator -> ``ctx.on_update("set_language",
  set_language, validator=validate_language, model=Language)``; ``execute_update`` ->
  ``Harness.update`` / ``Client.update``, which return the previous language, and raise
  ``UpdateRefusedError`` (an ``UpdateFailedError``, as Temporal's ``WorkflowUpdateFailedError``)
  when the validator refuses an unsupported language;
- the ``set_language_using_activity`` update (async, which executes the
  ``call_greeting_service`` activity under an ``asyncio.Lock``, and raises an
  ``ApplicationError`` when the service does not know the language) -> an async update handler
  awaiting the step ``call_greeting_service`` under the same lock; ``start_update(...,
  wait_for_stage=ACCEPTED)`` then ``update_handle.result()`` -> ``Harness.send_update`` then
  ``Harness.update`` with the update id it returned;
- the ``get_language`` and ``get_languages`` queries -> values the handlers publish
  (``ctx.publish``), read with ``Harness.get_published``;
- ``Worker(..., activities=[call_greeting_service])`` -> the step, run by the harness;
  ``handle.result()`` -> ``Harness.result``.

Every test runs with the harness replaying the saga code from its history on each activation
(the default) and with the code cached between activations.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from enum import IntEnum
from pathlib import Path

import pytest

from sagaloop import (
    App,
    ApplicationError,
    Client,
    SagaContext,
    StepContext,
    UpdateFailedError,
)
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine.messages import engine_queue
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness, replay


class Language(IntEnum):
    ARABIC = 1
    CHINESE = 2
    ENGLISH = 3
    FRENCH = 4
    HINDI = 5
    PORTUGUESE = 6
    SPANISH = 7


@dataclasses.dataclass
class ApproveInput:
    name: str


app = App("port-message-passing-introduction")


@app.step()
async def call_greeting_service(ctx: StepContext, to_language: Language) -> str | None:
    """A remote greeting service that knows every language."""
    greetings = {
        Language.ARABIC: "مرحبا بالعالم",
        Language.CHINESE: "\u4f60\u597d\uff0c\u4e16\u754c",  # with a full-width comma
        Language.ENGLISH: "Hello, world",
        Language.FRENCH: "Bonjour, monde",
        Language.HINDI: "नमस्ते दुनिया",
        Language.PORTUGUESE: "Olá mundo",
        Language.SPANISH: "Hola mundo",
    }
    return greetings.get(Language(to_language))


@app.saga(name="greeting")
async def greeting_workflow(ctx: SagaContext) -> str:
    approved: list[str] = []  # the approver's name, once approved
    greetings = {
        Language.CHINESE: "\u4f60\u597d\uff0c\u4e16\u754c",
        Language.ENGLISH: "Hello, world",
    }
    language = [Language.ENGLISH]
    lock = asyncio.Lock()  # used by the async handler

    def published() -> None:  # the queries get_language and get_languages
        ctx.publish("language", language[0])
        ctx.publish("languages", sorted(greetings))

    def approve(input: ApproveInput) -> None:
        approved.append(input.name)

    def set_language(to: Language) -> Language:
        previous, language[0] = language[0], to
        published()
        return previous

    def validate_language(to: Language) -> None:
        if to not in greetings:
            raise ValueError(f"{to.name} is not supported")

    async def set_language_using_activity(to: Language) -> Language:
        if to not in greetings:
            async with lock:
                greeting = await ctx.call(call_greeting_service, to)
                if greeting is None:
                    raise ApplicationError(f"Greeting service does not support {to.name}")
                greetings[to] = greeting
        return set_language(to)

    published()
    ctx.on_event("approve", approve, model=ApproveInput)
    ctx.on_update("set_language", set_language, validator=validate_language, model=Language)
    ctx.on_update("set_language_using_activity", set_language_using_activity, model=Language)
    await ctx.wait_condition(lambda: bool(approved) and ctx.all_handlers_finished())
    return greetings[language[0]]


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def language(env: Harness, run_id: str) -> Language:
    return Language(env.get_published(run_id, "language"))


def test_queries(env: Harness) -> None:
    run_id = env.start(greeting_workflow)
    env.run_until_idle()
    assert language(env, run_id) == Language.ENGLISH
    assert env.get_published(run_id, "languages") == [Language.CHINESE, Language.ENGLISH]
    assert sorted(Language) == [
        Language.ARABIC,
        Language.CHINESE,
        Language.ENGLISH,
        Language.FRENCH,
        Language.HINDI,
        Language.PORTUGUESE,
        Language.SPANISH,
    ]


def test_set_language(env: Harness) -> None:
    run_id = env.start(greeting_workflow)
    env.run_until_idle()
    assert language(env, run_id) == Language.ENGLISH
    previous_language = env.update(run_id, "set_language", Language.CHINESE)
    assert previous_language == Language.ENGLISH
    assert language(env, run_id) == Language.CHINESE


def test_set_invalid_language(env: Harness) -> None:
    run_id = env.start(greeting_workflow)
    env.run_until_idle()
    assert language(env, run_id) == Language.ENGLISH
    with pytest.raises(UpdateFailedError):
        env.update(run_id, "set_language", Language.ARABIC)
    assert language(env, run_id) == Language.ENGLISH


def test_set_language_that_is_only_available_via_remote_service(env: Harness) -> None:
    run_id = env.start(greeting_workflow)
    env.run_until_idle()
    assert language(env, run_id) == Language.ENGLISH
    previous_language = env.update(run_id, "set_language_using_activity", Language.ARABIC)
    assert previous_language == Language.ENGLISH
    assert language(env, run_id) == Language.ARABIC


def test_the_starters_sequence(env: Harness) -> None:
    """starter.py: an update, an update that executes an activity (started, then awaited),
    then the ``approve`` signal sent while that activity still runs: the workflow waits for
    the handler to end and returns the greeting in the language it set."""
    run_id = env.start(greeting_workflow, run_id="greeting-workflow-1234")
    env.run_until_idle()
    assert env.get_published(run_id, "languages") == [Language.CHINESE, Language.ENGLISH]
    previous_language = env.update(run_id, "set_language", Language.CHINESE)
    assert (previous_language, language(env, run_id)) == (Language.ENGLISH, Language.CHINESE)
    env.queues = [engine_queue(app.name)]  # the activity is slow: it runs after the signal
    update_id = env.send_update(run_id, "set_language_using_activity", Language.ARABIC)
    env.run_until_idle()
    assert [e.kind for e in env.history(run_id)][-2:] == ["update_accepted", "step_scheduled"]
    env.send_event(run_id, "approve", {"name": ""})
    env.run_until_idle()
    assert env.get(run_id).status not in ("completed", "failed")  # the handler still runs
    env.queues = None
    previous_language = env.update(run_id, "set_language_using_activity", update_id=update_id)
    assert (previous_language, language(env, run_id)) == (Language.CHINESE, Language.ARABIC)
    env.run_until_idle()
    assert env.result(run_id) == "مرحبا بالعالم"
    replay(app, env.history(run_id), run_id=run_id)


def test_the_starters_sequence_with_a_running_engine_and_worker(tmp_path: Path) -> None:
    """starter.py against an engine and a worker running beside the test (as Temporal's worker
    runs beside its starter), on a SQLite file: the run's code is cached by the engine between
    activations, and each message is its own activation."""
    store = SqlStore(f"sqlite:///{tmp_path / 'introduction.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=2), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()
    try:
        client = Client(store, app)
        run_id = client.start(greeting_workflow, run_id="greeting-workflow-1234")
        languages = client.wait_published(run_id, "languages", timeout=30)
        assert languages == [Language.CHINESE, Language.ENGLISH]
        previous = client.update(run_id, "set_language", Language.CHINESE, timeout=30)
        assert previous == Language.ENGLISH
        assert Language(client.get_published(run_id, "language")) == Language.CHINESE
        previous = client.update(run_id, "set_language_using_activity", Language.ARABIC, timeout=30)
        assert previous == Language.CHINESE
        assert Language(client.get_published(run_id, "language")) == Language.ARABIC
        client.send_event(run_id, "approve", {"name": ""})
        assert client.result(run_id, timeout=30) == "مرحبا بالعالم"
        replay(app, client.history(run_id), run_id=run_id)
    finally:
        runtime.stop()
        store.close()
