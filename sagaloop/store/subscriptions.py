"""The SQL of event subscriptions: ``sagaloop_subscriptions``, a row per run and ``(name,
key)`` a published event of that name and key reaches (the store's ``SubscriptionStore``
role). The engine writes a run's rows in the transaction of the activation that changes them,
and reads them in the one that fans a ``publish`` out: a subscription committed before the
fan-out reads it is served, one committed after is not."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import SubscriptionStore
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of

_c = t.subscriptions.c


class SqlSubscriptions(SqlCore, SubscriptionStore):
    """Event subscriptions on SQL."""

    def set_subscriptions(
        self, tx: Any, app: str, run_id: str, wanted: frozenset[tuple[str, str]]
    ) -> None:
        conn = conn_of(tx)
        held = self.subscriptions_of(tx, run_id)
        for name, key in sorted(held - wanted):
            conn.execute(
                t.subscriptions.delete().where(
                    (_c.run_id == run_id) & (_c.name == name) & (_c.key == key)
                )
            )
        for name, key in sorted(wanted - held):
            values = {"app": app, "name": name, "key": key, "run_id": run_id}
            self._insert_ignore(conn, t.subscriptions, values)

    def subscribers(self, tx: Any, app: str, name: str, key: str | None) -> list[str]:
        keys = [""] if key is None else ["", key]
        q = (
            sa.select(_c.run_id)
            .where((_c.app == app) & (_c.name == name) & _c.key.in_(keys))
            .distinct()
            .order_by(_c.run_id)
        )
        with self._in(tx) as conn:
            return [str(r) for r in conn.execute(q).scalars()]

    def subscriptions_of(self, tx: Any, run_id: str) -> frozenset[tuple[str, str]]:
        with self._in(tx) as conn:
            rows = conn.execute(sa.select(_c.name, _c.key).where(_c.run_id == run_id)).all()
            return frozenset((str(name), str(key)) for name, key in rows)
