"""Who this worker is in the database, and keeping its leases alive.

:func:`register` takes a worker identity (taking over a dead predecessor's, with the items it
held); :class:`Heartbeat` is the thread that renews this worker's leases, returns the items of
workers that are gone (:func:`why_gone`) and of expired leases, and on SQLite checkpoints the WAL.

Who is gone (README, "When a worker dies"): a worker whose last heartbeat is
``statements.STALE_BEATS`` of its own heartbeat periods old (15 s with the defaults, a quarter
of the lease), or at once when it ran on this host and its process is dead (its pid is gone, a
zombie, or reused by another process). Processes that share a hostname must share a process
table.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
import uuid
import weakref
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from wq_sql.errors import QueueNotFound, WorkerConflict, WqSqlError
from wq_sql.store import statements
from wq_sql.store.db import Db
from wq_sql.store.hot import Carry, HotPath, Peek
from wq_sql.store.statements import Holder
from wq_sql.worker.identity import hostname, process_alive, process_start

log = logging.getLogger("wq_sql")
CHECKPOINT_SECONDS = 1.0  # SQLite: how often the heartbeat thread checkpoints the WAL
LOOKS_PER_HOST = 4  # workers of a host that look for lost items per heartbeat period, on average
# A claim round in the last CARRY_WINDOW of a heartbeat period may carry the beat's renewal
# (Heartbeat.carry): the worker row is then renewed at most (1 + CARRY_WINDOW) periods apart,
# well inside the STALE_BEATS periods after which others count it gone.
CARRY_WINDOW = 0.5


@dataclass(frozen=True)
class Member:
    """This process's hold on a worker identity: the row, and the incarnation that fences off
    any earlier process of the same identity."""

    worker_id: int
    incarnation: str


@dataclass(frozen=True)
class Terms:
    """The lease terms of one worker (see ``WorkQueue``'s keywords)."""

    lease_seconds: float
    heartbeat_seconds: float
    max_item_seconds: Optional[float]
    max_attempts: int
    run: Optional[tuple[str, int]] = None  # (job run id, restart count): see statements.supersede_run

    @property
    def dead_after(self) -> float:
        """Another process holds an identity until its heartbeat is this old."""
        return statements.STALE_BEATS * self.heartbeat_seconds


def register(db: Db, qid: int, queue: str, worker: str,
             terms: Terms) -> tuple[Member, list[statements.Claimed]]:
    """Take the identity ``worker``, waiting briefly for a dead predecessor to be recognised as
    dead; a live holder of the same identity is :class:`WorkerConflict`. Returns this process's
    membership and the items a dead predecessor held, which it takes back (an attempt each)."""
    incarnation = uuid.uuid4().hex
    host, pid, start = hostname(), os.getpid(), process_start(os.getpid())
    deadline = time.monotonic() + terms.dead_after + terms.heartbeat_seconds
    d, run = db.dialect, terms.run

    def attempt(c: Connection) -> tuple[str, Any]:
        wid = statements.insert_worker(c, d, qid, worker, incarnation, host, pid, start,
                                       terms.heartbeat_seconds, run)
        if wid is not None:
            return "ok", (wid, [], supersede(c, wid))
        row = statements.find_worker(c, qid, worker, lock=True)
        if row is None:
            raise QueueNotFound(f"queue {queue!r} was dropped while this worker joined it")
        # A process of an earlier restart of this job run is gone (the job restarted them all).
        earlier = run is not None and row.run_id == run[0] and (row.run_restart or 0) < run[1]
        if row.heartbeat_at is not None and not earlier:
            if row.host == host:
                if process_alive(row.pid, row.proc_start):
                    return "live", row
            else:
                age = statements.heartbeat_age(c, d, row.id)
                if age is not None and age < terms.dead_after:
                    return "wait", row
        statements.take_over_worker(c, d, row.id, incarnation, host, pid, start, terms.heartbeat_seconds, run)
        recovered = statements.recover(c, d, qid, row.id, terms.lease_seconds, terms.max_attempts)
        return "ok", (row.id, recovered, supersede(c, row.id))

    def supersede(c: Connection, wid: int) -> tuple[list[str], int]:
        return ([], 0) if run is None else statements.supersede_run(c, d, qid, wid, run, terms.max_attempts)

    while True:
        status, value = db.tx(attempt)
        if status == "ok":
            break
        if status == "wait" and time.monotonic() < deadline:
            time.sleep(min(0.5, terms.heartbeat_seconds))
            continue
        raise WorkerConflict(
            f"worker {worker!r} of queue {queue!r} is already held by a live process "
            f"(pid {value.pid} on {value.host}); give each process its own worker= "
            "(or $WQ_SQL_WORKER), or stop the other one first")
    worker_id, recovered, (superseded, returned) = value
    if superseded or returned:
        assert run is not None
        log.warning("queue %r: worker %r is of restart %d of job run %r: %d item(s) of its earlier "
                    "restarts' workers (%s) went back to the queue", queue, worker, run[1], run[0],
                    returned, ", ".join(map(repr, superseded)) or "closed ones")
    if recovered:
        log.warning("worker %r recovered %d item(s) its previous process held", worker, len(recovered))
    return Member(worker_id, incarnation), recovered


def return_lost(db: Db, qid: int, me: Member, max_attempts: int, queue: str,
                lineage: Optional[str] = None, keep: Collection[str] = ()) -> tuple[int, int]:
    """Return to the queue the items of workers that are gone (dead on this host, or not
    heartbeating: :mod:`wq_sql.worker.heartbeat`) and of expired leases. Returns how many, and how many
    live workers the queue has on this host (0: not known, during an outage). ``lineage``: only
    that gone identity and those named under it (``<lineage>/...``) but the identities in
    ``keep`` (whose next processes take their items back), and no expired leases."""
    d, host = db.dialect, hostname()
    # expire_tx: decided and done only while no outage could have kept the others from renewing.
    none: tuple[list[statements.Holder], int, bool] = ([], 0, False)
    holders, on_host, expired = db.expire_tx(
        lambda c: statements.holders_to_check(c, d, qid, me.worker_id, host), default=none, read=True)
    total = 0
    for h in holders:
        if lineage is not None and (h.name in keep or (h.name != lineage
                                                        and not h.name.startswith(f"{lineage}/"))):
            continue
        gone = why_gone(h, host)
        if gone is None:
            continue
        why, dead = gone
        n = db.expire_tx(functools.partial(statements.give_back_held, b=d, qid=qid, h=h,
                                           max_attempts=max_attempts,
                                           why=why, dead=dead), default=0)
        if n:
            log.warning("queue %r: %s; the %d item(s) it held went back to the queue", queue, why, n)
        total += n
    # A write transaction (on SQLite a turn of the machine's write lock) only when the read saw
    # an expired lease: most looks find none.
    expired = expired and lineage is None
    n = db.expire_tx(lambda c: statements.expire(c, d, qid, max_attempts), default=0) if expired else 0
    if n:
        log.info("queue %r: %d item(s) whose lease expired went back to the queue", queue, n)
    return total + n, on_host


def looks_this_beat(on_host: int, draw: float) -> bool:
    """Whether a heartbeat also looks for lost items (:func:`return_lost`), given how many live
    workers the queue had on this host at the last look (or the first beat's count) and a uniform
    draw in [0, 1). Each look
    reads the queue's worker rows and scans its claimed items, so if every worker looked at every
    beat, N workers would cost N x N row reads per heartbeat period; instead about
    ``LOOKS_PER_HOST`` workers of each host look per period, chosen at random each beat, so a
    dead process's items still come back within about one period (its host's lookers see its pid
    gone) and a stale worker's or an expired lease's too (any host's lookers see them)."""
    return on_host <= LOOKS_PER_HOST or draw * on_host < LOOKS_PER_HOST


# What the heartbeat asks its owner each beat: the lease tokens of every item it holds and how
# many of them are buffered (not yet handed out), or None when it is closing. The argument is
# the heartbeat's stop event: the owner stops waiting for its lock once it is set.
Holding = Callable[[threading.Event], Optional[tuple[set[int], int]]]


class Heartbeat:
    """Renews this worker's leases every ``heartbeat_seconds`` and returns lost items
    (:func:`return_lost`); on SQLite also checkpoints the WAL every ``CHECKPOINT_SECONDS``.
    ``superseded()`` is called once another process took this identity over; ``returned()``
    whenever items went back to the queue; ``idle(heartbeat_seconds)`` after each renewal (the
    owner gives back items claimed ahead that its consumer stopped asking for); ``ride()``
    before each renewal: None, or a function that takes the poll (``poll.Peek``) that rode on
    the renewal instead of taking a transaction of its own (a waiting take's poll:
    ``Dispenser.ride_beat``), called once the renewal committed. The renewal is one statement
    (``HotPath.renew``). The thread holds this object weakly: when its owner is collected,
    the thread ends."""

    def __init__(self, db: Db, hot: HotPath, me: Member, terms: Terms, queue: str, *, holding: Holding,
                 superseded: Callable[[], None], returned: Callable[[], None],
                 idle: Callable[[float], object] = lambda beat: None,
                 ride: Callable[[], Optional[Callable[[Peek], None]]] = lambda: None) -> None:
        self.db, self.hot, self.qid, self.me, self.terms, self.queue = db, hot, hot.qid, me, terms, queue
        self._holding, self._superseded, self._returned = holding, superseded, returned
        self._idle, self._ride = idle, ride
        # Live workers of the queue on this host, as of the last look; None until the first
        # beat counts them (see beat()).
        self.on_host: Optional[int] = None
        self.due: Optional[float] = None  # when the next beat is due (monotonic), once known
        self._carried: Optional[Carry] = None  # the last renewal a claim round carried (carry())
        self.stop_event = threading.Event()
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self), self.stop_event),
                                        name=f"wq_sql-heartbeat-{queue}", daemon=True)
        self._thread.start()

    def next_due(self) -> Optional[float]:
        """When the next beat is due (``time.monotonic()``), or None if not known yet or stopping."""
        return None if self.stop_event.is_set() else self.due

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_event.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)

    def carry(self, gap: Optional[float], held: Callable[[], tuple[set[int], int]]) -> Optional[Carry]:
        """For a claim round about to start: the renewal it should carry, or None. It carries
        it when the next beat is due within the period's last ``CARRY_WINDOW`` and the worker's
        next round is not expected before then (``gap``: its rounds' usual spacing, seconds;
        None: not known yet); the beat then renews nothing itself (one transaction less per
        period for a worker that claims about as often as it beats, which would otherwise send
        as many renewals as claims). Never the first beat (it counts the host's workers).
        ``held()``: the tokens held and how many are buffered, read only when the round
        carries."""
        due, t = self.due, self.terms
        if due is None or gap is None or self.on_host is None or self.stop_event.is_set():
            return None
        now = time.monotonic()
        if not (due - t.heartbeat_seconds * CARRY_WINDOW <= now < due <= now + gap):
            return None
        tokens, buffered = held()
        c = self.hot.carry(self.me.incarnation, sorted(tokens), buffered, t.lease_seconds, t.max_item_seconds,
                           at=now)
        self._carried = c
        return c

    def beat(self, due: Optional[float] = None) -> None:
        """One beat (the one due at ``due``, monotonic): renew, unless a claim round carried
        the renewal in that beat's window (:meth:`carry`), then maybe look for lost items."""
        held = self._holding(self.stop_event)
        if held is None:
            return
        tokens, buffered = held
        t, me = self.terms, self.me
        c = self._carried
        if due is not None and c is not None and c.alive and c.at >= due - t.heartbeat_seconds * CARRY_WINDOW:
            self._after_renewal(buffered)
            return
        polled = self._ride()
        # The first beat counts this host's workers instead of looking at once: workers that
        # start together beat together, and N first looks at the same moment read N x N worker
        # rows and check every pid of the host in each, all at once, while those workers' takes
        # wait for the database.
        host = hostname() if self.on_host is None else None
        r = self.hot.renew(me.worker_id, me.incarnation, sorted(tokens), t.lease_seconds, t.max_item_seconds,
                           buffered, poll=polled is not None, host=host)
        if not r.alive:
            self._superseded()
            return
        if polled is not None and r.peek is not None:
            polled(r.peek)
        self.on_host = r.on_host or self.on_host
        self._after_renewal(buffered)

    def _after_renewal(self, buffered: int) -> None:
        """A beat's work after the renewal: items claimed ahead that nobody asks for go back,
        and this beat may look for lost items."""
        t = self.terms
        if buffered:
            self._idle(t.heartbeat_seconds)
        if self.db.may_expire and looks_this_beat(self.on_host or 1, random.random()):
            n, on_host = return_lost(self.db, self.qid, self.me, t.max_attempts, self.queue)
            self.on_host = on_host or self.on_host
            if n:
                self._returned()


