"""Compaction of finished epochs keeps progress, failures and counts; deletes done rows."""

from __future__ import annotations

import sqlalchemy as sa

import wq_sql
import wq_sql.store.engine
from wq_sql import WorkQueue


def _counts(url: str) -> dict[tuple[int, str], int]:
    engine = sa.create_engine(wq_sql.store.engine.resolve_url(url))
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT epoch, state, count(*) FROM wq_audit GROUP BY epoch, state")).all()
    engine.dispose()
    return {(r[0], r[1]): r[2] for r in rows}


def test_compact_keeps_failed_and_progress(db_url: str) -> None:
    works = [f"w{i}" for i in range(10)]
    with WorkQueue(works, num_epochs=4, shuffle=False, url=db_url, worker="a", max_attempts=1,
                   auto_complete=False) as wq:
        for _ in range(25):
            item = wq.take()
            if item.epoch == 0 and item.seq == 3:
                wq.fail(item, "bad record")
            else:
                wq.complete(item)
        assert wq_sql.compact_queue("work_queue", db_url) == 19  # epochs 0 and 1, minus the failure
        counts = _counts(db_url)
        assert counts[(0, "failed")] == 1 and (0, "done") not in counts and (1, "done") not in counts
        assert counts[(2, "done")] == 5
        assert wq.progress().done == 24 and wq.progress().failed == 1
        rest = []
        while True:
            try:
                item = wq.take()
            except wq_sql.QueueExhausted as e:
                assert (e.done, e.failed) == (39, 1)
                break
            rest.append(item)
            wq.complete(item)
    assert len(rest) == 15
