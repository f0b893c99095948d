"""Queries (Temporal's ``@workflow.query``): functions declared for a saga, computed on demand
with arguments over what a run recorded: its record, its published values and its history, read
through the store. No saga code runs to answer one, on the client or in the engine: a query
reads the run as it is, never changes it, and needs no engine running.

``@query(saga)`` declares one; ``Client.query(run_id, query_or_name, *args)`` computes it. The
queries of a saga are kept beside it here (the client is the only reader), by saga object."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from sagaloop.engine.history import Event
from sagaloop.engine.state import RunState
from sagaloop.errors import DeclarationError, ValidationError
from sagaloop.sagas.app import SagaDef, _check_name
from sagaloop.sagas.convert import Signature

if TYPE_CHECKING:
    from sagaloop.client.client import Client

P = ParamSpec("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class RunView:
    """A run as a query sees it: what the store holds of it when the query is asked, as JSON
    (``input``, ``output``, ``error`` and ``published`` as stored; ``history`` the recorded
    events of the current history: since the last ``continue_as_new``)."""

    run_id: str
    saga: str
    status: str
    input: Any
    output: Any
    error: dict[str, Any] | None
    published: Mapping[str, Any]
    """The latest value of each key the run published (``ctx.publish``)."""
    history: tuple[Event, ...]


class QueryDef(Generic[P, R]):
    """A declared query: ``fn(run: RunView, *args) -> result``, of one saga. Calling it runs
    the plain function (handy in unit tests); ``Client.query`` runs it over a stored run."""

    def __init__(
        self, fn: Callable[Concatenate[RunView, P], R], saga: SagaDef[Any, Any], name: str
    ) -> None:
        what = f"query {name!r} of saga {saga.name!r}"
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise DeclarationError(
                f"{what} must be a plain `def`: it is computed at once over what the run "
                "recorded, never awaits"
            )
        self.signature = Signature(fn, what=what)  # the run view first, then the arguments
        for p in self.signature.params:
            if p.kind is p.POSITIONAL_ONLY:
                raise DeclarationError(f"{what}: its arguments may not be positional-only")
        self.fn, self.saga, self.name = fn, saga, name
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __call__(self, run: RunView, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(run, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<query {self.name!r} of saga {self.saga.name!r}>"

    def compute(self, run: RunView, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        """The answer for ``run``: the arguments checked against the declared types (and
        converted to them, as JSON would bring them), then the function called."""
        what = f"query {self.name!r}"
        plain = self.signature.args_to_json(args, kwargs, what=what)  # ValidationError
        typed = {
            name: self.signature.converters[name].from_json(value, what=f"{what} argument {name!r}")
            for name, value in plain.items()
        }
        return self.fn(run, **typed)  # type: ignore[call-arg]


def queries_of(saga: SagaDef[Any, Any]) -> dict[str, QueryDef[Any, Any]]:
    """The queries declared for ``saga``, by name."""
    return dict(saga.queries)


def query(
    saga: SagaDef[Any, Any], *, name: str | None = None
) -> Callable[[Callable[Concatenate[RunView, P], R]], QueryDef[P, R]]:
    """Declare a query of ``saga`` (Temporal's ``@workflow.query``)::

        @query(review)
        def stage(run: RunView, detail: bool = False) -> str: ...

        client.query(run_id, stage, True)  # or client.query(run_id, "stage", True)

    ``name``: the name to ask it by (default: the function's name); one name per saga."""
    if not isinstance(saga, SagaDef):
        raise DeclarationError(
            f"@query(saga) takes a declared saga (what @app.saga returns), not {saga!r:.60}"
        )

    def declare(fn: Callable[Concatenate[RunView, P], R]) -> QueryDef[P, R]:
        query_name = _check_name("query", name if name is not None else fn.__name__)
        declared = saga.queries
        if query_name in declared:
            raise DeclarationError(
                f"saga {saga.name!r} already declares a query {query_name!r}: "
                "give this one another name (@query(saga, name=...))"
            )
        made = QueryDef(fn, saga, query_name)
        declared[query_name] = made
        return made

    return declare


def ask(
    client: Client, run_id: str, query: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``Client.query``: find the query, read the run, compute the answer."""
    run = client.get(run_id)  # RunNotFoundError
    saga = client.app.get_saga(run.saga) if client.app is not None else None
    if saga is None or run.app != client.app_name:
        raise ValidationError(
            f"run {run_id!r} is a run of saga {run.saga!r} of app {run.app!r}: querying it "
            "needs that app's code, Client(store, app) with the App that declares the saga"
        )
    declared = queries_of(saga)
    if isinstance(query, QueryDef):
        if declared.get(query.name) is not query:
            raise ValidationError(
                f"{query!r} is not a query of saga {saga.name!r}, whose run {run_id!r} is"
            )
        found: QueryDef[Any, Any] = query
    elif isinstance(query, str) and query in declared:
        found = declared[query]
    else:
        names = ", ".join(sorted(declared)) or "none (declare one with @query(saga))"
        raise ValidationError(
            f"saga {saga.name!r} declares no query {query!r:.60}; its queries: {names}"
        )
    history = client.store.load_history(None, run_id)
    run = client.get(run_id)  # read after the history: at least as new
    state = RunState(run_id)
    for event in history:
        state.apply(event)
    view = RunView(
        run_id=run_id,
        saga=run.saga,
        status=run.status,
        input=run.input,
        output=run.output,
        error=run.error,
        published=MappingProxyType(dict(state.published)),
        history=tuple(history),
    )
    return found.compute(view, args, kwargs)