def _loop(ref: weakref.ref[Heartbeat], stop: threading.Event) -> None:
    next_beat = 0.0
    while True:
        hb = ref()
        if hb is None:
            return
        now = time.monotonic()
        if not next_beat:
            next_beat = hb.due = now + hb.terms.heartbeat_seconds
        wal = hb.db.dialect.wal_checkpoint is not None
        del hb
        if stop.wait(max(0.0, min(next_beat - now, CHECKPOINT_SECONDS) if wal else next_beat - now)):
            return
        hb = ref()
        if hb is None:
            return
        try:
            if wal:
                hb.db.checkpoint_wal()
            if time.monotonic() >= next_beat:
                served, next_beat = next_beat, time.monotonic() + hb.terms.heartbeat_seconds
                hb.due = next_beat
                hb.beat(served)
        except (DBAPIError, WqSqlError) as e:  # the next beat tries again; leases outlast several
            log.warning("heartbeat of queue %r failed: %s", hb.queue, e)
        del hb


def why_gone(holder: Holder, host: str) -> Optional[tuple[str, bool]]:
    """Why ``holder`` is gone, for the log and the ``expire`` event, and whether it is known
    dead (else only its heartbeat is stale); None while it may be alive."""
    if holder.host == host and not process_alive(holder.pid, holder.proc_start):
        return f"worker {holder.name!r} died (its process {holder.pid} on {holder.host} is gone)", True
    if holder.stale:
        return (f"worker {holder.name!r} stopped heartbeating (last heartbeat {holder.age:.1f} s ago, "
                f"pid {holder.pid} on {holder.host})"), False
    return None
