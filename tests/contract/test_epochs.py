"""Making the next epoch in chunks: a transaction per ``epoch_chunk`` rows, in the background or
by a worker that found nothing pending, continued by anyone after its maker died, on both
backends. Every (epoch, seq) exists once, in the epoch's seeded order, and is done once."""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from typing import Any, Callable, Optional

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from wq_sql import QueueExhausted, WorkQueue
from wq_sql.plan import FILL_SLICE, SHUFFLE_SLICE, epoch_order
from wq_sql.store import statements
from wq_sql.store.engine import resolve_url
from wq_sql.worker import epochs


def query(url: str, sql: str) -> list[Any]:
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(sql)).all())
    finally:
        engine.dispose()


def drain(wq: WorkQueue, out: list[Any]) -> None:
    while True:
        try:
            out.append(wq.take())
        except QueueExhausted:
            return


def check_epochs(url: str, n: int, n_epochs: int, seed: int) -> None:
    rows = query(url, "SELECT epoch, seq, work_idx, state FROM wq_items ORDER BY epoch, seq")
    assert len(rows) == n * n_epochs
    for e in range(n_epochs):
        mine = [r for r in rows if r.epoch == e]
        assert [r.seq for r in mine] == list(range(n))
        assert [r.work_idx for r in mine] == list(epoch_order(n, e, True, seed)), f"epoch {e} out of order"
    assert {r.state for r in rows} == {"done"}
    dup = query(url, "SELECT epoch, seq FROM wq_history WHERE kind = 'done' GROUP BY epoch, seq "
                     "HAVING count(*) <> 1")
    assert dup == []
    assert query(url, "SELECT epochs_created FROM wq_queues")[0][0] == n_epochs


