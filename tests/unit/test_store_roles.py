"""The store port by role: ``Store`` is exactly the union of its role protocols, and
``SqlStore`` implements every role (checked at run time here, and statically by mypy)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

import sagaloop.store
from sagaloop.engine import ports
from sagaloop.engine.ports import (
    STORE_ROLES,
    ApprovalStore,
    InboxStore,
    Maintenance,
    OutboxQueue,
    ProcessRegistry,
    RateLimits,
    RunQueries,
    RunStore,
    Store,
    TimerStore,
    Transactions,
)
from sagaloop.store.core import SqlCore
from sagaloop.store.sql import SqlStore


def _methods(cls: type) -> set[str]:
    """The methods a protocol declares itself (not those it inherits)."""
    return {
        name
        for name, value in vars(cls).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


@pytest.fixture
def store() -> Iterator[SqlStore]:
    store = SqlStore("sqlite://")
    yield store
    store.close()


def test_store_is_the_union_of_its_roles() -> None:
    assert Store.__bases__ == (*STORE_ROLES, Protocol)
    assert not _methods(Store), "declare a store method in one of the role protocols"
    every = [name for role in STORE_ROLES for name in _methods(role)]
    assert len(every) == len(set(every)), "a method belongs to one role"
    assert all(_methods(role) for role in STORE_ROLES)


def test_every_role_protocol_is_exported_by_ports() -> None:
    roles = {name for name, value in vars(ports).items() if value in STORE_ROLES}
    assert len(roles) == len(STORE_ROLES)


@pytest.mark.parametrize("role", STORE_ROLES, ids=lambda role: role.__name__)
def test_sql_store_plays_every_role(store: SqlStore, role: type) -> None:
    assert isinstance(store, role)
    for name in _methods(role):
        declared = inspect.signature(getattr(role, name))
        implemented = inspect.signature(getattr(SqlStore, name))
        assert list(implemented.parameters) == list(declared.parameters), name


def test_each_sql_mixin_subclasses_the_roles_it_plays() -> None:
    """A mixin names its roles as bases, so mypy checks each method against its port where the
    method is written, and a method without a docstring shows its port's (the contract)."""
    for role in STORE_ROLES:
        assert issubclass(SqlStore, role) and role in SqlStore.__mro__, role.__name__
        for name in _methods(role):
            owner = next(c for c in SqlStore.__mro__ if name in vars(c))
            assert owner not in STORE_ROLES, f"SqlStore leaves {role.__name__}.{name} unwritten"
            assert role in owner.__mro__ or owner is SqlCore, (owner, role)  # the shared core


def _phrases(doc: str | None, n: int = 7) -> set[tuple[str, ...]]:
    words = (doc or "").split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@pytest.mark.parametrize("role", STORE_ROLES, ids=lambda role: role.__name__)
def test_a_contract_is_written_once_in_its_port(role: type) -> None:
    """What a method promises is in the port's docstring; the SQL method's own docstring (if
    any) says how, and repeats no phrase of the contract."""
    for name in _methods(role):
        implemented = getattr(SqlStore, name)
        if implemented.__doc__ is None:
            continue
        repeated = _phrases(implemented.__doc__) & _phrases(getattr(role, name).__doc__)
        assert not repeated, f"{role.__name__}.{name}: {sorted(repeated)[0]}"


def test_sql_store_satisfies_the_roles_statically(store: SqlStore) -> None:
    """mypy checks these assignments: a SqlStore method that drifts from its role fails it."""
    transactions: Transactions = store
    maintenance: Maintenance = store
    runs: RunStore = store
    queries: RunQueries = store
    timers: TimerStore = store
    inbox: InboxStore = store
    outbox: OutboxQueue = store
    limits: RateLimits = store
    approvals: ApprovalStore = store
    registry: ProcessRegistry = store
    whole: Store = store
    assert whole is store
    roles = (transactions, maintenance, runs, queries, timers, inbox, outbox, limits)
    assert all(role is store for role in (*roles, approvals, registry))


def test_no_store_module_is_over_600_lines() -> None:
    """The store is split by role: a module that grows past this is a role to split again."""
    folder = Path(sagaloop.store.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in folder.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 600} == {}
