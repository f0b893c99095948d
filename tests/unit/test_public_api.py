"""The public surface is curated: a change to it is a decision, made here."""

import sagaloop
import sagaloop.testing


def test_exported_names_are_pinned() -> None:
    assert sorted(sagaloop.__all__) == sorted(
        [
            "ALL_STATUSES",
            "App",
            "ApplicationError",
            "ApprovalDenied",
            "ApprovalTakenError",
            "Approval",
            "Client",
            "Concurrency",
            "DeclarationError",
            "EventTimeoutError",
            "NonDeterminismError",
            "NotAppliedError",
            "OverloadedError",
            "Received",
            "RetryPolicy",
            "Roles",
            "RunFinishedError",
            "RunNotFoundError",
            "RunStateError",
            "SagaContext",
            "SagaDef",
            "SagaFailedError",
            "SagaloopError",
            "Service",
            "StepContext",
            "StepCancelled",
            "StepDef",
            "StepFailedError",
            "Tuning",
            "ValidationError",
            "__version__",
            "connect",
            "current_saga",
            "current_step",
            "PublishedEvent",
            "Debounce",
            # issue 25: updates
            "UpdateFailedError",
            "UpdateRefusedError",
            "DEFAULT_CANCEL_GRACE",
            # issue 26: paging through runs (Client.list)
            "RunOrder",
            "run_cursor",
            # steps completed from outside (async completion)
            "CompleteAsync",
            "StepAttemptGoneError",
        ]
    )
    assert sorted(sagaloop.testing.__all__) == [
        "Crash",
        "Harness",
        "VirtualClock",
        "eventually",
        "history_to_json",
        "replay",
    ]
    for name in sagaloop.__all__:
        assert hasattr(sagaloop, name), name


def test_errors_share_one_root() -> None:
    for name in sagaloop.__all__:
        value = getattr(sagaloop, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, sagaloop.SagaloopError), name


def test_published_events_surface_is_pinned() -> None:
    import inspect

    params = inspect.signature(sagaloop.Client.publish_event).parameters
    assert list(params) == ["self", "name", "data", "key", "event_id"]
    assert [p for p in params.values() if p.kind is p.KEYWORD_ONLY] == [
        params["key"],
        params["event_id"],
    ]
    assert list(inspect.signature(sagaloop.SagaContext.subscribe).parameters) == [
        "self",
        "name",
        "key",
    ]
    assert list(inspect.signature(sagaloop.SagaContext.publish_event).parameters) == [
        "self",
        "name",
        "data",
        "key",
    ]
    wait = inspect.signature(sagaloop.SagaContext.wait_for_event).parameters
    assert {"key", "match"} <= set(wait)
    saga = inspect.signature(sagaloop.App.saga).parameters
    assert {"on_event", "run_id"} <= set(saga)


def test_a_cancel_is_delivered_into_saga_code_for_five_minutes_by_default() -> None:
    from datetime import timedelta

    assert timedelta(minutes=5) == sagaloop.DEFAULT_CANCEL_GRACE
    assert "cancelling" in sagaloop.ALL_STATUSES
