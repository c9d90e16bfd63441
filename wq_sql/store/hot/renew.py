"""A heartbeat's renewal, as driver-level SQL (the claim round's way).

Every ``heartbeat_seconds`` each worker refreshes its row and the leases of the items it holds;
while one of its takes waits, the wait's poll (``poll.Poll``) rides in the same transaction, and
on its first beat the count of the host's live workers (``heartbeat.looks_this_beat``) too. Through
SQLAlchemy that was a transaction of four round trips (``BEGIN`` with the timeouts, two
``UPDATE``s, ``COMMIT``) and its Python per beat; behind a transaction pooler the server
connection stayed held for all four and the client's time between them. With many workers per
process on few cores, the worker threads waited for the GIL between those round trips, so the
pooler's server connections sat idle in transaction while the server had capacity to spare,
clients queued for them, and ``take()`` calls waited behind the queue.

On Postgres the renewal is now ONE statement (the updates as data-modifying CTEs, the ride-along
reads as columns of its result), sent with the transaction's timeouts as one simple query in
autocommit mode (``Db.driver_round``): the pooler holds a server connection for the server's
time only. On SQLite, the same steps as separate statements in one write transaction. Same rows
as ``statements.renew`` wrote before.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy.exc import DBAPIError

from wq_sql.states import CLAIMED
from wq_sql.store.dialects import SQLITE_LATER, SQLITE_NOW, Dialect, qualifier
from wq_sql.store.driver import last_rows
from wq_sql.store.hot.poll import Peek, Poll

# Tokens per statement on SQLite (32766 parameters at most).
_SQLITE_CHUNK = 30_000


@dataclass(frozen=True)
class Renewed:
    """What one renewal found: whether this incarnation still owns the worker row (False: another
    process took the identity over, nothing was renewed), the poll that rode on it, and the
    host's live workers, each when asked for."""

    alive: bool
    peek: Optional[Peek] = None
    on_host: Optional[int] = None


@dataclass
class Carry:
    """A renewal that a claim round carries instead of the heartbeat's own transaction
    (``heartbeat.Heartbeat.carry``): this incarnation's worker row and the leases of ``tokens``
    (the items held when the round began; the round's own acks are left out by id, its claims
    come with fresh leases). The round sets ``alive``: True when it renewed, False when another
    process holds the identity (nothing renewed; the heartbeat's own beat then finds it out)."""

    renewal: Renewal
    incarnation: str
    tokens: list[int]
    buffered: int
    lease: float
    most: Optional[float]
    at: float = 0.0  # when the round began (time.monotonic())
    alive: Optional[bool] = None
    input_wait: Optional[float] = None  # the worker's waiting-on-data total (seconds; None: not measured)

    def pg(self) -> tuple[str, dict[str, Any]]:
        """Postgres: the data-modifying CTEs to put before the round's ``SELECT`` (their names
        ``rw`` and ``ri``) and their parameters; the round's own ``%(w)s``, ``%(q)s`` and
        ``%(ack_ids)s`` are used too."""
        return self.renewal.carried_pg, {"rb_buffered": self.buffered, "rb_inc": self.incarnation,
                                         "rb_lease": self.lease, "rb_tokens": self.tokens,
                                         "rb_most": self.most, "rb_wait": self.input_wait}

    def run_sqlite(self, conn: Any, qid: int, worker_id: int) -> None:
        """SQLite: in the round's write transaction, after its acks (done rows are no longer
        ``claimed``: the renewal's filter leaves them)."""
        r = self.renewal._run(conn, "", qid, worker_id, self.incarnation, self.tokens, self.lease, self.most,
                              self.buffered, False, None, self.input_wait)
        self.alive = r.alive


