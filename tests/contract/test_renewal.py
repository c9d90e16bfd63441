"""The heartbeat's renewal (``renewal.Renewal``), on a real database of each backend: what it
renews and what it leaves alone, the identity check, and the reads that ride on it."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from wq_sql import WorkQueue
from wq_sql.store.dialects import SQLITE_NOW, Dialect, dialect_of
from wq_sql.store.engine import resolve_url
from wq_sql.store.hot.claim import ClaimRound
from wq_sql.store.hot.poll import Poll
from wq_sql.store.hot.renew import Carry, Renewal
from wq_sql.worker.heartbeat import CARRY_WINDOW
from wq_sql.worker.identity import hostname

LONG_AGO = dt.datetime(2000, 1, 1)


@contextmanager
def driver(url: str) -> Iterator[tuple[Any, Renewal, Poll]]:
    """A driver connection, and the renewal and look of the dialect; Postgres in autocommit
    mode (each renewal one query, as ``Db.driver_round`` sends it), SQLite committed after."""
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    b = dialect_of(engine)
    fairy = engine.raw_connection()
    conn: Any = fairy.driver_connection
    if not b.is_sqlite:
        conn.autocommit = True
    look = Poll(b)
    try:
        yield conn, Renewal(b, look), look
        if b.is_sqlite:
            conn.commit()
    finally:
        fairy.close()
        engine.dispose()


def _rows(url: str, sql: str, **params: Any) -> list[Any]:
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    try:
        with engine.begin() as c:
            result = c.execute(sa.text(sql), params)
            return list(result.all()) if result.returns_rows else []
    finally:
        engine.dispose()


def _worker(url: str, name: str) -> tuple[int, str, list[int]]:
    (wid, inc), = _rows(url, "SELECT id, incarnation FROM wq_workers WHERE name = :n", n=name)
    tokens = [r[0] for r in _rows(url, "SELECT token FROM wq_items WHERE worker_id = :w "
                                       "AND state = 'claimed'", w=wid)]
    return wid, inc, tokens


def is_pg(url: str) -> bool:
    return url.startswith("postgresql")


def _token(url: str, work: str) -> int:
    return int(_rows(url, "SELECT i.token FROM wq_items i JOIN wq_works w ON w.queue_id = i.queue_id "
                          "AND w.idx = i.work_idx WHERE w.work = :w AND i.state = 'claimed'", w=work)[0][0])


def _leases(url: str) -> dict[str, Any]:
    return {r[0]: r[1] for r in _rows(url, "SELECT w.work, i.lease_until FROM wq_items i JOIN wq_works w "
                                           "ON w.queue_id = i.queue_id AND w.idx = i.work_idx "
                                           "WHERE i.state = 'claimed'")}


def _stale(url: str) -> None:
    _rows(url, "UPDATE wq_items SET lease_until = :t, claimed_at = :t WHERE state = 'claimed'", t=LONG_AGO)


def test_a_renewal_extends_this_workers_leases_only(db_url: str) -> None:
    opts = {"url": db_url, "lease_ahead": 1, "heartbeat_seconds": 30, "lease_seconds": 120,
            "claim_ahead": False, "shuffle": False, "auto_complete": False}
    with WorkQueue(["a1", "a2", "b1", "c"], worker="A", **opts) as a, \
            WorkQueue(["a1", "a2", "b1", "c"], worker="B", **opts) as b:
        assert [a.take(), a.take(), b.take()] == ["a1", "a2", "b1"]
        _stale(db_url)
        qid = _rows(db_url, "SELECT id FROM wq_queues")[0][0]
        wid, inc, tokens = _worker(db_url, "A")
        # Only a1 was claimed within max_item_seconds: a2 is "stuck" and is not renewed.
        now = "clock_timestamp()" if is_pg(db_url) else SQLITE_NOW
        _rows(db_url, f"UPDATE wq_items SET claimed_at = {now} WHERE token = :t", t=_token(db_url, "a1"))
        with driver(db_url) as (conn, renewal, _):
            r = renewal.run(conn, "", qid, wid, inc, tokens, 120, 3600, 0)
        assert r.alive and r.peek is None and r.on_host is None
        leases = _leases(db_url)
        renewed = {w for w, t in leases.items() if t is not None and str(t) > "2001"}
        assert renewed == {"a1"}, leases  # not a2 (claimed too long ago), not B's b1

        with driver(db_url) as (conn, renewal, _):
            r = renewal.run(conn, "", qid, wid, inc, tokens, 120, None, 0)
        assert r.alive
        renewed = {w for w, t in _leases(db_url).items() if str(t) > "2001"}
        assert renewed == {"a1", "a2"}


def test_a_renewal_by_a_lost_identity_renews_nothing(db_url: str) -> None:
    with WorkQueue(["x", "y"], url=db_url, worker="A", lease_ahead=2, heartbeat_seconds=30,
                   lease_seconds=120) as a:
        a.take()
        _stale(db_url)
        qid = _rows(db_url, "SELECT id FROM wq_queues")[0][0]
        wid, _, tokens = _worker(db_url, "A")
        with driver(db_url) as (conn, renewal, _):
            r = renewal.run(conn, "", qid, wid, "another incarnation", tokens, 120, None, 2, poll=True,
                            host=hostname())
        assert not r.alive and r.peek is None
        assert all(str(t) < "2001" for t in _leases(db_url).values())
        assert _rows(db_url, "SELECT buffered FROM wq_workers WHERE id = :w", w=wid)[0][0] != 2


def test_the_poll_and_the_host_count_ride_on_a_renewal(db_url: str) -> None:
    opts = {"url": db_url, "heartbeat_seconds": 30, "lease_seconds": 120}
    with WorkQueue(["x", "y", "z"], worker="A", lease_ahead=1, **opts) as a, \
            WorkQueue(["x", "y", "z"], worker="B", **opts):
        a.take()
        _stale(db_url)  # A's lease has expired: the poll says so
        qid = _rows(db_url, "SELECT id FROM wq_queues")[0][0]
        wid, inc, tokens = _worker(db_url, "A")
        with driver(db_url) as (conn, _, look):
            before = look.read(conn, "", qid, wid)
        assert before.expired and before.mine == 1 and before.pending
        with driver(db_url) as (conn, renewal, look):
            r = renewal.run(conn, "", qid, wid, inc, tokens, 120, None, 0, poll=True, host=hostname())
        assert r.alive and r.on_host == 2
        # The poll reads the snapshot its statement began with on Postgres (the lease still
        # expired), after the update on SQLite: both are what a poll may see.
        assert r.peek is not None and r.peek.mine == 1 and r.peek.pending
        assert (r.peek.finished, r.peek.epochs_created, r.peek.num_epochs) == \
            (before.finished, before.epochs_created, before.num_epochs)
        with driver(db_url) as (conn, renewal, look):
            assert not look.read(conn, "", qid, wid).expired  # renewed
        with driver(db_url) as (conn, renewal, look):
            r = renewal.run(conn, "", qid, wid, inc, tokens, 120, None, 0, host="elsewhere")
        assert r.on_host == 0 and r.peek is None


def _item(url: str, work: str) -> tuple[int, int, str, Any]:
    """(id, token, state, lease_until) of the item of ``work``."""
    return tuple(_rows(url, "SELECT i.id, i.token, i.state, i.lease_until FROM wq_items i JOIN wq_works w "
                            "ON w.queue_id = i.queue_id AND w.idx = i.work_idx WHERE w.work = :w", w=work)[0])


def _dialect(url: str) -> Dialect:
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    try:
        return dialect_of(engine)
    finally:
        engine.dispose()


def test_a_claim_round_carries_the_renewal(db_url: str) -> None:
    """A round with a ``Carry``: the acks and claims as always, and in the same transaction the
    worker row and the leases of the other items held; another incarnation's carry renews
    nothing and says so, and the round's own work still happens."""
    works = ["a1", "a2", "b1", "n1", "n2", "n3", "n4"]
    opts = {"url": db_url, "heartbeat_seconds": 30, "lease_seconds": 120, "claim_ahead": False,
            "shuffle": False, "auto_complete": False}
    with WorkQueue(works, worker="A", lease_ahead=2, **opts) as a, \
            WorkQueue(works, worker="B", lease_ahead=1, **opts) as b:
        assert (a.take(), b.take()) == ("a1", "b1")  # A holds a1 (out) and a2 (buffered)
        _stale(db_url)
        _rows(db_url, "UPDATE wq_workers SET heartbeat_at = :t, buffered = 7", t=LONG_AGO)
        qid = _rows(db_url, "SELECT id FROM wq_queues")[0][0]
        wid, inc, tokens = _worker(db_url, "A")
        a1_id, a1_token, _, _ = _item(db_url, "a1")
        d = _dialect(db_url)
        with driver(db_url) as (conn, renewal, _):
            carry = Carry(renewal, inc, tokens, 1, 120.0, None)
            accepted, got = ClaimRound(d, 2, 120.0).run(conn, qid, wid, [(a1_id, a1_token)], None, "", carry)
        assert carry.alive is True
        assert accepted == {a1_id} and sorted(c.work for c in got) == ["n1", "n2"] and len(got) == 2
        assert _item(db_url, "a1")[2] == "done"
        assert str(_item(db_url, "a2")[3]) > "2001"  # A's other item: renewed
        assert str(_item(db_url, "b1")[3]) < "2001"  # B's: not
        (beat, buffered), = _rows(db_url, "SELECT heartbeat_at, buffered FROM wq_workers WHERE id = :w",
                                  w=wid)
        assert str(beat) > "2001" and buffered == 1
        assert _rows(db_url, "SELECT heartbeat_at FROM wq_workers WHERE name = 'B'")[0][0] is not None
        assert str(_rows(db_url, "SELECT heartbeat_at FROM wq_workers WHERE name = 'B'")[0][0]) < "2001"
        assert _rows(db_url, "SELECT count(*) FROM wq_events WHERE item_id = :i AND kind = 'done'",
                     i=a1_id)[0][0] == 1

        _stale(db_url)
        _rows(db_url, "UPDATE wq_workers SET heartbeat_at = :t", t=LONG_AGO)
        with driver(db_url) as (conn, renewal, _):
            carry = Carry(renewal, "another incarnation", tokens, 1, 120.0, None)
            _, got = ClaimRound(d, 1, 120.0).run(conn, qid, wid, [], None, "", carry)
        assert carry.alive is False and [c.work for c in got] == ["n3"]
        assert str(_item(db_url, "a2")[3]) < "2001"
        assert str(_rows(db_url, "SELECT heartbeat_at FROM wq_workers WHERE id = :w", w=wid)[0][0]) < "2001"


