"""Waits end when what they wait for happens (issue 13), on both backends.

A ``take()`` that finds nothing claimable waits. It must return as soon as this worker's own
buffer holds an item, whoever put it there: a refill thread (``prefetch()``, claim-ahead, the TF
shim's prefetcher) can claim the last pending item while the take is between its own claim and
its next poll, and then the database says "nothing pending" for ever after. These tests force
that interleaving with a barrier in the take's poll, instead of hoping a busy machine finds it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from wq_sql import QueueEmpty, QueueExhausted, WorkQueue
from wq_sql.store.engine import resolve_url
from wq_sql.store.hot.claim import ClaimRound
from wq_sql.store.hot.poll import Poll
from wq_sql.worker import heartbeat
from wq_sql.worker.dispenser import before_beat


class PollBarrier:
    """Wraps ``Poll.poll`` (what a waiting take polls): records that a poll began and, once
    armed, holds the next poll until released, so a test can act between a take's claim and its
    poll."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.polling = threading.Event()
        self.armed = threading.Event()
        self.release = threading.Event()
        real = Poll.poll

        def poll(*args: Any, **kwargs: Any) -> Any:
            self.polling.set()
            if self.armed.is_set():
                assert self.release.wait(30), "the test never released the poll"
            return real(*args, **kwargs)

        monkeypatch.setattr(Poll, "poll", poll)


def take_in_thread(wq: WorkQueue, timeout: float) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        t = time.monotonic()
        try:
            out["item"] = wq.take(timeout=timeout)
        except Exception as e:  # reported to the test
            out["error"] = e
        out["seconds"] = time.monotonic() - t

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_waiting_take_returns_an_item_a_refill_put_in_its_buffer(db_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The end-of-data hang: the waiter's take claims nothing (the holder has both items) and
    waits; the holder releases ``b``; before the waiter's next poll, a refill of the waiter
    claims ``b`` into its buffer. The poll then finds nothing pending, nothing expired, the queue
    unfinished: a take that only polls the database waits for ever for an item it holds."""
    holder = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="holder", lease_ahead=2,
                       auto_complete=False)
    assert holder.take_many(2) == ["a", "b"]
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter")
    polls = PollBarrier(monkeypatch)
    polls.armed.set()
    thread, out = take_in_thread(waiter, timeout=10)
    assert polls.polling.wait(10), "the take never started waiting"
    holder.release("b")
    assert waiter.prefetch() == 1  # what a refill thread does: b is now in the waiter's buffer
    polls.release.set()
    thread.join(15)
    assert out.get("item") == "b", out
    assert out["seconds"] < 5, out  # at once, not after the take's timeout
    holder.complete("a")
    waiter.close()
    holder.close()


def test_a_take_that_gave_up_leaves_a_refilled_item_to_the_next_take(db_url: str) -> None:
    """``timeout=0`` gives up at once; an item a refill claims afterwards waits in the buffer
    for the next take (and is released by close(), never lost)."""
    holder = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="holder", lease_ahead=2,
                       auto_complete=False)
    assert holder.take_many(2) == ["a", "b"]
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter")
    with pytest.raises(QueueEmpty):
        waiter.take(timeout=0)
    holder.release("b")
    assert waiter.prefetch() == 1
    assert waiter.take(timeout=0) == "b"
    holder.complete("a")
    waiter.close()
    holder.close()
    with WorkQueue.attach("q", url=db_url, worker="check") as check:
        assert check.progress().done == 2


def test_an_item_held_but_unknown_is_handed_out_with_a_warning(db_url: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The guard for what cannot be proven: the database says the waiting worker holds an item
    that no part of it knows (here made so by hand; in the field, a commit whose reply an outage
    lost). After a few polls the take hands it out and logs a WARNING naming it."""
    holder = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="holder", lease_ahead=2,
                       auto_complete=False, poll_seconds=0.05)
    assert holder.take_many(2) == ["a", "b"]
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter", poll_seconds=0.05)
    engine = sa.create_engine(resolve_url(db_url), poolclass=NullPool)
    with engine.begin() as c:  # b moves from the holder to the waiter behind both objects' backs
        c.execute(sa.text("UPDATE wq_items SET token = 7, "
                          "worker_id = (SELECT id FROM wq_workers WHERE name = 'waiter') WHERE work_idx = 1"))
    engine.dispose()
    caplog.set_level(logging.WARNING, logger="wq_sql")
    t = time.monotonic()
    item = waiter.take(timeout=10)
    assert item == "b" and item.seq == 1 and time.monotonic() - t < 5
    assert any("never handed out" in r.getMessage() and "seq 1" in r.getMessage() for r in caplog.records)
    waiter.complete(item)
    holder.complete("a")
    waiter.close()
    holder.close()


