"""The SQL of the approvals index (``sagaloop_approvals``): one row per approval a run asked
for, written in the transaction of the activation that published it, claimed by the answer
that wins, deleted when the run finishes: the store's ``ApprovalStore`` role."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine.ports import ApprovalRow, ApprovalStore, RunRecord
from sagaloop.sagas.approvals import OPEN_STATUSES
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of, record

_c = t.approvals.c
_OPEN = sorted(OPEN_STATUSES)
_COUNTED = {"preserve_rowcount": True}


def _key(run_id: str, call_id: str) -> Any:
    return (_c.run_id == run_id) & (_c.call_id == call_id)


def _requested_at(request: dict[str, Any], default: datetime) -> datetime:
    text = request.get("requested_at")
    try:
        return datetime.fromisoformat(text) if isinstance(text, str) else default
    except ValueError:
        return default


def end(conn: Connection, run_ids: Sequence[str]) -> None:
    """Forget the approvals of finished (or restarted) runs."""
    conn.execute(t.approvals.delete().where(_c.run_id.in_(list(run_ids))))


class SqlApprovals(SqlCore, ApprovalStore):
    """The approvals index on SQL."""

    def publish_approval(
        self,
        tx: Any,
        run: RunRecord,
        call_id: str,
        request: dict[str, Any],
        *,
        now: datetime,
        release: str | None = None,
    ) -> None:
        """An update, then an insert when there was no row (the request is new)."""
        conn = conn_of(tx)
        status = str(request.get("status", ""))
        values: dict[str, Any] = {"status": status, "request": request, "updated_at": now}
        if release is not None and status in OPEN_STATUSES:
            values["answer_id"] = sa.case((_c.answer_id == release, None), else_=_c.answer_id)
            values["answer"] = sa.case((_c.answer_id == release, None), else_=_c.answer)
        q = t.approvals.update().where(_key(run.run_id, call_id)).values(values)
        if conn.execute(q.execution_options(**_COUNTED)).rowcount == 1:
            return
        requested_at = _requested_at(request, now)
        conn.execute(
            t.approvals.insert().values(
                run_id=run.run_id,
                call_id=call_id,
                app=run.app,
                saga=run.saga,
                status=status,
                request=request,
                request_id=secrets.token_hex(16),
                requested_at=requested_at,
                updated_at=now,
            )
        )

    def end_approvals(self, tx: Any, run_id: str) -> None:
        end(conn_of(tx), [run_id])

    def approval(self, tx: Any, run_id: str, call_id: str) -> ApprovalRow | None:
        q = sa.select(t.approvals).where(_key(run_id, call_id))
        with self._in(tx) as conn:
            row = conn.execute(q).mappings().first()
        return None if row is None else record(ApprovalRow, row)

    def claim_approval(
        self,
        tx: Any,
        run_id: str,
        call_id: str,
        *,
        request_id: str,
        message_id: str,
        answer: dict[str, Any],
    ) -> bool:
        """One conditional update."""
        q = (
            t.approvals.update()
            .where(
                _key(run_id, call_id),
                _c.request_id == request_id,
                _c.status.in_(_OPEN),
                sa.or_(_c.answer_id.is_(None), _c.answer_id == message_id),
            )
            .values(answer_id=message_id, answer=answer)
        )
        return conn_of(tx).execute(q.execution_options(**_COUNTED)).rowcount == 1

    def open_approvals(
        self,
        *,
        app: str | None,
        run_id: str | None = None,
        after: tuple[datetime, str, str] | None = None,
        limit: int = 50,
    ) -> list[ApprovalRow]:
        """A page read in order from the index ``sagaloop_approvals_page`` (with ``app``),
        never a scan of runs nor a sort of all the open approvals; its predicate is repeated
        word for word, as literals, so a prepared (generic) plan can use it too."""
        q = sa.select(t.approvals).where(sa.text(t.APPROVALS_OPEN))
        if app is not None:
            q = q.where(_c.app == app)
        if run_id is not None:
            q = q.where(_c.run_id == run_id)
        if after is not None:
            at, run, call = after
            q = q.where(
                sa.or_(
                    _c.requested_at > at,
                    sa.and_(_c.requested_at == at, sa.tuple_(_c.run_id, _c.call_id) > (run, call)),
                )
            )
        q = q.order_by(_c.requested_at, _c.run_id, _c.call_id).limit(limit)
        with self._read() as conn:
            return [record(ApprovalRow, r) for r in conn.execute(q).mappings()]
