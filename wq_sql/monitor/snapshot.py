"""The read model behind ``wq-sql metrics`` and ``wq-sql dashboard``: what a running job looks
like, read from the database in one snapshot, cheap on a queue of a million items.

Nothing here writes. Every figure comes from small reads (docs/watch.md has the costs):

* items per epoch and state: ``done``/``failed`` from the ``wq_tallies`` counters, ``claimed`` from
  the partial index of claimed rows (``report.status``), ``pending`` the rest of the epoch's rows
  (``n_works``, or ``max(seq) + 1`` for the epoch being made: one index descent);
* per worker: the ``wq_workers`` rows, the counters, the claimed rows, and the items done in the
  last ``window`` seconds (``report.recent_done``: the newest ``done`` rows by primary key);
* deliveries, re-deliveries and failures: :class:`HistoryCounts`, which reads each ``wq_events``
  row that ends a delivery once (by primary key range) and keeps the sums, plus the deliveries
  in flight. It never reads ``claim`` rows, so it counts the same whether the history stores a
  row per claim or one per delivery;
* the recent failures and the timeline of the last minutes: the ``wq_history`` view, windowed by
  time (the dashboard only; a scan of the history, so the dashboard reads it less often).

A *straggler* (documented in the README): a live worker, started at least ``window`` seconds
ago, whose items done per second over the last ``window`` seconds is below
``STRAGGLER_FRACTION`` of the median of those workers' rates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

from sqlalchemy import Connection, Engine, bindparam, case, func, select, text

from wq_sql.monitor import report
from wq_sql.states import (
    CLAIMED,
    EV_DONE,
    EV_EXPIRE,
    EV_FAIL,
    EV_RECOVER,
    EV_RELEASE,
    EV_REQUEUE,
    PENDING,
)
from wq_sql.store import statements
from wq_sql.store.dialects import Dialect, dialect_of
from wq_sql.store.models import EVENTS_VIEW, UTCDateTime

T = TypeVar("T")

STRAGGLER_FRACTION = 0.5
WINDOW_SECONDS = report.RATE_WINDOW_SECONDS
# History rows of these kinds end exactly one delivery each (a recover ends the crashed
# process's delivery and starts the restarted one's, which is in flight or ends later).
ENDING_KINDS = (EV_DONE, EV_RELEASE, EV_FAIL, EV_EXPIRE, EV_RECOVER)
LEASE_EXPIRED = "lease expired"  # the detail of an expire row whose lease ran out (statements.expire)
# The dashboard's history of the last minutes: the items among this many newest history rows
# (the timeline picture draws up to about this many deliveries).
HISTORY_SPAN = 2_000
# HistoryCounts: a snapshot's ids are taken as settled after this long, whatever runs elsewhere.
SETTLE_SECONDS = 120.0
# Failure kinds: why a delivery ended with an attempt counted.
FAILURE_KINDS = ("error", "lease_expired", "worker_gone", "worker_restarted")


@dataclass(frozen=True)
class EpochView:
    epoch: int
    pending: int
    claimed: int
    done: int
    failed: int
    quarantined: int = 0  # held back (wq-sql quarantine): counted as finished

    @property
    def total(self) -> int:
        return self.pending + self.claimed + self.done + self.failed + self.quarantined


@dataclass(frozen=True)
class WorkerView:
    name: str
    host: str
    pid: int
    live: bool                 # has not closed
    stale: bool                # live, but missed statements.STALE_BEATS heartbeats
    heartbeat_age: Optional[float]  # seconds since the last heartbeat (None: closed)
    done: int
    failed: int
    held: int                  # items claimed now
    recent: int                # items done in the window
    rate: Optional[float]      # items done per second over the window (None: too young to judge)
    straggler: bool
    # Seconds its training loop waited for data, summed, as of its last heartbeat or its close
    # (None: not measured), and its time from start to last heartbeat (None: closed).
    input_wait: Optional[float] = None
    running: Optional[float] = None

    @property
    def input_wait_share(self) -> Optional[float]:
        """The share of its running time its training loop waited for data (None: not
        measured, or closed)."""
        if self.input_wait is None or not self.running:
            return None
        return min(self.input_wait / self.running, 1.0)


@dataclass(frozen=True)
class QueueView:
    name: str
    n_works: int
    num_epochs: int
    epochs_created: int
    epochs: list[EpochView]
    workers: list[WorkerView]
    recent: int                # items done in the window
    rate: Optional[float]      # items done per second over the window
    oldest_delivery_age: Optional[float]  # seconds, of the oldest item claimed now
    median_rate: Optional[float]
    history: dict[int, Counter[str]] = field(default_factory=dict)  # epoch -> counts (HistoryCounts.keys)
    oldest_pending_age: Optional[float] = None  # seconds since the oldest pending item was made claimable

    @property
    def total(self) -> int:
        return self.n_works * self.num_epochs

    @property
    def finished(self) -> int:
        return sum(e.done + e.failed + e.quarantined for e in self.epochs)

    @property
    def eta_seconds(self) -> Optional[float]:
        left = self.total - self.finished
        if left <= 0:
            return 0.0
        return left / self.rate if self.rate else None


def snapshot(engine: Engine, fn: Callable[[Connection], T]) -> T:
    """Run ``fn`` in one read-only transaction that sees one snapshot (Postgres: REPEATABLE READ;
    SQLite: a read transaction in WAL mode is a snapshot already)."""
    opts: dict[str, Any] = {"wq_read": True, **dialect_of(engine).snapshot_options}
    with engine.connect().execution_options(**opts) as conn, conn.begin():
        return fn(conn)


def _seconds(a: dt.datetime, b: dt.datetime) -> float:
    return (a - b).total_seconds()


def epochs_of(conn: Connection, q: Any, st: report.Status) -> list[EpochView]:
    """Every epoch that has rows: ``pending`` is the rows made minus the rest (no scan of the
    pending rows)."""
    made = q.epochs_created
    out = []
    upto = made + (1 if made < q.num_epochs else 0)  # the epoch being made, if any rows exist
    for e in range(upto):
        rows = q.n_works if e < made else statements.rows_made(conn, q.id, e)
        if e >= made and rows == 0:
            break
        d, f = st.per_epoch.get(e, (0, 0))
        c = st.claimed.get(e, 0)
        k = st.quarantined.get(e, 0)
        out.append(EpochView(e, max(rows - d - f - c - k, 0), c, d, f, k))
    return out


def read_queue(conn: Connection, d: Dialect, q: Any, *, window: float = WINDOW_SECONDS,
               history: Optional[dict[int, Counter[str]]] = None) -> QueueView:
    """One queue (a ``wq_queues`` row), in the caller's snapshot."""
    st = report.status(conn, d, q.id, window)
    recent = st.recent
    workers: list[WorkerView] = []
    judged: list[float] = []
    for r in st.workers:
        live = r.heartbeat_at is not None
        age = _seconds(st.now, r.heartbeat_at) if live else None
        stale = bool(live and r.beat_seconds is not None and age is not None
                     and age > statements.STALE_BEATS * r.beat_seconds)
        k = recent.by_worker.get(r.id, 0)
        old_enough = _seconds(st.now, r.started_at) >= window
        rate = k / recent.seconds if live and old_enough else None
        if rate is not None:
            judged.append(rate)
        done, failed = st.by_worker.get(r.id, (0, 0))
        waited = None if r.input_wait is None else float(r.input_wait)
        running = max(_seconds(r.heartbeat_at, r.started_at), 0.0) if live else None
        workers.append(WorkerView(r.name, r.host, r.pid, live, stale, age, done, failed,
                                  st.holding.get(r.id, 0), k, rate, False, waited, running))
    median = statistics.median(judged) if judged else None
    if median:
        workers = [w if w.rate is None or w.rate >= STRAGGLER_FRACTION * median
                   else dataclasses.replace(w, straggler=True) for w in workers]
    oldest = conn.execute(select(func.min(statements.items.c.claimed_at)).where(
        statements.items.c.queue_id == q.id, statements.items.c.state == CLAIMED)).scalar_one_or_none()
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=dt.timezone.utc)
    oldest_age = max(_seconds(st.now, oldest), 0.0) if oldest is not None else None
    rate = recent.rate or 0.0
    return QueueView(q.name, q.n_works, q.num_epochs, q.epochs_created, epochs_of(conn, q, st), workers,
                     recent.done, rate, oldest_age, median, history or {},
                     oldest_pending_age(conn, q, st.now))


