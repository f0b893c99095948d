"""Local fake services with their own storage, outside sagaloop: a payment provider, the
company's ledger and the customer mailbox, all in one SQLite file (``$REFUNDS_PROVIDER_DB``,
default ``provider.db`` in the current folder).

The payment provider honours idempotency keys like real ones do (a second refund with the same
key returns the first refund). Set ``REFUNDS_PROVIDER_IDEMPOTENCY=off`` to make it ignore them:
then only sagaloop's reconcile stands between a lost response and a second refund. It still
stores the key as the refund's reference, which is what ``find_refund`` looks up.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

_SCHEMA = """
create table if not exists refunds (
    refund_id text primary key,
    reference text not null,
    dispute_id text not null,
    transaction_id text not null,
    amount_cents integer not null,
    created_at text not null
);
create index if not exists refunds_reference on refunds (reference);
create table if not exists reversals (
    reversal_id text primary key,
    refund_id text not null,
    reference text not null unique,
    amount_cents integer not null,
    created_at text not null
);
create table if not exists ledger_postings (
    reference text primary key,
    refund_id text not null,
    account text not null,
    amount_cents integer not null,
    created_at text not null
);
create table if not exists customer_messages (
    reference text primary key,
    customer_id text not null,
    dispute_id text not null,
    text text not null,
    created_at text not null
);
"""


class Refund(BaseModel):
    refund_id: str
    reference: str
    dispute_id: str
    transaction_id: str
    amount_cents: int
    created_at: str


class Reversal(BaseModel):
    reversal_id: str
    refund_id: str
    reference: str
    amount_cents: int
    created_at: str


class Posting(BaseModel):
    reference: str
    refund_id: str
    account: str
    amount_cents: int


def default_path() -> Path:
    return Path(os.environ.get("REFUNDS_PROVIDER_DB") or "provider.db")


def honours_idempotency() -> bool:
    return os.environ.get("REFUNDS_PROVIDER_IDEMPOTENCY", "on").lower() not in ("off", "0", "no")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class _Storage:
    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()

    @contextmanager
    def _tx(self, *, write: bool = True) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            conn.executescript(_SCHEMA)
            conn.execute("begin immediate" if write else "begin")
            try:
                yield conn
            except BaseException:
                conn.execute("rollback")
                raise
            conn.execute("commit")
        finally:
            conn.close()


class PaymentProvider(_Storage):
    """Refunds and their reversals."""

    def __init__(self, path: str | Path | None = None, *, idempotency: bool | None = None) -> None:
        super().__init__(path)
        self.idempotency = honours_idempotency() if idempotency is None else idempotency

    def refund(
        self,
        *,
        dispute_id: str,
        transaction_id: str,
        amount_cents: int,
        idempotency_key: str,
    ) -> Refund:
        """Pay ``amount_cents`` back. With idempotency on, a repeated key returns the first
        refund instead of paying again."""
        with self._tx() as conn:
            if self.idempotency:
                found = _one_refund(conn, "reference = ?", idempotency_key)
                if found is not None:
                    return found
            refund = Refund(
                refund_id=f"re_{uuid.uuid4().hex[:12]}",
                reference=idempotency_key,
                dispute_id=dispute_id,
                transaction_id=transaction_id,
                amount_cents=amount_cents,
                created_at=_now(),
            )
            conn.execute(
                "insert into refunds values (?, ?, ?, ?, ?, ?)",
                (
                    refund.refund_id,
                    refund.reference,
                    refund.dispute_id,
                    refund.transaction_id,
                    refund.amount_cents,
                    refund.created_at,
                ),
            )
            return refund

    def find_refund(self, reference: str) -> Refund | None:
        """The refund made with this idempotency key (reference), if any."""
        with self._tx(write=False) as conn:
            return _one_refund(conn, "reference = ?", reference)

    def reverse(self, refund_id: str, *, idempotency_key: str) -> Reversal:
        """Take a refund back; a repeated key returns the first reversal."""
        with self._tx() as conn:
            row = conn.execute(
                "select * from reversals where reference = ?", (idempotency_key,)
            ).fetchone()
            if row is not None:
                return _reversal(row)
            refund = _one_refund(conn, "refund_id = ?", refund_id)
            if refund is None:
                raise LookupError(f"no refund {refund_id!r} at the provider")
            reversal = Reversal(
                reversal_id=f"rv_{uuid.uuid4().hex[:12]}",
                refund_id=refund_id,
                reference=idempotency_key,
                amount_cents=refund.amount_cents,
                created_at=_now(),
            )
            conn.execute(
                "insert into reversals values (?, ?, ?, ?, ?)",
                (
                    reversal.reversal_id,
                    reversal.refund_id,
                    reversal.reference,
                    reversal.amount_cents,
                    reversal.created_at,
                ),
            )
            return reversal

    def refunds(self, dispute_id: str | None = None) -> list[Refund]:
        if not self.path.exists():
            return []
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "select * from refunds where ? is null or dispute_id = ? order by created_at",
                (dispute_id, dispute_id),
            ).fetchall()
        return [_refund(r) for r in rows]

    def reversals(self, refund_id: str | None = None) -> list[Reversal]:
        if not self.path.exists():
            return []
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "select * from reversals where ? is null or refund_id = ? order by created_at",
                (refund_id, refund_id),
            ).fetchall()
        return [_reversal(r) for r in rows]


class Ledger(_Storage):
    """The company's books: one posting per refund, idempotent by reference."""

    def post(self, *, refund_id: str, amount_cents: int, reference: str) -> Posting:
        posting = Posting(
            reference=reference, refund_id=refund_id, account="refunds", amount_cents=amount_cents
        )
        with self._tx() as conn:
            conn.execute(
                "insert or ignore into ledger_postings values (?, ?, ?, ?, ?)",
                (reference, refund_id, posting.account, amount_cents, _now()),
            )
        return posting

    def postings(self) -> list[Posting]:
        if not self.path.exists():
            return []
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "select reference, refund_id, account, amount_cents from ledger_postings"
            ).fetchall()
        return [Posting(reference=a, refund_id=b, account=c, amount_cents=d) for a, b, c, d in rows]


class Mailbox(_Storage):
    """Messages to customers, idempotent by reference (a retried send is not sent twice)."""

    def send(self, *, customer_id: str, dispute_id: str, text: str, reference: str) -> None:
        with self._tx() as conn:
            conn.execute(
                "insert or ignore into customer_messages values (?, ?, ?, ?, ?)",
                (reference, customer_id, dispute_id, text, _now()),
            )

    def messages(self, dispute_id: str) -> list[str]:
        if not self.path.exists():
            return []
        with self._tx(write=False) as conn:
            rows = conn.execute(
                "select text from customer_messages where dispute_id = ? order by created_at",
                (dispute_id,),
            ).fetchall()
        return [str(r[0]) for r in rows]


def _one_refund(conn: sqlite3.Connection, where: str, value: str) -> Refund | None:
    row = conn.execute(
        f"select * from refunds where {where} order by created_at limit 1", (value,)
    ).fetchone()
    return _refund(row) if row is not None else None


def _refund(row: tuple[object, ...]) -> Refund:
    keys = ("refund_id", "reference", "dispute_id", "transaction_id", "amount_cents", "created_at")
    return Refund.model_validate(dict(zip(keys, row, strict=True)))


def _reversal(row: tuple[object, ...]) -> Reversal:
    keys = ("reversal_id", "refund_id", "reference", "amount_cents", "created_at")
    return Reversal.model_validate(dict(zip(keys, row, strict=True)))