def test_a_worker_that_claims_about_as_often_as_it_beats_renews_in_its_rounds(
        db_url: str, monkeypatch: Any) -> None:
    """A consumer taking an item every ~0.9 heartbeat periods: most beats ride on a claim round
    (the beat itself sends no renewal), the leases and the worker row stay fresh."""
    own: list[float] = []
    carried: list[Carry] = []
    run, claim = Renewal.run, ClaimRound.run

    def counted_run(self: Renewal, *args: Any, **kw: Any) -> Any:
        own.append(time.monotonic())
        return run(self, *args, **kw)

    def counted_claim(self: ClaimRound, *args: Any, **kw: Any) -> Any:
        out = claim(self, *args, **kw)
        c = args[6] if len(args) > 6 else kw.get("carry")
        if c is not None:
            carried.append(c)
        return out
    monkeypatch.setattr(Renewal, "run", counted_run)
    monkeypatch.setattr(ClaimRound, "run", counted_claim)
    beat = 0.5
    with WorkQueue([f"w{i}" for i in range(40)], url=db_url, worker="A", lease_ahead=1, claim_ahead=False,
                   heartbeat_seconds=beat, lease_seconds=6.0) as q:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 14 * beat:
            q.take()
            time.sleep(0.9 * beat)
        beats = (time.monotonic() - t0) / beat
        age = float(_rows(db_url, "SELECT extract(epoch FROM clock_timestamp() - heartbeat_at) "
                                  "FROM wq_workers" if is_pg(db_url) else
                                  "SELECT (julianday('now') - julianday(heartbeat_at)) * 86400 "
                                  "FROM wq_workers")[0][0])
    ok = [c for c in carried if c.alive]
    assert ok, f"no claim round carried a renewal in {beats:.0f} periods ({len(carried)} tried)"
    # The beats whose renewal a round carried sent none of their own (the first beat always does).
    assert len(own) + len(ok) <= beats + 3, (len(own), len(ok), beats)
    assert len(own) < beats - 2, (len(own), beats)
    assert age < 3 * beat * (1 + CARRY_WINDOW), age