def oldest_pending_age(conn: Connection, q: Any, now: dt.datetime) -> Optional[float]:
    """Seconds since the oldest pending item of queue ``q`` (a ``wq_queues`` row) was made
    claimable (None: none pending). Rows are made in claim order and a requeue keeps the time,
    so it is the first pending row's in that order: one descent of the pending index."""
    i = statements.items
    row = conn.execute(select(i.c.pending_since)
                       .where(i.c.queue_id == q.id, text(f"wq_items.state = '{PENDING}'"))
                       .order_by(i.c.epoch, i.c.seq).limit(1)).first()
    if row is None:
        return None
    since = row[0] if row[0] is not None else q.created_at  # rows made before revision 0015
    if since is None:
        return None
    if since.tzinfo is None:
        since = since.replace(tzinfo=dt.timezone.utc)
    return max(_seconds(now, since), 0.0)


def by_rate(workers: list[WorkerView]) -> list[WorkerView]:
    """Live workers first, fastest first; the unjudged (too young) after the judged."""
    return sorted(workers, key=lambda w: (not w.live, w.rate is None, -(w.rate or 0.0), w.name))


def waiting_on_data(workers: list[WorkerView]) -> tuple[Optional[float], list[WorkerView]]:
    """The live measured workers' waiting on data: their waits over their running times, summed
    (None: no live worker measures it), and those workers, the most waiting first."""
    measured = [w for w in workers if w.input_wait_share is not None]
    if not measured:
        return None, []
    waited = sum(w.input_wait or 0.0 for w in measured)
    ran = sum(w.running or 0.0 for w in measured)
    return min(waited / ran, 1.0), sorted(measured, key=lambda w: (-(w.input_wait_share or 0.0), w.name))


