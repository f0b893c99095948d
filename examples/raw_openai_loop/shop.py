"""The shop's own books, outside sagaloop: orders, refunds and the mails sent to customers, in one
SQLite file, ``shop.db`` in the folder ``$RAW_LOOP_DATA`` (default: the current folder), read
when a step runs.

Refunds are not deduplicated, like a payment provider that ignores idempotency keys: a refund
asked twice is made twice. The refund stores the key it was given as its ``reference``, which
is what the reconcile of ``issue_refund`` looks up; only that reconcile stands between a lost
answer and a second refund. Mails are deduplicated by their key, so sending one again is a no-op.
"""

from __future__ import annotations

import os
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

_SCHEMA = """
create table if not exists orders (
    order_id text primary key,
    customer text not null,
    item text not null,
    cents integer not null
);
create table if not exists refunds (
    refund_id text primary key,
    reference text not null,
    order_id text not null,
    cents integer not null,
    reason text not null
);
create index if not exists refunds_reference on refunds (reference);
create table if not exists mails (
    reference text primary key,
    mail_id text not null,
    order_id text not null,
    text text not null
);
"""
ORDERS = [
    ("o-17", "ann@example.com", "wireless headphones", 4200),
    ("o-18", "bob@example.com", "desk lamp", 2599),
    ("o-19", "cy@example.com", "paperback, 'Dune'", 1150),
]

Reason = Literal["damaged", "not_delivered", "wrong_item", "other"]


class Order(BaseModel):
    order_id: str
    customer: str
    item: str
    cents: int


class Refund(BaseModel):
    """What ``issue_refund`` answers: the refund made, or why none was."""

    refunded: bool
    refund_id: str | None = None
    order_id: str
    cents: int
    detail: str = ""


class Shop:
    """The shop's SQLite file (``path``, default ``$RAW_LOOP_DATA/shop.db``)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or Path(os.environ.get("RAW_LOOP_DATA", ".")) / "shop.db"

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.executescript(_SCHEMA)
            db.executemany("insert or ignore into orders values (?, ?, ?, ?)", ORDERS)
            yield db
        finally:
            db.close()

    def order(self, order_id: str) -> Order | None:
        with self._db() as db:
            row = db.execute(
                "select order_id, customer, item, cents from orders where order_id = ?",
                (order_id,),
            ).fetchone()
        return Order(order_id=row[0], customer=row[1], item=row[2], cents=row[3]) if row else None

    def refund(self, order_id: str, cents: int, reason: Reason, *, reference: str) -> Refund:
        """Refund ``cents`` of an order (at most what was paid, less earlier refunds)."""
        order = self.order(order_id)
        if order is None:
            return Refund(refunded=False, order_id=order_id, cents=0, detail="no such order")
        with self._db() as db:
            db.execute("begin immediate")
            done = db.execute(
                "select coalesce(sum(cents), 0) from refunds where order_id = ?", (order_id,)
            ).fetchone()[0]
            if cents <= 0 or done + cents > order.cents:
                db.execute("rollback")
                left = order.cents - done
                return Refund(
                    refunded=False,
                    order_id=order_id,
                    cents=0,
                    detail=f"refunds of this order may total {order.cents} cents; {left} left",
                )
            refund_id = f"re_{uuid.uuid4().hex[:12]}"
            db.execute(
                "insert into refunds values (?, ?, ?, ?, ?)",
                (refund_id, reference, order_id, cents, reason),
            )
            db.execute("commit")
        return Refund(refunded=True, refund_id=refund_id, order_id=order_id, cents=cents)

    def find_refund(self, reference: str) -> Refund | None:
        """The refund made under ``reference``, if any."""
        with self._db() as db:
            row = db.execute(
                "select refund_id, order_id, cents from refunds where reference = ?", (reference,)
            ).fetchone()
        if row is None:
            return None
        return Refund(refunded=True, refund_id=row[0], order_id=row[1], cents=row[2])

    def refunds(self) -> list[tuple[str, str, str, int, str]]:
        """Every refund made: ``(refund_id, reference, order_id, cents, reason)``."""
        with self._db() as db:
            return list(db.execute("select * from refunds order by rowid"))

    def send_mail(self, order_id: str, text: str, *, reference: str) -> str:
        """Mail the customer of an order; a mail sent again under the same reference is not."""
        with self._db() as db:
            db.execute(
                "insert or ignore into mails values (?, ?, ?, ?)",
                (reference, f"mail_{uuid.uuid4().hex[:12]}", order_id, text),
            )
            row = db.execute("select mail_id from mails where reference = ?", (reference,))
            mail_id: str = row.fetchone()[0]
        return mail_id

    def mails(self) -> list[tuple[str, str, str, str]]:
        """Every mail sent: ``(reference, mail_id, order_id, text)``."""
        with self._db() as db:
            return list(db.execute("select * from mails order by rowid"))
