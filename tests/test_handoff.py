"""Items whose data another process consumes (what ``wq_sql.torch`` builds on): a loader hands an
item's data on and stops tracking it (``hand_off``), the consumer's own queue object marks it done
in the holder's name (``complete_handed``), fenced by the lease token; and the ``range:`` source."""

from __future__ import annotations

import pickle

import pytest
import sqlalchemy as sa

from wq_sql import InvalidInput, WorkItem, WorkQueue


def states(url: str) -> dict[str, int]:
    engine = sa.create_engine(url)
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT state, count(*) FROM wq_audit GROUP BY state")).all()
    engine.dispose()
    return {s: n for s, n in rows}


def test_hand_off_then_complete_handed(db_url: str) -> None:
    trainer = WorkQueue(["a", "b", "c", "d"], shuffle=False, url=db_url, worker="rank0", auto_complete=False)
    loader = WorkQueue.attach(url=db_url, worker="rank0/loader0", auto_complete=False, lease_ahead=4)
    items = loader.take_many(4, timeout=0)
    assert [str(i) for i in items] == ["a", "b", "c", "d"]
    loader.hand_off(items[:3])  # a, b, c went to the trainer; d was not read
    assert loader.still_held(items) == items  # all still claimed by the loader
    # The trainer gets them from another process (wq_sql.torch pickles each batch's items).
    sent = pickle.loads(pickle.dumps(items[:2]))
    assert [(type(i), i, i.work, i.key, i.epoch, i.seq, i.attempts) for i in sent] == \
        [(WorkItem, i, i.work, i.key, i.epoch, i.seq, i.attempts) for i in items[:2]]
    lost = trainer.complete_handed({loader.worker_id: sent})
    assert lost == []
    assert loader.still_held(items) == items[2:]
    loader.close()  # gives d back, leaves c (handed off) claimed for the trainer
    assert states(db_url) == {"done": 2, "claimed": 1, "pending": 1}
    assert trainer.complete_handed({loader.worker_id: [items[2]]}) == []
    engine = sa.create_engine(db_url)
    with engine.connect() as c:
        done_by = c.execute(sa.text("SELECT DISTINCT worker FROM wq_history WHERE kind = 'done'")).scalars()
        done_by = list(done_by)
    engine.dispose()
    assert done_by == ["rank0/loader0"]  # the events and tallies name the holder
    trainer.close()


def test_complete_handed_is_fenced(db_url: str) -> None:
    trainer = WorkQueue(["a", "b"], url=db_url, worker="t", auto_complete=False)
    loader = WorkQueue.attach(url=db_url, worker="l", auto_complete=False, lease_ahead=2)
    a, b = loader.take_many(2, timeout=0)
    loader.release(b)  # back to the queue: its token no longer holds
    assert trainer.complete_handed({loader.worker_id: [a, b]}) == [b]
    assert states(db_url) == {"done": 1, "pending": 1}
    loader.close()
    trainer.close()


def test_range_source(db_url: str) -> None:
    wq = WorkQueue(["range:10"], num_slices=3, shuffle=False, url=db_url, worker="w")
    got = [list(wq.read(item)) for item in wq]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    wq.close()
    for bad in ("range:", "range:-1", "range:1e3", "range:x"):
        with pytest.raises(InvalidInput, match="range:<n>"):
            WorkQueue([bad], url=db_url, name="bad", worker="w")