def stragglers(workers: list[WorkerView], k: Optional[int] = None) -> list[WorkerView]:
    """The stragglers, slowest first, at most ``k``."""
    out = sorted((w for w in workers if w.straggler), key=lambda w: (w.rate or 0.0, w.name))
    return out if k is None else out[:k]


# ---------------------------------------------------------------- the history, counted once


class HistoryCounts:
    """Sums over the ``wq_events`` rows that end a delivery, per ``(queue id, epoch)``, kept
    across calls so that each call reads only the rows added since (a primary key range).

    Keys of each counter: the ending kinds (``done``, ``release``, ``fail``, ``expire``,
    ``recover``) and the failure kinds (:data:`FAILURE_KINDS`).

    Ids are taken when a row is inserted, not when it commits: on Postgres a transaction with a
    lower id can commit after rows with higher ids were read. So the sums are kept *settled*
    only up to the highest id that no transaction in flight can still add below
    (``Dialect.commit_horizon``: on SQLite every id seen; on Postgres the highest id an earlier
    snapshot saw, once every transaction in flight then has ended); rows above are summed afresh
    at each call, usually the rows of the last scrape or two. A transaction elsewhere on the
    server that runs long holds ``xmin`` back: marks older than ``settle_seconds`` settle anyway
    (wq_sql's own transactions end within their 60 s ``statement_timeout``), so the rows summed
    afresh stay those of the last two minutes at most. The first call reads the whole history
    once."""

    def __init__(self, *, settle_seconds: float = SETTLE_SECONDS) -> None:
        self.settle_seconds = settle_seconds
        self.settled: dict[tuple[int, int], Counter[str]] = {}
        self.upto = 0
        # (when, xmax of a snapshot, the top id it saw)
        self._marks: deque[tuple[float, int, int]] = deque()

    def read(self, conn: Connection) -> dict[tuple[int, int], Counter[str]]:
        """The sums, as of the caller's snapshot (run it in one: :func:`snapshot`)."""
        e = statements.events
        top = int(conn.execute(select(func.coalesce(func.max(e.c.id), 0))).scalar_one())
        horizon = dialect_of(conn).commit_horizon(conn)
        if horizon is None:
            settle_to: Optional[int] = top
        else:
            xmin, xmax = horizon
            now = time.monotonic()
            settle_to = None
            while self._marks and (self._marks[0][1] <= xmin
                                   or self._marks[0][0] <= now - self.settle_seconds):
                settle_to = self._marks.popleft()[2]
            if not self._marks or self._marks[-1][2] < top:
                self._marks.append((now, xmax, top))
        if settle_to is not None and settle_to > self.upto:
            _add(self.settled, self._sum(conn, self.upto, settle_to))
            self.upto = settle_to
        out = {k: Counter(v) for k, v in self.settled.items()}
        if top > self.upto:
            _add(out, self._sum(conn, self.upto, top))
        return out

    @staticmethod
    def _sum(conn: Connection, after: int, upto: int) -> dict[tuple[int, int], Counter[str]]:
        """The ending rows with ``after < id <= upto``: both ends given, or SQLite's planner
        scans the (queue_id, item_id) index, the whole history, to group by queue."""
        e = statements.events
        lease = case((e.c.detail == LEASE_EXPIRED, 1), else_=0).label("lease")
        # An operator's requeue of a claimed item ends its delivery too (its row has claimed_at);
        # a requeue of a done or failed item ends none.
        where = [e.c.id > after, e.c.id <= upto,
                 e.c.kind.in_(ENDING_KINDS) | ((e.c.kind == EV_REQUEUE) & e.c.claimed_at.is_not(None))]
        out: dict[tuple[int, int], Counter[str]] = {}
        for r in conn.execute(select(e.c.queue_id, e.c.epoch, e.c.kind, lease, func.count().label("n"))
                              .where(*where).group_by(e.c.queue_id, e.c.epoch, e.c.kind, lease)):
            c = out.setdefault((r.queue_id, r.epoch), Counter())
            c[r.kind] += int(r.n)
            why = {EV_FAIL: "error", EV_RECOVER: "worker_restarted",
                   EV_EXPIRE: "lease_expired" if r.lease else "worker_gone"}.get(r.kind)
            if why is not None:
                c[why] += int(r.n)
        return out


