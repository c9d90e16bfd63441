"""The read model's history sums (``snapshot.HistoryCounts``): each ending row counted once, also
when Postgres commits ids out of order."""

from __future__ import annotations

from collections import Counter

import pytest
import sqlalchemy as sa

from wq_sql import WorkQueue
from wq_sql.monitor import snapshot
from wq_sql.store import statements
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import make_engine, resolve_url


def _event(c: sa.Connection, qid: int, item_id: int, kind: str, claimed_at: object = None) -> None:
    c.execute(sa.insert(statements.events).values(queue_id=qid, item_id=item_id, epoch=0, seq=0, kind=kind,
                                           worker_id=None, token=None, at=dialect_of(c).now(), detail=None,
                                           claimed_at=claimed_at))


def _counts(engine: sa.Engine, h: snapshot.HistoryCounts) -> dict[str, int]:
    sums = snapshot.snapshot(engine, h.read)
    return {k: v for c in sums.values() for k, v in c.items() if k in (*snapshot.ENDING_KINDS, "requeue")}


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_history_counts_rows_committed_out_of_id_order(db_url: str) -> None:
    """A transaction takes an id, another one takes a higher id and commits, a read sees only the
    higher one; once the first commits, the next read counts it, and no read counts a row twice."""
    WorkQueue(["a", "b"], name="q", url=db_url, worker="w").close()
    engine = make_engine(resolve_url(db_url), pool_size=3)
    h = snapshot.HistoryCounts()
    try:
        with engine.connect() as c:
            qid = c.execute(sa.select(statements.queues.c.id)).scalar_one()
            item = c.execute(sa.select(statements.items.c.id).limit(1)).scalar_one()
        assert _counts(engine, h) == {}
        slow = engine.connect()
        tx = slow.begin()
        # As wq_sql's transactions do: the item row first (it takes the transaction id), then the
        # history row (it takes an event id).
        items = statements.items
        slow.execute(sa.update(items).where(items.c.id == item).values(attempts=items.c.attempts))
        _event(slow, qid, item, "done")
        with engine.begin() as fast:
            _event(fast, qid, item, "release")
        assert _counts(engine, h) == {"release": 1}
        assert _counts(engine, h) == {"release": 1}  # the release settled, not counted again
        tx.commit()
        slow.close()
        for _ in range(3):
            assert _counts(engine, h) == {"release": 1, "done": 1}
        with engine.begin() as more:
            _event(more, qid, item, "fail")
        assert _counts(engine, h) == {"release": 1, "done": 1, "fail": 1}
    finally:
        engine.dispose()


def test_history_counts_read_each_row_once(db_url: str) -> None:
    """Both backends: reads between writes add up to the rows, and a new reader agrees."""
    WorkQueue(["a", "b"], name="q", url=db_url, worker="w").close()
    engine = make_engine(resolve_url(db_url), pool_size=1)
    h = snapshot.HistoryCounts()
    try:
        with engine.connect() as c:
            qid = c.execute(sa.select(statements.queues.c.id)).scalar_one()
            item = c.execute(sa.select(statements.items.c.id).limit(1)).scalar_one()
        for k, kind in enumerate(["done", "expire", "done", "recover", "claim", "requeue"] * 3):
            with engine.begin() as c:
                _event(c, qid, item, kind)
            if k % 2:
                _counts(engine, h)
        want = {"done": 6, "expire": 3, "recover": 3}  # a requeue of a done item ends no delivery
        assert _counts(engine, h) == want
        assert _counts(engine, snapshot.HistoryCounts()) == want
        with engine.begin() as c:  # an operator's requeue of a claimed item ends its delivery
            _event(c, qid, item, "requeue", claimed_at=dialect_of(c).now())
        want["requeue"] = 1
        assert _counts(engine, h) == want
        assert _counts(engine, snapshot.HistoryCounts()) == want
        assert snapshot.deliveries(Counter(want), claimed=0) == 13
    finally:
        engine.dispose()