class Renewal:
    """The renewal of one queue object's worker, built once per queue object for its dialect
    and schema; run on a driver connection (``Db.driver_round``), or carried by a claim round
    (:class:`Carry`)."""

    def __init__(self, b: Dialect, look: Poll, schema: Optional[str] = None) -> None:
        p = qualifier(schema)
        self.look = look
        self._run = self._run_sqlite if b.is_sqlite else self._run_postgres
        self._host = (f"SELECT count(*) FROM {p}wq_workers WHERE queue_id = {{m}} AND host = {{m}} "
                      "AND heartbeat_at IS NOT NULL")
        if b.is_sqlite:
            self._worker = (f"UPDATE wq_workers SET heartbeat_at = {SQLITE_NOW}, buffered = ?, "
                            "input_wait = coalesce(?, input_wait) "
                            "WHERE id = ? AND incarnation = ? RETURNING id")
            # The claimed rows' partial index leads with (queue_id, worker_id).
            self._items = (f"UPDATE wq_items SET lease_until = {SQLITE_LATER} WHERE queue_id = ? "
                           f"AND worker_id = ? AND state = '{CLAIMED}' AND token IN ({{tokens}}) "
                           f"AND (? IS NULL OR claimed_at > {SQLITE_LATER})")  # now minus max_item_seconds
            self._host = self._host.format(m="?")
            return
        # The items' update runs only when the worker's did (``w`` returned its row): a process
        # that lost its identity renews nothing. Data-modifying CTEs run to completion whether
        # or not the main query reads them.
        self._sql = (
            f"WITH w AS (UPDATE {p}wq_workers SET heartbeat_at = clock_timestamp(), buffered = %s, "
            "input_wait = coalesce(%s::float8, input_wait) WHERE id = %s AND incarnation = %s RETURNING id), "
            f"i AS (UPDATE {p}wq_items SET lease_until = clock_timestamp() + %s * interval '1 second' "
            f"WHERE queue_id = %s AND worker_id = (SELECT id FROM w) AND state = '{CLAIMED}' "
            "AND token = ANY(%s::bigint[]) "
            "AND (%s::float8 IS NULL OR claimed_at > clock_timestamp() - %s * interval '1 second') "
            "RETURNING 1) "
            "SELECT (SELECT count(*) FROM w){host}{peek}")
        self._pg_host = f", ({self._host.format(m='%s')})"
        # The same two updates with named parameters, as CTEs a claim round's statement begins
        # with (Carry.pg); the items its acks end are left to the round.
        self.carried_pg = (
            f"WITH rw AS (UPDATE {p}wq_workers SET heartbeat_at = clock_timestamp(), "
            "buffered = %(rb_buffered)s, input_wait = coalesce(%(rb_wait)s::float8, input_wait) "
            "WHERE id = %(w)s AND incarnation = %(rb_inc)s RETURNING id), "
            f"ri AS (UPDATE {p}wq_items "
            "SET lease_until = clock_timestamp() + %(rb_lease)s * interval '1 second' "
            f"WHERE queue_id = %(q)s AND worker_id = (SELECT id FROM rw) AND state = '{CLAIMED}' "
            "AND token = ANY(%(rb_tokens)s::bigint[]) AND id <> ALL(%(ack_ids)s::bigint[]) "
            "AND (%(rb_most)s::float8 IS NULL "
            "OR claimed_at > clock_timestamp() - %(rb_most)s * interval '1 second') RETURNING 1) ")

    def run(self, conn: Any, prefix: str, qid: int, worker_id: int, incarnation: str, tokens: Sequence[int],
            lease_seconds: float, max_item_seconds: Optional[float], buffered: int, *,
            poll: bool = False, host: Optional[str] = None, input_wait: Optional[float] = None) -> Renewed:
        """Renew, in the transaction open on ``conn`` (SQLite) or as one simple query that is its
        own transaction (Postgres, ``prefix`` first). ``poll``: the waiting take's poll rides
        along; ``host``: count the live workers on that host too; ``input_wait``: the worker's
        waiting-on-data total to record (None: leave the row's as it is)."""
        return self._run(conn, prefix, qid, worker_id, incarnation, tokens, float(lease_seconds),
                         None if max_item_seconds is None else float(max_item_seconds), buffered, poll, host,
                         input_wait)

    def _run_postgres(self, conn: Any, prefix: str, qid: int, worker_id: int, incarnation: str,
                      tokens: Sequence[int], lease: float, most: Optional[float], buffered: int, poll: bool,
                      host: Optional[str], input_wait: Optional[float] = None) -> Renewed:
        params: list[Any] = [buffered, input_wait, worker_id, incarnation, lease, qid, list(tokens), most,
                             most]
        if host is not None:
            params += [qid, host]
        if poll:
            params += self.look.params(qid, worker_id)
        sql = self._sql.format(host=self._pg_host if host is not None else "",
                               peek=f", p.* FROM (SELECT 1) AS one LEFT JOIN ({self.look.sql}) AS p ON true"
                               if poll else "")
        with conn.cursor() as cur:
            cur.execute(prefix + sql, params)
            row = last_rows(cur)[0]
        alive = bool(row[0])
        on_host = int(row[1]) if host is not None else None
        rest = row[2 if host is not None else 1:]
        # No queue row (deleted meanwhile): no poll to hand on; the waiting take's own finds it.
        peek = self.look.peek(rest, qid) if poll and alive and rest[0] is not None else None
        return Renewed(alive, peek, on_host)

    def _run_sqlite(self, conn: Any, prefix: str, qid: int, worker_id: int, incarnation: str,
                    tokens: Sequence[int], lease: float, most: Optional[float], buffered: int, poll: bool,
                    host: Optional[str], input_wait: Optional[float] = None) -> Renewed:
        params: tuple[Any, ...]
        cur = conn.cursor()
        sql, params = self._worker, (buffered, input_wait, worker_id, incarnation)
        try:
            if not cur.execute(sql, params).fetchall():
                return Renewed(False)
            later, since = f"+{lease!r} seconds", None if most is None else f"-{most!r} seconds"
            for k in range(0, len(tokens), _SQLITE_CHUNK):
                chunk = tokens[k:k + _SQLITE_CHUNK]
                sql = self._items.format(tokens=", ".join(["?"] * len(chunk)))
                params = (later, qid, worker_id, *chunk, since, since)
                cur.execute(sql, params)
            on_host = None
            if host is not None:
                sql, params = self._host, (qid, host)
                on_host = int(cur.execute(sql, params).fetchone()[0])
        except sqlite3.Error as e:  # as SQLAlchemy's, so Db's retry of "database is locked" applies
            raise DBAPIError.instance(sql, params, e, sqlite3.Error) from e
        finally:
            cur.close()
        try:
            peek = self.look.poll(conn, "", qid, worker_id) if poll else None
        except LookupError:  # the queue row is gone: the waiting take's own poll finds it
            peek = None
        return Renewed(True, peek, on_host)