def test_epochs_made_in_chunks_by_two_workers(db_url: str) -> None:
    works = [f"w{i:03d}" for i in range(50)]
    got: dict[str, list[Any]] = {"a": [], "b": []}
    queues = [WorkQueue(works, num_epochs=4, seed=5, name="q", url=db_url, worker=w) for w in got]
    for wq in queues:
        wq.epoch_chunk = 7
    threads = [threading.Thread(target=drain, args=(wq, got[wq.worker])) for wq in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for wq in queues:
        wq.close()
    assert sorted(got["a"] + got["b"]) == sorted(works * 4)
    check_epochs(db_url, len(works), 4, seed=5)


def test_half_made_epoch_is_finished_by_another_worker(db_url: str) -> None:
    """Its maker died after two chunks: the rows it committed stay, and a worker that runs out of
    pending items continues from the next seq (the background maker leaves it alone: not its own)."""
    works = [f"w{i:02d}" for i in range(20)]
    WorkQueue(works, num_epochs=3, seed=9, name="q", url=db_url, worker="creator").close()
    engine = sa.create_engine(resolve_url(db_url), poolclass=NullPool)
    try:
        for _ in range(2):
            with engine.begin() as c:
                if engine.dialect.name == "sqlite":
                    c.exec_driver_sql("SELECT 1")
                qid = c.execute(sa.select(statements.queues.c.id)).scalar_one()
                assert statements.advance_epoch(c, qid, 1, chunk=6) == 1  # more to do
    finally:
        engine.dispose()
    made = query(db_url, "SELECT count(*), max(seq) FROM wq_items WHERE epoch = 1")[0]
    assert tuple(made) == (12, 11)
    got: list[Any] = []
    with WorkQueue.attach("q", url=db_url, worker="w") as wq:
        wq.epoch_chunk = 5
        drain(wq, got)
    assert sorted(got) == sorted(works * 3)
    check_epochs(db_url, len(works), 3, seed=9)


def test_close_stops_the_background_maker_between_chunks(db_url: str) -> None:
    """close() does not wait for a big epoch to be made: the maker stops after its chunk in
    flight; the epoch is finished later by whoever needs it."""
    works = [f"w{i:04d}" for i in range(3000)]
    with WorkQueue(works, num_epochs=2, seed=1, name="q", url=db_url, worker="a") as wq:
        wq.epoch_chunk = 10
        wq.take()  # the newest epoch is being handed out: the next one is made in the background
    made = query(db_url, "SELECT count(*) FROM wq_items WHERE epoch = 1")[0][0]
    assert made < len(works)
    assert query(db_url, "SELECT epochs_created FROM wq_queues")[0][0] == 1
    got: list[Any] = []
    with WorkQueue.attach("q", url=db_url, worker="b") as wq:
        drain(wq, got)
    assert len(got) == 2 * len(works) - 1
    assert sorted(r.epoch for r in query(db_url, "SELECT DISTINCT epoch FROM wq_items")) == [0, 1]
    assert query(db_url, "SELECT count(*) FROM wq_items WHERE epoch = 1")[0][0] == len(works)


def test_seeded_order_is_pinned() -> None:
    """An epoch's order is a promise across versions and machines (a restarted job, or workers
    of two releases, must agree on it): these are the orders of the first release."""
    assert list(epoch_order(12, 1, True, 2024)) == [4, 10, 8, 11, 3, 6, 5, 0, 7, 2, 1, 9]
    text = ",".join(map(str, epoch_order(40_000, 2, True, 7))).encode()
    digest = "3057f480eb0c79a2b8e12a1e40551a17d0f9a78b3308c687b6d91837dcaf241a"
    assert hashlib.sha256(text).hexdigest() == digest


@pytest.mark.parametrize("n", [1, 2, SHUFFLE_SLICE, SHUFFLE_SLICE + 1, FILL_SLICE + 1, 2 * FILL_SLICE + 7])
def test_breathing_order_is_the_same(n: int) -> None:
    """The background maker's shuffle, computed in slices with a call between them (it hands the
    GIL to the worker's other threads), is the same permutation, and breathes between slices."""
    for shuffle in (True, False):
        calls: list[None] = []
        got = epoch_order(n, 3, shuffle, 11, breathe=functools.partial(calls.append, None))
        assert got == epoch_order(n, 3, shuffle, 11)
        slices = -(-n // FILL_SLICE) + (-(-(n - 1) // SHUFFLE_SLICE) if shuffle else 0)
        assert len(calls) >= slices - 1


def test_background_shuffle_waits_for_its_process_write_transactions(db_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two slices, the background maker's shuffle waits while a write transaction of its
    own process is open: that transaction needs the GIL after each statement, and on SQLite every
    writer of the machine waits behind it (bench/scale.py rollover)."""
    monkeypatch.setattr(epochs, "SHUFFLE_WAIT", 60.0)
    started, go = threading.Event(), threading.Event()
    breaths: list[str] = []
    real = epochs.epoch_order

    def spy(*args: Any, breathe: Optional[Callable[[], object]] = None, **kwargs: Any) -> Any:
        if breathe is None:
            return real(*args, **kwargs)
        started.set()
        assert go.wait(30)

        def counted() -> None:
            breaths.append("in")
            breathe()
            breaths.append("out")
        return real(*args, breathe=counted, **kwargs)

    monkeypatch.setattr(epochs, "epoch_order", spy)
    works = [f"w{i:04d}" for i in range(3 * SHUFFLE_SLICE)]
    got: list[Any] = []
    with WorkQueue(works, num_epochs=2, seed=4, name="q", url=db_url, worker="a", claim_ahead=False) as wq:
        got.append(wq.take())  # the first item of the newest epoch: the next one is made in the background
        assert started.wait(30)
        inside, release = threading.Event(), threading.Event()

        def hold(c: Connection) -> None:
            inside.set()
            assert release.wait(30)

        holder = threading.Thread(target=wq._db.tx, args=(hold,))
        holder.start()
        try:
            assert inside.wait(30)
            go.set()
            time.sleep(0.3)  # ample for 3,000 swaps (~1 ms): the shuffle waits in its first breath
            assert breaths == ["in"]
        finally:
            release.set()
            holder.join(30)
        drain(wq, got)
    assert "out" in breaths
    assert sorted(got) == sorted(works * 2)
    check_epochs(db_url, len(works), 2, seed=4)
