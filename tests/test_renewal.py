"""The heartbeat's renewal (``renewal.Renewal``), on a real database of each backend: what it
renews and what it leaves alone, the identity check, and the reads that ride on it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from wq_sql import WorkQueue
from wq_sql.dialects import SQLITE_NOW, dialect_of
from wq_sql.engine import resolve_url
from wq_sql.identity import hostname
from wq_sql.look import Look
from wq_sql.renewal import Renewal

LONG_AGO = dt.datetime(2000, 1, 1)


@contextmanager
def driver(url: str) -> Iterator[tuple[Any, Renewal, Look]]:
    """A driver connection, and the renewal and look of the dialect; Postgres in autocommit
    mode (each renewal one query, as ``Db.driver_round`` sends it), SQLite committed after."""
    engine = sa.create_engine(resolve_url(url), poolclass=NullPool)
    b = dialect_of(engine)
    fairy = engine.raw_connection()
    conn: Any = fairy.driver_connection
    if not b.is_sqlite:
        conn.autocommit = True
    look = Look(b)
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
