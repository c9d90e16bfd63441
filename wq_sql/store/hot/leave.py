"""A clean ``close()``'s give-back and leave, as driver-level SQL (the claim round's way).

``close()`` is one write transaction: the claim round acknowledges the items handed out (a
round that claims nothing), then this module gives back the items still held, with their
``release`` history rows, and marks the worker closed (``HotPath.leave``). On SQLite every
writer of the machine waits while a write transaction holds its turn of the writers' queue;
SQLAlchemy's statements, built and compiled for the first time in a process, would hold it that
much longer, and a roll-over's workers all stalled behind each closing worker. As driver-level
texts nothing is compiled there. Same rows as ``statements.release`` and
``statements.close_worker`` (``tests/contract/test_semantics.py`` checks the history both
write).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any, Optional

from sqlalchemy.exc import DBAPIError

from wq_sql.states import CLAIMED, EV_RELEASE, PENDING
from wq_sql.store.dialects import PG_LAZY_COMMIT, SQLITE_NOW, Dialect, qualifier

# Rows per statement: SQLite allows 32766 parameters per statement.
_SQLITE_CHUNK = 4_000  # 5 parameters per history row, 2 per (id, token) pair


class Leaving:
    """The give-back and leave of one queue object, in the transaction open on a driver
    connection (``Db.driver_tx``). Built once per queue object."""

    def __init__(self, b: Dialect, schema: Optional[str] = None) -> None:
        p = qualifier(schema)
        self._run = self._run_sqlite if b.is_sqlite else self._run_postgres
        if b.is_sqlite:
            # (id, token) pairs as a VALUES list joined by primary key, as the claim round's acks.
            self._release = (
                f"UPDATE wq_items SET state = '{PENDING}', token = NULL, lease_until = NULL "
                "FROM (VALUES {pairs}) AS a WHERE wq_items.id = a.column1 AND wq_items.token = a.column2 "
                f"AND wq_items.state = '{CLAIMED}' RETURNING id, epoch, seq, claimed_at, attempts")
            self._events = (
                "INSERT INTO wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at, "
                f"claimed_at, attempt) SELECT ?, column1, column2, column3, '{EV_RELEASE}', ?, NULL, "
                f"{SQLITE_NOW}, column4, column5 FROM (VALUES {{rows}})")
            self._close = ("UPDATE wq_workers SET heartbeat_at = NULL, input_wait = coalesce(?, input_wait) "
                           "WHERE id = ? AND incarnation = ?")
            return
        # One round trip. "state || ''": see ClaimRound (the partial index of claimed rows).
        self._sql = f"""
WITH released AS (
    UPDATE {p}wq_items SET state = '{PENDING}', token = NULL, lease_until = NULL
    WHERE id = ANY(%(ids)s::bigint[])
      AND (id, token) IN (SELECT * FROM unnest(%(ids)s::bigint[], %(tokens)s::bigint[]))
      AND state || '' = '{CLAIMED}'
    RETURNING id, epoch, seq, claimed_at, attempts
), released_events AS (
    INSERT INTO {p}wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at, claimed_at, attempt)
    SELECT %(q)s, id, epoch, seq, '{EV_RELEASE}', %(w)s, NULL, clock_timestamp(), claimed_at, attempts
    FROM released
)
UPDATE {p}wq_workers SET heartbeat_at = NULL, input_wait = coalesce(%(wait)s::float8, input_wait)
WHERE id = %(w)s AND incarnation = %(inc)s
"""
        # Nothing to give back (the end of a drain): the leave alone. The statement with its two
        # empty CTEs is planned by the server at every call, far dearer than this one UPDATE,
        # and every worker leaves at once, on the last worker's path.
        self._sql_leave = (f"UPDATE {p}wq_workers SET heartbeat_at = NULL, "
                           "input_wait = coalesce(%(wait)s::float8, input_wait) "
                           "WHERE id = %(w)s AND incarnation = %(inc)s")

    def run(self, conn: Any, qid: int, worker_id: int, incarnation: str,
            give_back: Sequence[tuple[int, int]], prefix: str = "", *, lazy: bool = False,
            input_wait: Optional[float] = None) -> None:
        """Give back the claimed items among ``give_back`` ``(id, token)`` pairs (no attempt
        counted; a lost lease is skipped) and mark the worker ``incarnation`` closed. On
        Postgres ``prefix`` goes first in the query (``Db.driver_round``: then the query is its
        own transaction, one round trip), and ``lazy`` commits without waiting for the WAL
        flush (``synchronous_commit = off`` for this transaction only): for a leave that
        acknowledges nothing, see ``Outcomes.leave`` for why losing it is harmless.
        ``input_wait``: the worker's final waiting-on-data total (None: leave the row's)."""
        self._run(conn, qid, worker_id, incarnation, give_back, prefix, lazy, input_wait)

    def _run_postgres(self, conn: Any, qid: int, worker_id: int, incarnation: str,
                      give_back: Sequence[tuple[int, int]], prefix: str, lazy: bool,
                      input_wait: Optional[float]) -> None:
        with conn.cursor() as cur:
            sql = self._sql if give_back else self._sql_leave
            cur.execute(prefix + (PG_LAZY_COMMIT if lazy else "") + sql,
                        {"q": qid, "w": worker_id, "inc": incarnation, "ids": [k[0] for k in give_back],
                         "tokens": [k[1] for k in give_back], "wait": input_wait})

    def _run_sqlite(self, conn: Any, qid: int, worker_id: int, incarnation: str,
                    give_back: Sequence[tuple[int, int]], prefix: str = "", lazy: bool = False,
                    input_wait: Optional[float] = None) -> None:
        # lazy has no SQLite form: a SQLite commit's cost is its writers' turn, not a flush.
        params: tuple[Any, ...]
        cur = conn.cursor()
        sql, params = "", ()  # for the error message
        try:
            for k in range(0, len(give_back), _SQLITE_CHUNK):
                chunk = give_back[k:k + _SQLITE_CHUNK]
                sql = self._release.format(pairs=", ".join(["(?, ?)"] * len(chunk)))
                params = tuple(x for pair in chunk for x in pair)
                rows = cur.execute(sql, params).fetchall()  # (id, epoch, seq, claimed_at, attempts)
                if rows:
                    sql = self._events.format(rows=", ".join(["(?, ?, ?, ?, ?)"] * len(rows)))
                    params = (qid, worker_id, *(x for r in rows for x in r))
                    cur.execute(sql, params)
            sql, params = self._close, (input_wait, worker_id, incarnation)
            cur.execute(sql, params)
        except sqlite3.Error as e:  # as SQLAlchemy's, so Db's retry of "database is locked" applies
            raise DBAPIError.instance(sql, params, e, sqlite3.Error) from e
        finally:
            cur.close()
