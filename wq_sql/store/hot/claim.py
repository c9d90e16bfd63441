"""The hot path: one claim round per ``take()`` that needs the database, as driver-level SQL.

A round acknowledges the items finished since the last round and claims up to ``n`` new ones,
with the acks' history rows and counters and the claims' work strings. A claim writes no history
row: a delivery's one row is written when it ends (here, the ``done`` of an ack), carrying its
``claimed_at`` and attempt; a delivery in flight is its item row. SQLite's texts are here;
Postgres' round is the server-side function ``wq_claim_round()``, whose live text is
``claim_round.sql`` beside this module (made by migrations 0007 and 0008, which stay frozen;
``tests/migrations/test_claim_texts.py`` checks that the migrated function is that text, and that both
backends' rounds agree). Why each backend's claim is safe: ``docs/design.md``, "The claim".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from pathlib import Path
from typing import Any, Optional

from sqlalchemy.exc import DBAPIError

from wq_sql.states import CLAIMED, DONE, EV_DONE, PENDING
from wq_sql.store.dialects import SQLITE_LATER, SQLITE_NOW, Dialect, pg_bigints, qualifier
from wq_sql.store.driver import last_rows
from wq_sql.store.hot.renew import Carry
from wq_sql.store.statements import Claimed, new_token

CLAIM_ROUND_SQL = Path(__file__).with_name("claim_round.sql")


def claim_round_text(prefix: str = "") -> str:
    """The live ``CREATE OR REPLACE FUNCTION wq_claim_round(...)`` of ``claim_round.sql``, its
    tables and the function itself in the schema of ``prefix`` (``'"name".'``, or ``""``)."""
    return CLAIM_ROUND_SQL.read_text(encoding="utf-8").format(s=prefix)


class ClaimRound:
    """The hot path, one round trip per ``take()`` that needs the database: acknowledge the
    items finished since the last round and claim up to ``n`` new ones, with the acks' history
    rows, counters and the claims' work strings. Built once per queue object as driver-level SQL.

    Postgres runs it as ONE call of the server-side function ``wq_claim_round()``
    (``claim_round.sql``: the acks with their history rows and counters, then the claim
    starting at a floor, see
    ``_floor``), sent in one simple query with the transaction's timeouts and committed by the
    server at its end: one round trip (``engine.driver_statement``), and no planning of its
    statements after a server connection's first round. SQLite runs the same steps as separate
    statements inside the ``BEGIN IMMEDIATE`` transaction: statements are in-process calls there,
    not network trips."""

    FULL_SCAN_EVERY = 64  # rounds; see _floor

    def __init__(self, b: Dialect, n: int, lease_seconds: float, schema: Optional[str] = None) -> None:
        self.b, self.n, self.lease = b, n, float(lease_seconds)
        # The queue's ``revoked`` counter as the last claiming round read it (None: none yet):
        # it moves when a quarantine takes items back from their holders (the dispenser then
        # drops from its buffer what this worker no longer holds).
        self.revoked: Optional[int] = None
        # Postgres: the lowest (epoch, seq) this worker claimed last round. Claimed and done rows
        # leave dead entries in the pending index until VACUUM, all at its low end (claims go in
        # order), and a scan from the start steps over every one of them: late in a large drain,
        # many index pages per claim. So the claim starts at the floor (one index descent),
        # and looks below it (in the same round) when that finds too few rows,
        # and from the start every FULL_SCAN_EVERY rounds: that is how items that went back to the
        # queue below the floor are found; no scan below when the floor found enough.
        self._floor: Optional[tuple[int, int]] = None
        self._rounds = 0
        p = qualifier(schema)
        # The one place this module names its dialect: which texts, and which runner of them.
        self._run = self._run_sqlite if b.is_sqlite else self._run_postgres
        if b.is_sqlite:
            self._made: dict[tuple[str, int], str] = {}  # see _texts
            self._later = f"+{self.lease!r} seconds"  # the lease, as SQLite's date modifier
            # Completed as one statement per round: (id, token) pairs as a VALUES list.
            self._ack = (
                f"UPDATE wq_items SET state = '{DONE}', done_at = {SQLITE_NOW}, lease_until = NULL "
                "FROM (VALUES {pairs}) AS a WHERE wq_items.id = a.column1 AND wq_items.token = a.column2 "
                f"AND wq_items.state = '{CLAIMED}' "
                "RETURNING id, epoch, seq, token, done_at, claimed_at, attempts")
            # The done rows as one multi-row INSERT, each stamped with its item's own done_at and
            # claimed_at (so row and item agree): one statement, and no strftime() per row as
            # executemany() would need.
            self._events = (
                "INSERT INTO wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at, "
                f"claimed_at, attempt) SELECT ?, column1, column2, column3, '{EV_DONE}', ?, column4, "
                "column5, column6, column7 FROM (VALUES {rows})")
            # One ack, one done row (the round of lease_ahead 1): the plain forms, without the
            # VALUES table to build and join for a single row.
            self._ack1 = (
                f"UPDATE wq_items SET state = '{DONE}', done_at = {SQLITE_NOW}, lease_until = NULL "
                f"WHERE id = ? AND token = ? AND state = '{CLAIMED}' "
                "RETURNING id, epoch, seq, token, done_at, claimed_at, attempts")
            self._event1 = (
                "INSERT INTO wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at, "
                f"claimed_at, attempt) VALUES (?, ?, ?, ?, '{EV_DONE}', ?, ?, ?, ?, ?)")
            self._tally = (
                "INSERT INTO wq_tallies (queue_id, epoch, worker_id, n_done) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (queue_id, epoch, worker_id) DO UPDATE SET n_done = n_done + excluded.n_done")
            self._claim = (
                f"WITH c AS MATERIALIZED (SELECT id FROM wq_items WHERE queue_id = ? AND state = '{PENDING}' "
                "ORDER BY epoch, seq LIMIT ?) "
                f"UPDATE wq_items SET state = '{CLAIMED}', worker_id = ?, token = ?, "
                f"claimed_at = {SQLITE_NOW}, lease_until = {SQLITE_LATER}, done_at = NULL "
                "FROM c WHERE wq_items.id = c.id RETURNING id, epoch, seq, work_idx, attempts, "
                # Each claimed row's work string, read by primary key: no SELECT of its own.
                "(SELECT work FROM wq_works w WHERE w.queue_id = wq_items.queue_id "
                "AND w.idx = wq_items.work_idx), "
                # The queue's revoked counter, by primary key, in the same statement.
                "(SELECT revoked FROM wq_queues q WHERE q.id = wq_items.queue_id)")
            # The counter when the round claimed nothing (its buffer may still hold revoked items).
            self._revoked = "SELECT revoked FROM wq_queues WHERE id = ?"
            return
        # The round is the server-side function wq_claim_round() (claim_round.sql): its
        # statements' plans are cached per server connection, where the same statements as a
        # simple query were planned afresh at every round.
        # Rows: (kind, id, epoch, seq, work_idx, attempts, work), kind 'c' claimed, 'a' acked.
        self._sql = (f"SELECT * FROM {p}wq_claim_round(%(q)s, %(w)s, %(t)s, %(lease)s, %(fe)s, "
                     "%(fs)s, %(lim)s, %(ack_ids)s::bigint[], %(ack_tokens)s::bigint[])")
        # A claiming round's one more row, kind 'r': the queue's revoked counter (by primary key).
        self._pg_revoked = (f" UNION ALL SELECT 'r', revoked, NULL, NULL, NULL, NULL, NULL FROM {p}wq_queues "
                            "WHERE id = %(q)s")

    def warm(self, conn: Any, prefix: str) -> None:
        """Postgres: plan every statement of ``wq_claim_round()`` on this server connection (a
        call for queue -1, which has no rows: nothing is read or written), so that the worker's
        first rounds do not plan them. A first call on a connection costs the server far more
        CPU than a planned one, and workers that start at once would queue for their first item
        behind each other's planning. ``conn``, ``prefix``: as :meth:`run`'s
        (``Db.driver_round``). SQLite: nothing (no plans kept across rounds)."""
        if self.b.is_sqlite:
            return
        none = pg_bigints([-1])  # no such item
        with conn.cursor() as cur:
            cur.execute(prefix + self._sql, {"q": -1, "w": -1, "t": 0, "lease": self.lease, "fe": 0, "fs": 0,
                                             "lim": 1, "ack_ids": none, "ack_tokens": none})
            last_rows(cur)

    def run(self, conn: Any, qid: int, worker_id: int, acks: Sequence[tuple[int, int]],
            limit: Optional[int] = None, prefix: str = "",
            carry: Optional[Carry] = None) -> tuple[set[int], list[Claimed]]:
        """Claim up to ``limit`` items (default ``n``), in the transaction open on ``conn``, a
        driver connection (``engine.driver_transaction``); on Postgres also on a connection in
        autocommit mode (``engine.driver_statement``), where the round is one simple query and
        its own transaction, ``prefix`` (the statement that sets that transaction's timeouts,
        with its ``;``) going first in the same query. ``carry``: the heartbeat's renewal goes
        in the same transaction (Postgres: the same statement), its outcome set on it. Returns
        (ids of acks accepted, items claimed in hand-out order, each with its work)."""
        return self._run(conn, qid, worker_id, acks, new_token(), self.n if limit is None else limit, prefix,
                         carry)

    def _run_postgres(self, conn: Any, qid: int, worker_id: int, acks: Sequence[tuple[int, int]],
                      token: int, n: int, prefix: str,
                      carry: Optional[Carry]) -> tuple[set[int], list[Claimed]]:
        self._rounds += 1
        floor = self._floor if self._rounds % self.FULL_SCAN_EVERY else None
        fe, fs = floor or (-1, -1)
        params = {"q": qid, "w": worker_id, "t": token, "lease": self.lease, "fe": fe, "fs": fs, "lim": n,
                  "ack_ids": pg_bigints(a[0] for a in acks), "ack_tokens": pg_bigints(a[1] for a in acks)}
        sql = self._sql
        if carry is not None:  # one more row, kind 'b': whether the renewal's worker row matched
            ctes, more = carry.pg()
            sql = f"{ctes}{sql} UNION ALL SELECT 'b', (SELECT count(*) FROM rw), NULL, NULL, NULL, NULL, NULL"
            params.update(more)
        if n:
            sql += self._pg_revoked
        with conn.cursor() as cur:
            # rows: (kind, id, epoch, seq, work_idx, attempts, work), kind 'c' claimed, 'a' acked
            cur.execute(prefix + sql, params)
            rows = last_rows(cur)
        if carry is not None:
            carry.alive = any(r[0] == "b" and r[1] for r in rows)
        if n:
            self.revoked = next((int(r[1]) for r in rows if r[0] == "r"), self.revoked)
        accepted = {r[1] for r in rows if r[0] == "a"}
        got = [r for r in rows if r[0] == "c"]
        if n:  # a round that only acknowledges (limit 0) says nothing about where claims start
            self._floor = min(((r[2], r[3]) for r in got), default=None)
        claimed = sorted((Claimed(r[1], r[2], r[3], r[4], token, r[5], r[6]) for r in got),
                         key=lambda c: (c.epoch, c.seq))
        return accepted, claimed

    def _run_sqlite(self, conn: Any, qid: int, worker_id: int, acks: Sequence[tuple[int, int]],
                    token: int, n: int, prefix: str = "",
                    carry: Optional[Carry] = None) -> tuple[set[int], list[Claimed]]:
        params: tuple[Any, ...]
        # Errors are re-raised as SQLAlchemy's, with the statement, so the caller's retry of
        # "database is locked" applies unchanged.
        cur = conn.cursor()
        sql, params = "", ()  # for the error message
        try:
            done: list[Any] = []
            if len(acks) == 1:  # lease_ahead 1: the plain statement
                sql, params = self._ack1, tuple(acks[0])
                done = cur.execute(sql, params).fetchall()
            else:
                for k in range(0, len(acks), _SQLITE_ACK_CHUNK):
                    chunk = acks[k:k + _SQLITE_ACK_CHUNK]
                    sql = self._texts(self._ack, "pairs", "(?, ?)", len(chunk))
                    params = tuple(chain.from_iterable(chunk))
                    done += cur.execute(sql, params).fetchall()
            # done: (id, epoch, seq, token, done_at, claimed_at, attempts), one history row each
            per_epoch: dict[int, int] = {}
            for r in done:
                per_epoch[r[1]] = per_epoch.get(r[1], 0) + 1
            sql = self._tally
            for epoch, k in per_epoch.items():
                cur.execute(sql, (qid, epoch, worker_id, k))
            sql, params = self._claim, (qid, n, worker_id, token, self._later)
            # (id, epoch, seq, work_idx, attempts, work, revoked)
            rows = cur.execute(sql, params).fetchall()
            if rows:
                self.revoked = int(rows[0][6])
            elif n:
                sql, params = self._revoked, (qid,)
                got = cur.execute(sql, params).fetchone()
                if got is not None:
                    self.revoked = int(got[0])
            if len(done) == 1:
                r = done[0]
                sql, params = self._event1, (qid, r[0], r[1], r[2], worker_id, r[3], r[4], r[5], r[6])
                cur.execute(sql, params)
            else:
                for k in range(0, len(done), _SQLITE_EVENT_CHUNK):
                    batch = done[k:k + _SQLITE_EVENT_CHUNK]
                    sql = self._texts(self._events, "rows", "(?, ?, ?, ?, ?, ?, ?)", len(batch))
                    params = (qid, worker_id, *chain.from_iterable(batch))
                    cur.execute(sql, params)
        except sqlite3.Error as e:
            raise DBAPIError.instance(sql, params, e, sqlite3.Error) from e
        finally:
            cur.close()
        if carry is not None:
            carry.run_sqlite(conn, qid, worker_id)
        if len(rows) > 1:
            rows.sort(key=_EPOCH_SEQ)  # hand-out order
        return {r[0] for r in done}, [Claimed(r[0], r[1], r[2], r[3], token, r[4], r[5]) for r in rows]

    def _texts(self, template: str, slot: str, row: str, k: int) -> str:
        """SQLite: ``template`` with ``k`` rows of placeholders, made once per (template, k):
        a round of n items asks for the same few sizes again and again."""
        key = (template, k)
        sql = self._made.get(key)
        if sql is None:
            if len(self._made) >= 64:  # sizes change with the automatic lease_ahead: stay small
                self._made.clear()
            sql = self._made[key] = template.format(**{slot: ", ".join([row] * k)})
        return sql


_EPOCH_SEQ = itemgetter(1, 2)  # of a claimed row: its place in hand-out order
# Rows per statement: SQLite allows 32766 parameters per statement.
_SQLITE_ACK_CHUNK = 10_000  # 2 parameters each
_SQLITE_EVENT_CHUNK = 4_000  # 7 each
