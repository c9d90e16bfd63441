"""What a worker reads when its claim round found nothing: one read-only statement, as
driver-level SQL.

A take that found nothing claimable reads the queue's counters, epochs and expired leases once
(:meth:`Poll.read`) and then, while it waits, polls the same statement
(:meth:`Poll.poll`). Both come at the end of every drain, from every worker at once, so they
are the end's critical path and, with thousands of waiting workers, the database's load.
Through SQLAlchemy the statement cost its connection and execution machinery's CPU per call,
and a compile on first use in a process, which is at the end of the drain for the worker that
never waited; as one driver-level text it is a round trip (one simple query in autocommit
mode on Postgres, ``engine.driver_read``). The states are literals, so SQLite's planner can use
the partial indexes (it cannot with a bound parameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from wq_sql.states import CLAIMED, PENDING
from wq_sql.store.dialects import PG_LAZY_COMMIT, SQLITE_NOW, Dialect, qualifier
from wq_sql.store.driver import last_rows


@dataclass(frozen=True)
class Peek:
    """One poll of a waiting worker: whether an item is pending, whether a lease has expired, how
    many items are finished (done, failed or quarantined), failed and quarantined, how many
    epochs have rows and how many the queue has, how many items this worker holds."""

    pending: bool
    expired: bool
    finished: int
    epochs_created: int
    mine: int
    failed: int = 0
    num_epochs: int = 0
    quarantined: int = 0

    @property
    def done(self) -> int:
        return self.finished - self.failed - self.quarantined


class Poll:
    """The statement, built once per queue object for its dialect and schema (as
    ``claim.ClaimRound``); run on a driver connection (``Db.driver_read``)."""

    def __init__(self, b: Dialect, schema: Optional[str] = None) -> None:
        p = qualifier(schema)
        now, mark = (SQLITE_NOW, "?") if b.is_sqlite else ("clock_timestamp()", "%s")
        # Index probes only: pending and claimed rows have partial indexes; the tallies are a
        # row per (epoch, worker). Parameters, in order: the queue id three times, the worker
        # id, the queue id twice. Named columns: the heartbeat's renewal reads the statement as
        # a derived table (renew.Renewal).
        # Once the tallies count every item of every epoch finished, nothing is pending or
        # claimed, and the three probes are skipped (CASE evaluates a subquery only when its
        # branch is taken). That is the read that learns the end, right after the last
        # acknowledgements: the partial indexes then hold an entry per item whose row version
        # is dead, each checked against the table until VACUUM, and the probes would visit
        # every one of them.
        # (The product in numeric on Postgres, real on SQLite: num_epochs may be up to 2**62.)
        fin = "t.finished >= q.num_epochs * (q.n_works + 0.0)"
        no = "0" if b.is_sqlite else "false"
        self.sql = (
            f"SELECT CASE WHEN {fin} THEN {no} ELSE EXISTS (SELECT 1 FROM {p}wq_items "
            f"WHERE queue_id = {mark} AND state = '{PENDING}') END AS pending, "
            f"CASE WHEN {fin} THEN {no} ELSE EXISTS (SELECT 1 FROM {p}wq_items "
            f"WHERE queue_id = {mark} AND state = '{CLAIMED}' AND lease_until < {now}) END AS expired, "
            f"CASE WHEN {fin} THEN 0 ELSE (SELECT count(*) FROM {p}wq_items WHERE queue_id = {mark} "
            f"AND worker_id = {mark} AND state = '{CLAIMED}') END AS mine, "
            "t.finished, t.failed, q.epochs_created, q.num_epochs, t.quarantined "
            f"FROM {p}wq_queues q CROSS JOIN (SELECT coalesce(sum(n_done + n_failed + n_quarantined), 0) "
            "AS finished, coalesce(sum(n_failed), 0) AS failed, "
            "coalesce(sum(n_quarantined), 0) AS quarantined "
            f"FROM {p}wq_tallies WHERE queue_id = {mark}) t "
            f"WHERE q.id = {mark}")
        # The read that rings the end (read_ringing), Postgres only. The state as text in the
        # order of Peek's news: "end finished failed num_epochs quarantined" (dispenser.END).
        self._ringing = (
            "SELECT l.pending, l.expired, l.mine, l.finished, l.failed, l.epochs_created, l.num_epochs, "
            "l.quarantined, "
            "CASE WHEN l.finished >= %s AND l.num_epochs = %s THEN pg_notify(%s, %s::text || 'end ' || "
            "l.finished || ' ' || l.failed || ' ' || l.num_epochs || ' ' || l.quarantined) END "
            f"FROM ({self.sql}) l")

    def read_ringing(self, conn: Any, prefix: str, qid: int, worker_id: int, total: int, num_epochs: int,
                     channel: str, head: str) -> Peek:
        """Postgres: :meth:`read`, and if it finds the queue finished (``total`` items of
        ``num_epochs`` epochs), the ring of its end in the same statement: ``pg_notify`` on
        ``channel`` with ``head`` and the counts (``dispenser.END``'s news; ``notify.notify_args``).
        At the end of a drain the last worker's read and ring were two round trips in a row,
        the ring another connection checkout and commit, on every waiting worker's path."""
        cur = conn.cursor()
        try:
            params = [total, num_epochs, channel, head, *self.params(qid, worker_id)]
            cur.execute(prefix + PG_LAZY_COMMIT + self._ringing, params)
            rows = last_rows(cur)
        finally:
            cur.close()
        return self.peek(rows[0][:8] if rows else None, qid)

    def poll(self, conn: Any, prefix: str, qid: int, worker_id: int) -> Peek:
        """What a waiting take polls."""
        return self._run(conn, prefix, qid, worker_id)

    def read(self, conn: Any, prefix: str, qid: int, worker_id: int) -> Peek:
        """What ``take()`` reads when its claim round found nothing (the end, more epochs,
        expired leases), before it waits, and after acknowledgements that may have been the
        last ones. The poll's statement, under its own name so that a test can hold the polls
        of a waiting take without holding this read."""
        return self._run(conn, prefix, qid, worker_id)

    @staticmethod
    def params(qid: int, worker_id: int) -> list[int]:
        """The statement's parameters, in order."""
        return [qid, qid, qid, worker_id, qid, qid]

    @staticmethod
    def peek(row: Optional[Sequence[Any]], qid: int) -> Peek:
        """The statement's row as a :class:`Peek` (None or NULLs: the queue row is gone)."""
        if row is None or row[0] is None:
            raise LookupError(f"queue id {qid} is gone (deleted while this worker waited)")
        pending, expired, mine, finished, failed, created, num_epochs, quarantined = row
        return Peek(bool(pending), bool(expired), int(finished), int(created), int(mine), int(failed),
                    int(num_epochs), int(quarantined))

    def _run(self, conn: Any, prefix: str, qid: int, worker_id: int) -> Peek:
        cur = conn.cursor()
        try:
            cur.execute(prefix + self.sql, self.params(qid, worker_id))
            rows = last_rows(cur)  # psycopg 3 keeps the prefix's result first
        finally:
            cur.close()
        return self.peek(rows[0] if rows else None, qid)