def test_a_waiting_take_whose_poll_sees_the_end_ends_there(db_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At the end of a drain every waiting worker's poll sees the queue finished at about the
    same moment. The take ends with that poll, without a claim round and a read of its own: two
    transactions more per worker, all at once, through a pooler's few server connections (the
    200-worker long tail's end: bench/cluster_scale.py tail --trace-slow)."""
    holder = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="holder", lease_ahead=2,
                       auto_complete=False)
    assert holder.take_many(2) == ["a", "b"]
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter", poll_seconds=0.05)
    polls = PollBarrier(monkeypatch)
    thread, out = take_in_thread(waiter, timeout=20)
    assert polls.polling.wait(10), "the take never started waiting"
    rounds: list[int] = []  # the worker ids of the claim rounds from now on
    real = ClaimRound.run

    def run(self: ClaimRound, conn: Any, qid: int, worker_id: int, *args: Any, **kwargs: Any) -> Any:
        rounds.append(worker_id)
        return real(self, conn, qid, worker_id, *args, **kwargs)

    monkeypatch.setattr(ClaimRound, "run", run)
    try:
        holder.complete("a")
        holder.complete("b")
        thread.join(15)
        error = out.get("error")
        assert isinstance(error, QueueExhausted) and (error.done, error.failed) == (2, 0), out
        assert waiter.worker_id not in rounds, rounds
    finally:
        waiter.close()
        holder.close()