def _add(into: dict[tuple[int, int], Counter[str]], more: dict[tuple[int, int], Counter[str]]) -> None:
    for k, v in more.items():
        into.setdefault(k, Counter()).update(v)


def deliveries(counts: Counter[str], claimed: int) -> int:
    """Deliveries of an epoch: those that ended (one ending row each) and those in flight."""
    return sum(counts[k] for k in (*ENDING_KINDS, EV_REQUEUE)) + claimed


def redeliveries(counts: Counter[str], failed: int) -> int:
    """Items sent back for another delivery: deliveries that ended without ``done`` (released,
    failed, expired, holder gone or restarted, requeued by an operator while claimed), less the
    items that failed for good."""
    return max(sum(counts[k] for k in (EV_RELEASE, EV_FAIL, EV_EXPIRE, EV_RECOVER, EV_REQUEUE)) - failed, 0)


# ---------------------------------------------------------------- the last minutes (dashboard)


@dataclass(frozen=True)
class Failure:
    epoch: int
    seq: int
    kind: str
    worker: Optional[str]
    at: dt.datetime
    error: Optional[str]


def recent_history(conn: Connection, q: Any, now: dt.datetime, minutes: float, *,
                   kinds: tuple[str, ...] = ENDING_KINDS, in_flight: bool = True,
                   span: int = HISTORY_SPAN) -> list[report.Event]:
    """The ``wq_history`` rows of the last ``minutes`` (one per claim and per transition) of the
    items that moved lately: those whose delivery ended (with one of ``kinds``) among the newest
    ``span`` history rows (by primary key, ``claim`` rows never read) and, with ``in_flight``,
    those claimed now. So the read is bounded on a queue of any size; a busy queue's picture
    covers fewer minutes than asked."""
    e, i = statements.events, statements.items
    since = now - dt.timedelta(minutes=minutes)
    top = conn.execute(select(func.max(e.c.id))).scalar_one_or_none() or 0
    # "queue_id + 0": the primary key range, not the (queue_id, item_id) index (see report.recent_done).
    ids = {r[0] for r in conn.execute(
        select(e.c.item_id).distinct().where(e.c.id > top - span, e.c.id <= top, e.c.queue_id + 0 == q.id,
                                             e.c.kind.in_(kinds), e.c.at >= since))}
    if in_flight:
        ids |= {r[0] for r in conn.execute(select(i.c.id).where(i.c.queue_id == q.id, i.c.state == CLAIMED))}
    stmt = (text(f"SELECT event_id, item_id, epoch, seq, kind, worker, at, detail FROM {EVENTS_VIEW} "
                 "WHERE queue = :q AND item_id IN :ids AND at >= :since")
            .bindparams(bindparam("since", type_=UTCDateTime()), bindparam("ids", expanding=True))
            .columns(at=UTCDateTime()))
    out: list[report.Event] = []
    ordered = sorted(ids)
    for k in range(0, len(ordered), 500):
        rows = conn.execute(stmt, {"q": q.name, "ids": ordered[k:k + 500], "since": since})
        out += [report.Event(int(r.event_id), int(r.item_id), int(r.epoch), int(r.seq), r.kind, r.worker,
                             r.at, r.detail) for r in rows]
    out.sort(key=lambda ev: ev.id)
    return out


FAILURE_EVENTS = (EV_FAIL, EV_EXPIRE)


def failures(events: list[report.Event], limit: int = 20) -> list[Failure]:
    """The newest failed attempts among ``events``, newest first."""
    bad = [ev for ev in events if ev.kind in FAILURE_EVENTS]
    return [Failure(ev.epoch, ev.seq, ev.kind, ev.worker, ev.at, ev.detail) for ev in reversed(bad[-limit:])]


def timeline_of(q: Any, events: list[report.Event], workers: list[str], now: dt.datetime,
                minutes: float, finished: bool = False) -> report.Timeline:
    """The deliveries among ``events`` as ``report.render_svg`` draws them, over the window: up
    to now, or, for a ``finished`` queue, up to its last event (a run that ended stays drawn at
    its own scale, not squeezed to the left as time goes on)."""
    bars = report.pair_deliveries(events)
    lanes = list(workers) + sorted({b.worker for b in bars} - set(workers))
    t0 = now - dt.timedelta(minutes=minutes)
    if bars:
        t0 = max(t0, min(b.start for b in bars))
    t1 = now
    if finished and events:
        t1 = max(t0, max(ev.at for ev in events))
    return report.Timeline(q.name, lanes, bars, {}, t0, t1)

