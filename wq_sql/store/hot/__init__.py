"""The hot path's driver-level texts, both dialects side by side, and :class:`HotPath`, the one
port through which a worker's runtime makes those round trips: the claim round (``claim``;
Postgres' live function is ``claim_round.sql``), a waiting take's poll (``poll``), the
heartbeat's renewal (``renew``) and a clean close's give-back (``leave``). The runtime
(``wq_sql.worker``) calls :class:`HotPath` methods and never holds a connection; how each round
trip runs (one simple query on Postgres, a write transaction on SQLite's hot connection) is the
store's."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Optional

from wq_sql.store.db import Db
from wq_sql.store.hot.claim import ClaimRound
from wq_sql.store.hot.leave import Leaving
from wq_sql.store.hot.poll import Peek, Poll
from wq_sql.store.hot.renew import Carry, Renewal, Renewed
from wq_sql.store.lineage import Steps, StepWriter
from wq_sql.store.statements import Claimed

__all__ = ["HotPath", "Carry", "Peek", "Renewed", "Keys"]

Keys = Sequence[tuple[int, int]]  # (item id, lease token) pairs


class HotPath:
    """Every driver-level round trip of one queue object (queue id ``qid``) on ``db``. Built
    once per queue object; its texts are made once for the dialect and ``schema``.
    ``round_size``: the most a round may claim (its SQLite text is sized for it)."""

    def __init__(self, db: Db, qid: int, round_size: int, lease_seconds: float,
                 schema: Optional[str] = None) -> None:
        self.db, self.qid = db, qid
        b = db.dialect
        self._claim = ClaimRound(b, round_size, lease_seconds, schema)
        self._poll = Poll(b, schema)
        self._renewal = Renewal(b, self._poll, schema)
        self._leaving = Leaving(b, schema)
        self._steps = StepWriter(b, schema)
        # What this worker reports with each renewal and at its leave: the seconds its process's
        # training loop waited for data, summed (None: not measured; see add_input_wait).
        self.input_wait: Optional[float] = None
        self._wait_lock = threading.Lock()
        # Lineage rows that ride on this worker's next write of the hot path (a claim round,
        # acknowledgements, the leave): see queue_steps.
        self._queued: list[Steps] = []

    def queue_steps(self, steps: Steps) -> None:
        """Lineage rows to write in this worker's next claim round, acknowledgement or leave,
        in its transaction (no round trip of their own). From any thread."""
        if not steps.rows:
            return
        with self._wait_lock:
            last = self._queued[-1] if self._queued else None
            if last is not None and (last.worker, last.run) == (steps.worker, steps.run):
                self._queued[-1] = Steps(last.worker, last.run, [*last.rows, *steps.rows])
            else:
                self._queued.append(steps)

    @property
    def steps_queued(self) -> int:
        """Lineage rows waiting for the next write (:meth:`queue_steps`)."""
        with self._wait_lock:
            return sum(len(s.rows) for s in self._queued)

    def _take_queued(self, extra: Optional[Steps] = None) -> list[Steps]:
        with self._wait_lock:
            queued, self._queued = self._queued, []
        return queued + ([extra] if extra is not None and extra.rows else [])

    def _requeue(self, queued: list[Steps]) -> None:
        """A write that carried ``queued`` failed: they ride on the next one."""
        with self._wait_lock:
            self._queued = queued + self._queued

    def add_input_wait(self, seconds: float) -> None:
        """Add to the waiting-on-data total the next renewal records (from any thread)."""
        with self._wait_lock:
            self.input_wait = (self.input_wait or 0.0) + max(0.0, float(seconds))

    def round(self, worker_id: int, acks: Keys, limit: int,
              carry: Optional[Carry] = None) -> tuple[set[int], list[Claimed]]:
        """One claim round: acknowledge ``acks`` (fenced by their tokens) and claim up to
        ``limit`` items (0: none), with ``carry``'s renewal in the same transaction. Returns the
        ids of the acks accepted and the items claimed, in hand-out order, each with its work."""
        qid, claim, writer = self.qid, self._claim, self._steps
        queued = self._take_queued()
        if not queued:
            return self.db.driver_round(
                lambda conn, prefix: claim.run(conn, qid, worker_id, acks, limit, prefix, carry))
        one_query = self.db.dialect.one_query_rounds

        def with_steps(conn: object, prefix: str) -> tuple[set[int], list[Claimed]]:
            if one_query:  # Postgres: the inserts go first in the round's one query
                prefix += "".join(writer.text(conn, qid, s) for s in queued)
            else:
                for s in queued:
                    writer.write(conn, qid, s)
            return claim.run(conn, qid, worker_id, acks, limit, prefix, carry)
        try:
            return self.db.driver_round(with_steps)
        except BaseException:
            self._requeue(queued)
            raise

    @property
    def revoked(self) -> Optional[int]:
        """The queue's ``revoked`` counter as the last claiming round read it (None: none yet)."""
        return self._claim.revoked

    def acknowledge(self, by_holder: Sequence[tuple[int, Keys]], steps: Optional[Steps] = None) -> set[int]:
        """Acknowledge items in the names of the workers that hold them (``(holder worker id,
        keys)`` pairs), in one write transaction, claiming nothing: the round's statement, several
        times cheaper per item than ``statements.complete``; ``steps``: lineage rows written in
        the same transaction. Returns the ids accepted."""
        qid, claim, writer = self.qid, self._claim, self._steps
        queued = self._take_queued(steps)

        def done(conn: object) -> set[int]:
            accepted: set[int] = set()
            for holder, keys in by_holder:
                accepted |= claim.run(conn, qid, holder, keys, 0)[0]
            for s in queued:
                writer.write(conn, qid, s)
            return accepted
        try:
            return self.db.driver_tx(done)
        except BaseException:
            self._requeue([s for s in queued if s is not steps])
            raise

    def write_steps(self, conn: object, steps: Steps) -> None:
        """Lineage rows, in the transaction open on ``conn`` (a DBAPI connection)."""
        self._steps.write(conn, self.qid, steps)

    def poll(self, worker_id: int) -> Peek:
        """What a waiting take polls: one read-only statement."""
        look, qid = self._poll, self.qid
        return self.db.driver_read(lambda conn, prefix: look.poll(conn, prefix, qid, worker_id))

    def read(self, worker_id: int) -> Peek:
        """What a take reads when its claim round found nothing, or after acknowledgements that
        may have been the queue's last (the poll's statement, under its own name)."""
        look, qid = self._poll, self.qid
        return self.db.driver_read(lambda conn, prefix: look.read(conn, prefix, qid, worker_id))

    def read_ringing(self, worker_id: int, total: int, num_epochs: int, channel: str, head: str) -> Peek:
        """Postgres: :meth:`read`, and the ring of the queue's end in the same statement if it
        finds the queue finished (``Poll.read_ringing``)."""
        look, qid = self._poll, self.qid
        return self.db.driver_read(lambda conn, prefix: look.read_ringing(
            conn, prefix, qid, worker_id, total, num_epochs, channel, head))

    def renew(self, worker_id: int, incarnation: str, tokens: Sequence[int], lease_seconds: float,
              max_item_seconds: Optional[float], buffered: int, *, poll: bool = False,
              host: Optional[str] = None) -> Renewed:
        """The heartbeat's renewal, one statement (``Renewal.run``)."""
        renewal, qid = self._renewal, self.qid
        return self.db.driver_round(lambda conn, prefix: renewal.run(
            conn, prefix, qid, worker_id, incarnation, tokens, lease_seconds, max_item_seconds, buffered,
            poll=poll, host=host, input_wait=self.input_wait))

    def carry(self, incarnation: str, tokens: list[int], buffered: int, lease_seconds: float,
              max_item_seconds: Optional[float], at: float) -> Carry:
        """A renewal for the next claim round to carry (:meth:`round`'s ``carry``)."""
        return Carry(self._renewal, incarnation, tokens, buffered, lease_seconds, max_item_seconds, at=at,
                     input_wait=self.input_wait)

    def leave(self, worker_id: int, incarnation: str, acks: Keys, give_back: Keys) -> set[int]:
        """A clean close: acknowledge ``acks``, give back ``give_back`` (no attempt counted)
        and mark the worker closed, in one write transaction. Returns the ids of acks accepted."""
        qid, claim, leaving, wait, writer = self.qid, self._claim, self._leaving, self.input_wait, self._steps
        queued = self._take_queued()

        def leave(conn: object) -> set[int]:
            accepted = claim.run(conn, qid, worker_id, acks, 0)[0] if acks else set()
            for s in queued:
                writer.write(conn, qid, s)
            leaving.run(conn, qid, worker_id, incarnation, give_back, input_wait=wait)
            return accepted
        try:
            return self.db.driver_tx(leave)
        except BaseException:
            self._requeue(queued)
            raise

    def leave_lazily(self, worker_id: int, incarnation: str, give_back: Keys) -> None:
        """A clean close that acknowledges nothing: one statement that commits without waiting
        for the WAL flush (Postgres; see ``Outcomes.leave`` for why losing it is harmless)."""
        if self.steps_queued:  # lineage rows must be durable: the leave that writes them
            self.leave(worker_id, incarnation, [], give_back)
            return
        qid, leaving, wait = self.qid, self._leaving, self.input_wait
        self.db.driver_round(lambda conn, prefix: leaving.run(conn, qid, worker_id, incarnation, give_back,
                                                              prefix, lazy=True, input_wait=wait))

    def warm(self) -> None:
        """Postgres: plan the claim round's statements on a server connection now, not in the
        first take (``ClaimRound.warm``). SQLite: nothing."""
        if self.db.dialect.one_query_rounds:
            self.db.driver_round(self._claim.warm)