def test_take_without_wait_waits_for_an_epoch_being_made(db_url: str) -> None:
    """``take(timeout=0)`` says "others hold the rest" (QueueEmpty) only when they do. While the
    next epoch is due but another worker's maker holds its lock (here: a transaction on the
    queue row that then ends without making a row, as a maker that died would), the take waits,
    then makes the epoch itself. Before, it raised QueueEmpty, and the PyTorch shim's pass end
    (``take_many(timeout=0)``) ended an ``epochs='all'`` pass an epoch early."""
    first = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="first", lease_ahead=2)
    assert first.take_many(2) == ["a", "b"]
    first.close()  # epoch 0 done: the queue is finished ...
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter", poll_seconds=0.2)
    waiter.extend_epochs(2)  # ... until a second epoch is due, not made
    engine = sa.create_engine(resolve_url(db_url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # the maker's write transaction
            conn.execute(sa.text("SELECT id FROM wq_queues WHERE name = 'q' FOR NO KEY UPDATE")
                         if conn.dialect.name == "postgresql" else sa.text("SELECT 1"))
            thread, out = take_in_thread(waiter, timeout=0)
            thread.join(1.0)
            assert thread.is_alive(), f"take(timeout=0) ended while the epoch was being made: {out}"
            conn.rollback()  # the maker is gone, its lock with it
        thread.join(20)
        assert out.get("item") == "a", out
        assert waiter.take_many(1, timeout=0) == ["b"]
        with pytest.raises(QueueExhausted):
            waiter.take(timeout=0)
    finally:
        engine.dispose()
        waiter.close()


def test_the_look_reads_what_the_tables_say(db_url: str) -> None:
    """The read after an empty round and a waiting take's poll (``poll.Poll``, driver-level SQL
    on both backends): each of its figures against the tables' own rows."""
    w = WorkQueue(["a", "b", "c", "d"], shuffle=False, name="q", url=db_url, worker="w", lease_ahead=1,
                  auto_complete=False, max_attempts=1)
    other = WorkQueue.attach("q", url=db_url, worker="other", lease_ahead=1, auto_complete=False)
    try:
        first = w._d._look()
        figures = (first.pending, first.expired, first.finished, first.failed, first.mine)
        assert figures == (True, False, 0, 0, 0)
        assert (first.epochs_created, first.num_epochs) == (1, 1)
        w.complete(w.take())    # a: done
        w.fail(w.take())        # b: failed for good (max_attempts=1)
        assert w.take() == "c"  # held by w
        assert other.take() == "d"
        engine = sa.create_engine(resolve_url(db_url), poolclass=NullPool)
        try:
            with engine.begin() as conn:  # d's lease ran out
                conn.execute(sa.text("UPDATE wq_items SET lease_until = :t WHERE state = 'claimed' "
                                     "AND worker_id = :w"),
                             {"t": "2000-01-01 00:00:00.000000", "w": other.worker_id})
        finally:
            engine.dispose()
        got = w._d._look()
        assert (got.pending, got.expired, got.finished, got.failed, got.mine) == (False, True, 2, 1, 1), got
        assert other._d._look(poll=True).mine == 1
        w.extend_epochs(3)
        assert w._d._look().num_epochs == 3
    finally:
        other.close()
        w.close()


def _counting(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str,
              calls: Optional[list[float]] = None) -> list[float]:
    """Wraps ``obj.name``; returns the list of the times (monotonic) of its calls (``calls``, if
    given: one list for several)."""
    calls = [] if calls is None else calls
    real = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_a_waiting_take_backs_off_after_a_burst_of_takes(db_url: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the doorbell (behind a pooler) a waiting take polls at its worker's own pace of
    taking items, which ends a drain quickly; but only for a few of those intervals after its
    last hand-out. A worker that took a few items in a burst (here six in a row; in the field,
    items given back and claimed in quick rounds) polled every 20 ms for as long as the others
    held items (bench/cluster_scale.py's idle workers: 40 polls/s from one worker)."""
    monkeypatch.setenv("WQ_SQL_BELL", "0")
    holder = WorkQueue([f"w{i}" for i in range(7)], shuffle=False, name="q", url=db_url, worker="holder",
                       auto_complete=False)
    assert holder.take() == "w0"  # held throughout: the waiter's take finds nothing and waits
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter", poll_seconds=0.25)
    try:
        assert [waiter.take() for _ in range(6)] == [f"w{i}" for i in range(1, 7)]
        peeks = _counting(monkeypatch, Poll, "poll")
        t = time.monotonic()
        with pytest.raises(QueueEmpty):
            waiter.take(timeout=3.0)
        seconds = time.monotonic() - t
        # The back-off from 20 ms to poll_seconds takes about 5 polls, the paced ones 1-3 more.
        assert len(peeks) <= seconds / 0.25 + 10, f"{len(peeks)} polls in {seconds:.1f} s"
    finally:
        waiter.close()
        holder.close()


def test_a_waiting_workers_heartbeat_carries_its_poll(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting worker's heartbeat reads the poll's statement in its renewal's transaction, and
    the wait counts it as its poll: the worker's polls and renewals together take one transaction
    per ``poll_seconds`` (before: one more per heartbeat; issue 17's idle cost). The sampled
    look for lost items, which workers of a host take turns at, is left out here."""
    monkeypatch.setenv("WQ_SQL_BELL", "0")
    monkeypatch.setattr(heartbeat, "looks_this_beat", lambda on_host, draw: False)
    holder = WorkQueue(["a", "b"], shuffle=False, name="q", url=db_url, worker="holder", auto_complete=False)
    assert holder.take() == "a"
    waiter = WorkQueue.attach("q", url=db_url, worker="waiter", poll_seconds=0.25, heartbeat_seconds=0.3)
    assert waiter.take() == "b"
    try:
        # The dispenser's and the heartbeat's handle: its transactions and its one-query reads
        txs = _counting(monkeypatch, waiter._db, "tx")
        _counting(monkeypatch, waiter._db, "driver_read", txs)
        t = time.monotonic()
        with pytest.raises(QueueEmpty):
            waiter.take(timeout=4.0)
        # After the back-off (its first second): polls every 0.25 s, 10 beats riding on them.
        window = [x for x in txs if t + 1.0 <= x < t + 4.0]
        assert len(window) <= 3.0 / 0.25 + 2, f"{len(window)} transactions in 3 s"
    finally:
        waiter.close()
        holder.close()


def test_polls_are_spaced_with_the_heartbeats_polls() -> None:
    """``before_beat``: a waiting take's polls and its heartbeat's (which polls too) come at most
    once per interval, evenly, and exactly every interval with the defaults (5 s and 1 s)."""
    assert before_beat(0.0, 4.99, 1.0) == pytest.approx(0.998)  # just after a beat: 5 gaps
    assert before_beat(4.05, 5.0, 1.0) == 6.0  # no room before the beat: it polls; this one if it did not
    assert before_beat(0.0, 1.6, 1.0) == 2.6  # a 1.6 s period: one transaction per period, not two
    assert before_beat(0.0, 5.0, 2.0) == 2.5  # 5 s and 2 s: two gaps of 2.5 s, not 2 + 2 + 1
    assert before_beat(5.2, 5.0, 1.0) == 6.2  # a beat overdue (in flight): an interval from now


def test_the_read_of_a_finished_queue_skips_its_probes_and_says_so(db_url: str) -> None:
    """``Poll`` skips its three index probes once the tallies count every item finished. Before
    that it must still run them (an item pending, one held), and the finished test must hold
    for any ``num_epochs``, up to 2**62 (``n_works * num_epochs`` overflows 64 bits there)."""
    wq = WorkQueue(["a", "b"], num_epochs=2**62, shuffle=False, name="huge", url=db_url, worker="w",
                   lease_ahead=1, claim_ahead=False)
    try:
        assert wq.take() == "a"
        peek = wq._d._look()
        assert (peek.pending, peek.expired, peek.mine, peek.finished) == (True, False, 1, 0)
    finally:
        wq.close()
    wq = WorkQueue(["a", "b"], shuffle=False, name="small", url=db_url, worker="w", lease_ahead=1,
                   claim_ahead=False, auto_complete=False)
    try:
        first = wq.take()
        peek = wq._d._look()
        assert (peek.pending, peek.mine, peek.finished) == (True, 1, 0)
        wq.complete(first)
        wq.complete(wq.take())
        peek = wq._d._look()
        got = (peek.pending, peek.expired, peek.mine, peek.finished, peek.num_epochs)
        assert got == (False, False, 0, 2, 1)
        with pytest.raises(QueueExhausted):
            wq.take(timeout=0)
    finally:
        wq.close()
