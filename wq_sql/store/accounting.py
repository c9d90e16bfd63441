"""The history rows and the counters every statement that ends a delivery (or gives an item
back) writes in its own transaction: one ``wq_events`` row per item, and the ``wq_tallies``
counters kept per (queue, epoch, worker) so progress never scans item rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, cast

from sqlalchemy import Connection, Table, insert, select, update

from wq_sql.store.dialects import Dialect
from wq_sql.store.models import Event, Tally

tallies = cast(Table, Tally.__table__)
events = cast(Table, Event.__table__)
ROWS_PER_INSERT = 10_000


def history(conn: Connection, b: Dialect, qid: int, kind: str, rows: Iterable[Any],
            worker_id: Optional[int] = None, detail: Optional[str] = None, *, counted: bool = False,
            delivery: bool = True, detail_of: Optional[Callable[[Any], Optional[str]]] = None) -> None:
    """One history row per row of ``rows``. ``delivery``: each row ended a delivery, whose
    ``claimed_at`` and attempt it records (rows carry ``claimed_at`` and ``attempts``, the latter
    after the statement's own increment when it ``counted`` an attempt); else (a requeue of a
    done or failed item) neither is recorded. ``detail_of``: each row's own detail instead of
    ``detail``."""
    batch = [{"queue_id": qid, "item_id": r.id, "epoch": r.epoch, "seq": r.seq, "kind": kind,
              "worker_id": worker_id if worker_id is not None else r.worker_id,
              "token": getattr(r, "token", None),
              "detail": detail_of(r) if detail_of is not None else detail,
              "claimed_at": r.claimed_at if delivery else None,
              "attempt": r.attempts - counted if delivery else None} for r in rows]
    for k in range(0, len(batch), ROWS_PER_INSERT):
        conn.execute(insert(events).values(at=b.now()), batch[k:k + ROWS_PER_INSERT])


def tally(conn: Connection, b: Dialect, qid: int, rows: Iterable[Any], column: str,
          worker_id: Optional[int] = None) -> None:
    """Count ``rows`` in ``column`` of (epoch, ``worker_id`` or the row's worker)."""
    counts: dict[tuple[int, int], int] = {}
    for r in rows:
        key = (r.epoch, worker_id if worker_id is not None else r.worker_id)
        counts[key] = counts.get(key, 0) + 1
    for (epoch, wid), k in counts.items():
        stmt = b.insert(tallies).values(queue_id=qid, epoch=epoch, worker_id=wid, **{column: k})
        stmt = stmt.on_conflict_do_update(
            index_elements=["queue_id", "epoch", "worker_id"],
            set_={column: getattr(tallies.c, column) + getattr(stmt.excluded, column)})
        conn.execute(stmt)


def untally(conn: Connection, qid: int, rows: Iterable[Any], column: str) -> None:
    """Take rows off the counters that counted them: (epoch, the item's worker), the key every
    ack, fail and expiry tallies under. An item whose worker row is gone (``worker_id`` NULL)
    comes off another counter of its epoch, so the per-epoch sums stay exact."""
    col = getattr(tallies.c, column)
    counts: dict[tuple[int, Optional[int]], int] = {}
    for r in rows:
        counts[(r.epoch, r.worker_id)] = counts.get((r.epoch, r.worker_id), 0) + 1
    for (epoch, wid), k in counts.items():
        where = [tallies.c.queue_id == qid, tallies.c.epoch == epoch]
        if wid is not None:
            moved = conn.execute(update(tallies).where(*where, tallies.c.worker_id == wid, col >= k)
                                 .values({column: col - k})).rowcount
            left = 0 if moved else k
        else:
            left = k
        while left > 0:
            row = conn.execute(select(tallies.c.worker_id, col).where(*where, col > 0)
                               .order_by(col.desc()).limit(1)).one_or_none()
            if row is None:
                break
            take = min(left, int(row[1]))
            conn.execute(update(tallies).where(*where, tallies.c.worker_id == row.worker_id)
                         .values({column: col - take}))
            left -= take
