"""Port of Temporal's message passing introduction sample: a greeting workflow with two
queries, a signal that approves its release and two updates that change its language, one
of which calls an activity.

Original: github.com/temporalio/samples-python, ``message_passing/introduction/``
(``workflows.py``: ``GreetingWorkflow``; ``activities.py``: ``call_greeting_service``;
``starter.py``) and ``tests/message_passing/introduction/test_introduction_sample.py`` (its
four tests, with their assertions; the fifth below is the starter's sequence).

What maps to what:

- the workflow object's state (``self.language``, ``self.greetings``) -> local variables of
  the saga, published with ``ctx.publish`` whenever they change: a Temporal query reads the
  live object, a sagaloop query (``@query(saga)``, ``Client.query``) reads what the run
  recorded, without running saga code;
- ``@workflow.query get_language`` / ``get_languages(GetLanguagesInput)`` -> ``@query``
  functions of a ``RunView`` (the second takes the same input dataclass);
- ``@workflow.signal approve`` -> ``ctx.on_event("approve", ...)``;
- ``@workflow.update set_language`` with its ``@validator`` -> ``ctx.on_update(...,
  validator=...)``; ``set_language_using_activity`` (async, under an ``asyncio.Lock``, calling
  the activity) -> an async update handler awaiting ``ctx.call`` of a step;
- ``WorkflowUpdateFailedError`` (validator rejection or ``ApplicationError``) ->
  ``UpdateRefusedError`` (the validator refused it: nothing recorded) or ``UpdateFailedError``
  (the handler raised); both are ``UpdateFailedError``s, as both are Temporal's one error;
- ``workflow.wait_condition(lambda: approved and workflow.all_handlers_finished())`` -> the same
  with ``ctx.wait_condition`` and ``ctx.all_handlers_finished``;
- ``start_update(..., wait_for_stage=ACCEPTED)`` then ``update_handle.result()`` ->
  ``Harness.send_update`` then ``Harness.update(..., update_id=...)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from enum import IntEnum
from typing import Any

import pytest

from sagaloop import (
    App,
    ApplicationError,
    SagaContext,
    StepContext,
    UpdateFailedError,
    UpdateRefusedError,
)
from sagaloop.client import RunView, query
from sagaloop.testing import Harness, replay

# --- __init__.py -------------------------------------------------------------------------------


class Language(IntEnum):
    ARABIC = 1
    CHINESE = 2
    ENGLISH = 3
    FRENCH = 4
    HINDI = 5
    PORTUGUESE = 6
    SPANISH = 7


HELLO_CHINESE = "你好，世界"  # noqa: RUF001 - the sample's text, with its full-width comma

# --- activities.py -----------------------------------------------------------------------------

app = App("port-message-passing-introduction")


@app.step()
def call_greeting_service(ctx: StepContext, to_language: Language) -> str | None:
    """Simulates a call to a remote greeting service that supports every language."""
    greetings = {
        Language.ARABIC: "مرحبا بالعالم",
        Language.CHINESE: HELLO_CHINESE,
        Language.ENGLISH: "Hello, world",
        Language.FRENCH: "Bonjour, monde",
        Language.HINDI: "नमस्ते दुनिया",
        Language.PORTUGUESE: "Olá mundo",
        Language.SPANISH: "Hola mundo",
    }
    return greetings.get(Language(to_language))


# --- workflows.py ------------------------------------------------------------------------------


@dataclasses.dataclass
class GetLanguagesInput:
    include_unsupported: bool


@dataclasses.dataclass
class SetLanguageInput:
    language: Language


@dataclasses.dataclass
class ApproveInput:
    name: str


@app.saga(name="greeting")
async def greeting_workflow(ctx: SagaContext) -> str:
    approved_for_release = False
    greetings = {Language.CHINESE: HELLO_CHINESE, Language.ENGLISH: "Hello, world"}
    language = Language.ENGLISH
    lock = asyncio.Lock()  # used by the async handler below

    def record() -> None:  # what the queries read
        ctx.publish("language", language)
        ctx.publish("languages", sorted(greetings))

    def approve(input: ApproveInput) -> None:
        nonlocal approved_for_release
        approved_for_release = True
        ctx.publish("approver_name", input.name)

    def validate_language(input: SetLanguageInput) -> None:
        if input.language not in greetings:
            raise ValueError(f"{input.language.name} is not supported")

    def set_language(input: SetLanguageInput) -> Language:
        nonlocal language
        previous_language, language = language, input.language
        record()
        return previous_language

    async def set_language_using_activity(input: SetLanguageInput) -> Language:
        nonlocal language
        if input.language not in greetings:
            async with lock:
                greeting = await ctx.call(call_greeting_service, input.language)
                if greeting is None:
                    raise ApplicationError(
                        f"Greeting service does not support {input.language.name}"
                    )
                greetings[input.language] = greeting
        previous_language, language = language, input.language
        record()
        return previous_language

    record()
    ctx.on_event("approve", approve, model=ApproveInput)
    ctx.on_update("set_language", set_language, validator=validate_language, model=SetLanguageInput)
    ctx.on_update(
        "set_language_using_activity", set_language_using_activity, model=SetLanguageInput
    )
    await ctx.wait_condition(lambda: approved_for_release and ctx.all_handlers_finished())
    return greetings[language]


@query(greeting_workflow)
def get_languages(run: RunView, input: GetLanguagesInput) -> list[Language]:
    if input.include_unsupported:
        return sorted(Language)
    return [Language(x) for x in run.published["languages"]]


@query(greeting_workflow)
def get_language(run: RunView) -> Language:
    return Language(run.published["language"])


# --- the sample's tests ------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["replay", "cache"])
def env(request: pytest.FixtureRequest) -> Harness:
    return Harness(app, cache=request.param)


def started(env: Harness) -> str:
    run_id = env.start(greeting_workflow)
    env.run_until_idle()
    return run_id


def test_queries(env: Harness) -> None:
    run_id = started(env)
    assert env.query(run_id, get_language) == Language.ENGLISH
    assert env.query(run_id, get_languages, GetLanguagesInput(include_unsupported=False)) == [
        Language.CHINESE,
        Language.ENGLISH,
    ]
    assert env.query(run_id, get_languages, GetLanguagesInput(include_unsupported=True)) == [
        Language.ARABIC,
        Language.CHINESE,
        Language.ENGLISH,
        Language.FRENCH,
        Language.HINDI,
        Language.PORTUGUESE,
        Language.SPANISH,
    ]


def test_set_language(env: Harness) -> None:
    run_id = started(env)
    assert env.query(run_id, get_language) == Language.ENGLISH
    previous_language = env.update(
        run_id, "set_language", SetLanguageInput(language=Language.CHINESE)
    )
    assert previous_language == Language.ENGLISH
    assert env.query(run_id, get_language) == Language.CHINESE


def test_set_invalid_language(env: Harness) -> None:
    run_id = started(env)
    assert env.query(run_id, get_language) == Language.ENGLISH
    with pytest.raises(UpdateFailedError) as e:
        env.update(run_id, "set_language", SetLanguageInput(language=Language.ARABIC))
    # Not in the original: the validator refused it before anything was recorded.
    assert isinstance(e.value, UpdateRefusedError)
    assert "ARABIC is not supported" in str(e.value)
    assert env.query(run_id, get_language) == Language.ENGLISH


def test_set_language_that_is_only_available_via_remote_service(env: Harness) -> None:
    run_id = started(env)
    assert env.query(run_id, get_language) == Language.ENGLISH
    previous_language = env.update(
        run_id, "set_language_using_activity", SetLanguageInput(language=Language.ARABIC)
    )
    assert previous_language == Language.ENGLISH
    assert env.query(run_id, get_language) == Language.ARABIC


def test_the_starter(env: Harness) -> None:
    """``starter.py``: query, update, update started then awaited, signal, result."""
    run_id = started(env)
    supported = env.query(run_id, get_languages, GetLanguagesInput(include_unsupported=False))
    assert supported == [Language.CHINESE, Language.ENGLISH]
    assert env.update(run_id, "set_language", SetLanguageInput(language=Language.CHINESE)) == (
        Language.ENGLISH
    )
    assert env.query(run_id, get_language) == Language.CHINESE
    sent = env.send_update(
        run_id, "set_language_using_activity", SetLanguageInput(language=Language.ARABIC)
    )
    assert env.update(run_id, "set_language_using_activity", update_id=sent) == Language.CHINESE
    assert env.query(run_id, get_language) == Language.ARABIC
    env.send_event(run_id, "approve", ApproveInput(name=""))
    env.run_until_idle()
    assert env.result(run_id) == "مرحبا بالعالم"
    replay(app, env.history(run_id), run_id=run_id)


def test_a_language_outside_the_enum_is_refused_before_anything_is_recorded(env: Harness) -> None:
    """Not in the original's tests: data that does not fit the handler's model is refused like a
    validator's rejection (Temporal fails it decoding the argument); the run goes on."""
    run_id = started(env)
    broken: Any = {"language": 99}
    with pytest.raises(UpdateRefusedError, match="not a valid SetLanguageInput"):
        env.update(run_id, "set_language_using_activity", broken)
    assert [e.kind for e in env.history(run_id) if e.kind.startswith("update_")] == [
        "update_refused"
    ]
    env.send_event(run_id, "approve", ApproveInput(name="ada"))
    env.run_until_idle()
    assert env.result(run_id) == "Hello, world"
