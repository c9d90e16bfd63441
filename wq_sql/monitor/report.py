"""Read-only reports over a queue's rows and history: the audit and the timeline picture.

Nothing here writes. Both read ``wq_events`` (the history behind the ``wq_history`` view, one
row per delivery, written when it ends) and the claimed item rows (the deliveries in flight):

* :func:`audit` answers who consumed what (the ``wq_tallies`` counters, per worker and epoch),
  what was delivered more than once and why, what failed with which error, and whether every
  item that is ``done`` was completed exactly once;
* :func:`timeline` pairs each delivery of an item with the event that ended it, for
  :func:`render_html` (inline SVG, no dependency) and :func:`render_png` (matplotlib, the
  ``[plot]`` extra).

A *delivery* is one claim of one item by one worker, or a ``recover`` (a restarted worker took
the item back); an item delivered more than once was *re-delivered*, each delivery after its first
is a *re-delivery event*. :func:`_events` rebuilds the history as ``wq_history`` shows it, a
``claim`` event for each delivery that began with a claim (the same rule as the view).
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import Connection, and_, case, func, literal, select

from wq_sql.states import (
    CLAIMED,
    DONE,
    EV_CLAIM,
    EV_DONE,
    EV_EXPIRE,
    EV_FAIL,
    EV_RECOVER,
    EV_RELEASE,
    EV_REQUEUE,
    FAILED,
    QUARANTINED,
)
from wq_sql.store import statements
from wq_sql.store.dialects import Dialect

DELIVERIES = (EV_CLAIM, EV_RECOVER)
# What ends a delivery on the timeline. A recover both ends the dead process's delivery and
# starts the restarted one's; a requeue ends a delivery when an operator took the item away.
ENDINGS = (EV_DONE, EV_RELEASE, EV_FAIL, EV_EXPIRE, EV_RECOVER, EV_REQUEUE)


# ---------------------------------------------------------------- history


@dataclass(frozen=True)
class Event:
    id: float  # wq_history's event_id: a made claim sits at its ending row's id - 0.5
    item_id: int
    epoch: int
    seq: int
    kind: str
    worker: Optional[str]
    at: dt.datetime
    detail: Optional[str]


def _events(conn: Connection, qid: int, item_ids: Optional[Sequence[int]] = None) -> list[Event]:
    """The history of the queue (or of ``item_ids``) as ``wq_history`` shows it, in event_id order."""
    e, w, i = statements.events, statements.workers, statements.items
    stmt = (select(e.c.id, e.c.item_id, e.c.epoch, e.c.seq, e.c.kind, w.c.name, e.c.at, e.c.detail,
                   e.c.claimed_at)
            .select_from(e.outerjoin(w, w.c.id == e.c.worker_id))
            .where(e.c.queue_id == qid).order_by(e.c.id))
    held = (select(i.c.id, i.c.epoch, i.c.seq, w.c.name, i.c.claimed_at)
            .select_from(i.outerjoin(w, w.c.id == i.c.worker_id))
            .where(i.c.queue_id == qid, i.c.state == CLAIMED))
    rows: list[Any] = []
    flying: list[Any] = []
    if item_ids is None:
        chunks: list[Optional[Sequence[int]]] = [None]
    else:
        ids = sorted(set(item_ids))
        chunks = [ids[k:k + 500] for k in range(0, len(ids), 500)]
    for chunk in chunks:
        rows += conn.execute(stmt if chunk is None else stmt.where(e.c.item_id.in_(list(chunk)))).all()
        flying += conn.execute(held if chunk is None else held.where(i.c.id.in_(list(chunk)))).all()
    rows.sort(key=lambda r: r.id)
    out: list[Event] = []
    last: dict[int, str] = {}  # item id -> kind of its latest stored row
    for r in rows:
        # A delivery that began with a recovery has the recover row before it as its start.
        if r.claimed_at is not None and r.kind != EV_CLAIM and last.get(r.item_id) != EV_RECOVER:
            out.append(Event(r.id - 0.5, r.item_id, r.epoch, r.seq, EV_CLAIM, r.name, r.claimed_at, None))
        out.append(Event(r.id, r.item_id, r.epoch, r.seq, r.kind, r.name, r.at, r.detail))
        last[r.item_id] = r.kind
    top = rows[-1].id if rows else 0
    for f in sorted(flying, key=lambda f: (f.claimed_at, f.id)):
        if last.get(f.id) != EV_RECOVER:
            out.append(Event(top + 0.5, f.id, f.epoch, f.seq, EV_CLAIM, f.name, f.claimed_at, None))
    return out


def _delivered_again(conn: Connection, qid: int) -> list[int]:
    """Items with more than one delivery: each ending row (``claimed_at`` set) is one, and so is
    a claimed item row."""
    e, i = statements.events, statements.items
    ended = (select(e.c.item_id, func.count().label("n"))
             .where(e.c.queue_id == qid, e.c.claimed_at.is_not(None)).group_by(e.c.item_id).subquery("n"))
    flying = case((i.c.state == CLAIMED, 1), else_=0)
    rows = conn.execute(select(ended.c.item_id)
                        .select_from(ended.outerjoin(i, i.c.id == ended.c.item_id))
                        .where(ended.c.n + func.coalesce(flying, 0) > 1)).all()
    return [r.item_id for r in rows]


# ---------------------------------------------------------------- audit


@dataclass
class Audit:
    """What ``wq-sql audit`` prints; ``ok`` is the exactly-once verdict."""

    queue: str
    items_per_epoch: int
    num_epochs: int
    epochs_created: int
    consumed: list[dict[str, Any]] = field(default_factory=list)
    redeliveries: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    counter_mismatches: list[dict[str, Any]] = field(default_factory=list)
    unchecked_epochs: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.counter_mismatches

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue, "items_per_epoch": self.items_per_epoch,
            "num_epochs": self.num_epochs, "epochs_created": self.epochs_created,
            "consumed": self.consumed, "redeliveries": self.redeliveries, "failed": self.failed,
            "exactly_once": {"ok": self.ok, "violations": self.violations,
                             "counter_mismatches": self.counter_mismatches,
                             "unchecked_epochs": self.unchecked_epochs},
        }


def audit(conn: Connection, q: Any) -> Audit:
    """Audit queue row ``q`` (from ``statements.find_queue``) in one read transaction of the caller."""
    i, t, w, wk = statements.items, statements.tallies, statements.workers, statements.works_t
    qid = q.id
    a = Audit(q.name, q.n_works, q.num_epochs, q.epochs_created)
    names = {r.id: r.name for r in conn.execute(select(w.c.id, w.c.name).where(w.c.queue_id == qid))}

    # Consumed: the counters (they survive compaction of item rows).
    for r in conn.execute(select(t.c.worker_id, t.c.epoch, t.c.n_done, t.c.n_failed)
                          .where(t.c.queue_id == qid).order_by(t.c.worker_id, t.c.epoch)):
        if r.n_done or r.n_failed:
            a.consumed.append({"worker": names.get(r.worker_id, f"#{r.worker_id}"), "epoch": r.epoch,
                               "done": int(r.n_done), "failed": int(r.n_failed)})
    a.consumed.sort(key=lambda c: (c["worker"], c["epoch"]))

    # Re-deliveries: items with more than one delivery, with their whole history.
    again = _delivered_again(conn, qid)
    if again:
        works = _works_of(conn, qid, again)
        by_item: dict[int, list[Event]] = {}
        for ev in _events(conn, qid, again):
            by_item.setdefault(ev.item_id, []).append(ev)
        for item_id, evs in sorted(by_item.items(), key=lambda kv: (kv[1][0].epoch, kv[1][0].seq)):
            holders = [ev.worker for ev in evs if ev.kind in DELIVERIES]
            a.redeliveries.append({
                "epoch": evs[0].epoch, "seq": evs[0].seq, "work": works.get(item_id),
                "deliveries": len(holders), "holders": holders,
                "events": [{"kind": ev.kind, "worker": ev.worker, "at": ev.at.isoformat(),
                            "detail": ev.detail} for ev in evs]})

    # Failed items, with the error of their last attempt.
    for f in conn.execute(
            select(i.c.epoch, i.c.seq, wk.c.work, i.c.worker_id, i.c.attempts, i.c.last_error)
            .select_from(i.join(wk, and_(wk.c.queue_id == i.c.queue_id, wk.c.idx == i.c.work_idx)))
            .where(i.c.queue_id == qid, i.c.state == FAILED).order_by(i.c.epoch, i.c.seq)):
        a.failed.append({"epoch": f.epoch, "seq": f.seq, "work": f.work,
                         "worker": names.get(f.worker_id) if f.worker_id is not None else None,
                         "attempts": f.attempts, "last_error": f.last_error})

    _exactly_once(conn, q, a)
    return a


def _works_of(conn: Connection, qid: int, item_ids: Sequence[int]) -> dict[int, str]:
    i, wk = statements.items, statements.works_t
    out: dict[int, str] = {}
    ids = sorted(set(item_ids))
    for k in range(0, len(ids), 500):
        out.update({r.id: r.work for r in conn.execute(
            select(i.c.id, wk.c.work)
            .select_from(i.join(wk, and_(wk.c.queue_id == i.c.queue_id, wk.c.idx == i.c.work_idx)))
            .where(i.c.queue_id == qid, i.c.id.in_(ids[k:k + 500])))})
    return out


def _exactly_once(conn: Connection, q: Any, a: Audit) -> None:
    """Every (epoch, seq) that is ``done`` has exactly one ``done`` event since its last
    ``requeue`` (an operator may legitimately have it done again), and every other item none;
    and the counters agree with the rows."""
    i, e, t, wk = statements.items, statements.events, statements.tallies, statements.works_t
    qid = q.id
    last_rq = (select(e.c.epoch, e.c.seq, func.max(e.c.id).label("last"))
               .where(e.c.queue_id == qid, e.c.kind == EV_REQUEUE)
               .group_by(e.c.epoch, e.c.seq).subquery("rq"))
    dones = (select(e.c.epoch, e.c.seq, func.count().label("n"))
             .select_from(e.outerjoin(last_rq, and_(last_rq.c.epoch == e.c.epoch,
                                                    last_rq.c.seq == e.c.seq)))
             .where(e.c.queue_id == qid, e.c.kind == EV_DONE,
                    e.c.id > func.coalesce(last_rq.c.last, 0))
             .group_by(e.c.epoch, e.c.seq).subquery("d"))
    n_done = func.coalesce(dones.c.n, 0)
    expected = case((i.c.state == DONE, 1), else_=0)
    wrong = conn.execute(
        select(i.c.epoch, i.c.seq, i.c.state, wk.c.work, n_done.label("n"))
        .select_from(i.join(wk, and_(wk.c.queue_id == i.c.queue_id, wk.c.idx == i.c.work_idx))
                     .outerjoin(dones, and_(dones.c.epoch == i.c.epoch, dones.c.seq == i.c.seq)))
        .where(i.c.queue_id == qid, n_done != expected)
        .order_by(i.c.epoch, i.c.seq)).all()
    a.violations += [{"epoch": r.epoch, "seq": r.seq, "work": r.work, "state": r.state,
                      "done_events": int(r.n)} for r in wrong]

    # Done events of (epoch, seq) without an item row: compacted epochs (kept events), or
    # events of items that never existed.
    have = select(literal(1)).where(i.c.queue_id == qid, i.c.epoch == dones.c.epoch,
                                    i.c.seq == dones.c.seq).exists()
    for r in conn.execute(select(dones.c.epoch, dones.c.seq, dones.c.n).where(~have)
                          .order_by(dones.c.epoch, dones.c.seq)):
        if r.n != 1 or r.epoch >= q.epochs_created or not 0 <= r.seq < q.n_works:
            a.violations.append({"epoch": r.epoch, "seq": r.seq, "work": None, "state": None,
                                 "done_events": int(r.n)})

    # The counters against the rows, for epochs that still have all their rows.
    rows_by_epoch: dict[int, dict[str, int]] = {}
    for r in conn.execute(select(i.c.epoch, i.c.state, func.count().label("n"))
                          .where(i.c.queue_id == qid).group_by(i.c.epoch, i.c.state)):
        rows_by_epoch.setdefault(r.epoch, {})[r.state] = int(r.n)
    tallied = {r.epoch: (int(r.d), int(r.f), int(r.k)) for r in conn.execute(
        select(t.c.epoch, func.sum(t.c.n_done).label("d"), func.sum(t.c.n_failed).label("f"),
               func.sum(t.c.n_quarantined).label("k"))
        .where(t.c.queue_id == qid).group_by(t.c.epoch))}
    for epoch in range(q.epochs_created):
        states = rows_by_epoch.get(epoch, {})
        if sum(states.values()) < q.n_works:
            a.unchecked_epochs.append(epoch)  # compacted: its done rows were deleted
            continue
        d, f, k = tallied.get(epoch, (0, 0, 0))
        if (d, f, k) != (states.get(DONE, 0), states.get(FAILED, 0), states.get(QUARANTINED, 0)):
            a.counter_mismatches.append({"epoch": epoch, "counted_done": d, "rows_done": states.get(DONE, 0),
                                         "counted_failed": f, "rows_failed": states.get(FAILED, 0),
                                         "counted_quarantined": k,
                                         "rows_quarantined": states.get(QUARANTINED, 0)})


def history_line(events: Sequence[dict[str, Any]]) -> str:
    """``claim alice, expire alice, claim bob, done bob``."""
    return ", ".join(f"{ev['kind']} {ev['worker'] or '?'}" for ev in events)


# ---------------------------------------------------------------- throughput


RATE_WINDOW_SECONDS = 60.0
# The rate reads at most this many of the newest events (of all queues), by id: a bounded range of
# the primary key, so status stays fast on a queue with millions of events (wq_events has no index
# on time).
RATE_EVENT_SPAN = 20_000


@dataclass(frozen=True)
class Status:
    """What ``wq-sql status`` shows, read in one snapshot: done and failed per epoch and per
    worker (from the counters), claimed items per epoch and per holder (the partial index of
    claimed rows), the worker rows, the database clock, and the last minute's completions."""

    per_epoch: dict[int, tuple[int, int]]
    quarantined: dict[int, int]  # items in quarantine per epoch (none: no key)
    claimed: dict[int, int]
    holding: dict[Optional[int], int]
    by_worker: dict[Optional[int], tuple[int, int]]
    workers: list[Any]
    now: dt.datetime
    recent: RecentDone


def status(conn: Connection, d: Dialect, qid: int, window: float = RATE_WINDOW_SECONDS) -> Status:
    t, i, w = statements.tallies, statements.items, statements.workers
    per_epoch: dict[int, tuple[int, int]] = {}
    quarantined: dict[int, int] = {}
    for r in conn.execute(
            select(t.c.epoch, func.sum(t.c.n_done).label("done"), func.sum(t.c.n_failed).label("failed"),
                   func.sum(t.c.n_quarantined).label("quarantined"))
            .where(t.c.queue_id == qid).group_by(t.c.epoch)):
        per_epoch[r.epoch] = (int(r.done), int(r.failed))
        if r.quarantined:
            quarantined[r.epoch] = int(r.quarantined)
    claimed: dict[int, int] = {}
    holding: dict[Optional[int], int] = {}
    # Grouped by worker first: so SQLite's planner reads the partial index of claimed rows
    # (queue_id, worker_id, ...), not every row of the queue through the unique index.
    for r in conn.execute(select(i.c.epoch, i.c.worker_id, func.count().label("n"))
                          .where(i.c.queue_id == qid, i.c.state == CLAIMED)
                          .group_by(i.c.worker_id, i.c.epoch)):
        claimed[r.epoch] = claimed.get(r.epoch, 0) + r.n
        holding[r.worker_id] = holding.get(r.worker_id, 0) + r.n
    by_worker = {r.worker_id: (int(r.done), int(r.failed)) for r in conn.execute(
        select(t.c.worker_id, func.sum(t.c.n_done).label("done"), func.sum(t.c.n_failed).label("failed"))
        .where(t.c.queue_id == qid).group_by(t.c.worker_id))}
    workers = list(conn.execute(select(w).where(w.c.queue_id == qid).order_by(w.c.name)).all())
    now = d.db_now(conn)
    return Status(per_epoch, quarantined, claimed, holding, by_worker, workers, now,
                  recent_done(conn, qid, now, window))


@dataclass(frozen=True)
class RecentDone:
    """The items done in the last minute: how many, per worker id, and how fast."""

    done: int
    by_worker: dict[Optional[int], int]
    rate: Optional[float]  # items per second; None with fewer than two (a rate needs two points)
    # The seconds the counts cover: the window, or less when the newest RATE_EVENT_SPAN events
    # all fall inside it (a fast job): ``by_worker[w] / seconds`` is then still a rate.
    seconds: float = RATE_WINDOW_SECONDS


def recent_done(conn: Connection, qid: int, now: dt.datetime,
                window: float = RATE_WINDOW_SECONDS) -> RecentDone:
    """Items done in the ``window`` seconds before ``now`` (from the newest ``done`` events).
    The rate spans the oldest of them to ``now``: ``(k - 1) / span`` for ``k`` items."""
    e = statements.events
    newest = conn.execute(select(func.max(e.c.id))).scalar_one_or_none()
    if newest is None:
        return RecentDone(0, {}, None, window)
    since = now - dt.timedelta(seconds=window)
    first = conn.execute(select(func.min(e.c.at)).where(e.c.id > newest - RATE_EVENT_SPAN,
                                                        e.c.id <= newest - RATE_EVENT_SPAN + 1)).scalar()
    if first is not None and first.tzinfo is None:
        first = first.replace(tzinfo=dt.timezone.utc)
    seconds = window if first is None or first <= since else max((now - first).total_seconds(), 1e-3)
    # Both ends of the id range, and "queue_id + 0": SQLite's planner would otherwise scan the
    # (queue_id, item_id) index, every event of the queue, instead of the primary key range.
    rows = conn.execute(
        select(e.c.worker_id, func.count(), func.min(e.c.at))
        .where(e.c.id > newest - RATE_EVENT_SPAN, e.c.id <= newest, e.c.queue_id + 0 == qid,
               e.c.kind == EV_DONE, e.c.at >= since).group_by(e.c.worker_id)).all()
    by_worker = {r[0]: int(r[1]) for r in rows}
    k = sum(by_worker.values())
    if k < 2:
        return RecentDone(k, by_worker, None, seconds)
    oldest = min(r[2] for r in rows)
    if oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=dt.timezone.utc)
    span = max((now - oldest).total_seconds(), 1e-3)
    return RecentDone(k, by_worker, (k - 1) / span, seconds)


# ---------------------------------------------------------------- timeline


@dataclass(frozen=True)
class Bar:
    """One delivery of an item to a worker, from its ``claim`` (or ``recover``) to the event that
    ended it (``end_kind``; ``None`` while the item is still held)."""

    worker: str
    epoch: int
    seq: int
    item_id: int
    start: dt.datetime
    end: Optional[dt.datetime]
    end_kind: Optional[str]
    redelivery: bool  # the item was delivered before


@dataclass
class Timeline:
    queue: str
    workers: list[str]  # one lane each, in order
    bars: list[Bar]
    works: dict[int, str]  # item id -> work
    t0: dt.datetime
    t1: dt.datetime

    @property
    def redeliveries(self) -> int:
        return sum(1 for b in self.bars if b.redelivery)


def timeline(conn: Connection, q: Any) -> Timeline:
    """Every delivery of queue row ``q`` as a bar; the lanes are the queue's workers."""
    w = statements.workers
    workers = [r.name for r in conn.execute(select(w.c.name).where(w.c.queue_id == q.id).order_by(w.c.name))]
    events = _events(conn, q.id)
    bars = pair_deliveries(events)
    for name in sorted({b.worker for b in bars} - set(workers)):
        workers.append(name)  # an event whose worker row is gone
    works = _works_of(conn, q.id, sorted({b.item_id for b in bars}))
    # The picture spans the deliveries (a later requeue would squeeze them to the left); a bar
    # still held reaches its right edge.
    times = [x for b in bars for x in (b.start, b.end) if x is not None]
    times = times or [ev.at for ev in events] or [dt.datetime.now(dt.timezone.utc)]
    return Timeline(q.name, workers, bars, works, min(times), max(times))


def pair_deliveries(events: Sequence[Event]) -> list[Bar]:
    """Pair each delivery with the next event that ends it, per item (events in id order)."""
    open_: dict[int, tuple[Event, bool]] = {}
    delivered: set[int] = set()
    bars: list[Bar] = []

    def close(item_id: int, ev: Optional[Event]) -> None:
        start, again = open_.pop(item_id)
        bars.append(Bar(start.worker or "?", start.epoch, start.seq, item_id, start.at,
                        ev.at if ev else None, ev.kind if ev else None, again))

    for ev in events:
        if ev.kind in ENDINGS and ev.item_id in open_:
            close(ev.item_id, ev)
        if ev.kind in DELIVERIES:
            open_[ev.item_id] = (ev, ev.item_id in delivered)
            delivered.add(ev.item_id)
    for item_id in list(open_):
        close(item_id, None)
    bars.sort(key=lambda b: (b.start, b.item_id))
    return bars


EPOCH_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                "#bab0ac", "#ff9da7", "#e15759"]
LANE_H, BAR_H, LEFT, RIGHT, TOP, PLOT_W = 26, 16, 150, 30, 50, 1100


def epoch_color(epoch: int) -> str:
    return EPOCH_COLORS[epoch % len(EPOCH_COLORS)]


def render_svg(t: Timeline) -> str:
    """The timeline as a standalone SVG document: ``g.lane`` per worker (``data-worker``),
    ``rect.bar`` per delivery (``data-epoch``, ``data-seq``, ``data-end``), ``path.redelivery``
    per re-delivery (a red triangle at the start of the bar)."""
    span = max((t.t1 - t.t0).total_seconds(), 1e-3)

    def x(when: Optional[dt.datetime]) -> float:
        when = when or t.t1
        return LEFT + PLOT_W * (when - t.t0).total_seconds() / span

    lane_of = {name: k for k, name in enumerate(t.workers)}
    height = TOP + LANE_H * max(len(t.workers), 1) + 60
    width = LEFT + PLOT_W + RIGHT
    esc = html.escape
    epochs = sorted({b.epoch for b in t.bars})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12" '
           f'data-queue="{esc(t.queue)}" data-bars="{len(t.bars)}" data-redeliveries="{t.redeliveries}">',
           f'<text x="{LEFT}" y="18" font-size="14" font-weight="bold">queue {esc(t.queue)}: '
           f'{len(t.bars)} deliveries to {len(t.workers)} workers over {span:.1f} s, '
           f'{t.redeliveries} re-deliveries</text>']
    # Legend: epochs, then the marks.
    lx = LEFT
    for e in epochs[:10]:
        out.append(f'<rect class="legend" x="{lx}" y="28" width="12" height="10" fill="{epoch_color(e)}"/>'
                   f'<text x="{lx + 16}" y="37">epoch {e}</text>')
        lx += 80
    if len(epochs) > 10:
        out.append(f'<text x="{lx}" y="37">(colors repeat every 10 epochs)</text>')
        lx += 200
    out.append(f'<path d="M{lx} 28 l8 5 l-8 5 z" fill="#d62728"/>'
               f'<text x="{lx + 12}" y="37">re-delivered</text>'
               f'<rect x="{lx + 100}" y="28" width="16" height="10" fill="#ccc" stroke="#d62728" '
               f'stroke-dasharray="3,2"/><text x="{lx + 120}" y="37">ended without done</text>')
    # Time axis.
    axis_y = TOP + LANE_H * len(t.workers) + 8
    step = _tick_step(span)
    k = 0
    while k * step <= span + 1e-9:
        tx = LEFT + PLOT_W * k * step / span
        out.append(f'<line x1="{tx:.1f}" y1="{TOP}" x2="{tx:.1f}" y2="{axis_y}" stroke="#eee"/>'
                   f'<text x="{tx:.1f}" y="{axis_y + 14}" text-anchor="middle">{k * step:g}s</text>')
        k += 1
    for name in t.workers:
        y = TOP + LANE_H * lane_of[name]
        out.append(f'<g class="lane" data-worker="{esc(name)}">'
                   f'<rect x="{LEFT}" y="{y}" width="{PLOT_W}" height="{LANE_H}" '
                   f'fill="#888" fill-opacity="{0.08 if lane_of[name] % 2 else 0.0}"/>'
                   f'<text x="{LEFT - 6}" y="{y + LANE_H / 2 + 4}" text-anchor="end">{esc(name)}</text>')
        for b in (b for b in t.bars if b.worker == name):
            x0, x1 = x(b.start), x(b.end)
            w = max(x1 - x0, 1.0)
            ended = b.end_kind or "still held"
            title = (f"epoch {b.epoch} seq {b.seq} {t.works.get(b.item_id, '')}: {name}, "
                     f"{(b.start - t.t0).total_seconds():.2f}s to "
                     + (f"{(b.end - t.t0).total_seconds():.2f}s, {ended}" if b.end else "now, still held"))
            # A worker's next claim is its previous item's done: a white edge separates the bars.
            style = (' stroke="#fff" stroke-width="0.6"' if b.end_kind == EV_DONE
                     else ' stroke="#d62728" stroke-dasharray="3,2" fill-opacity="0.45"')
            out.append(f'<rect class="bar" x="{x0:.2f}" y="{y + (LANE_H - BAR_H) / 2}" width="{w:.2f}" '
                       f'height="{BAR_H}" fill="{epoch_color(b.epoch)}"{style} data-epoch="{b.epoch}" '
                       f'data-seq="{b.seq}" data-end="{esc(ended)}"><title>{esc(title)}</title></rect>')
            if b.redelivery:
                ty = y + (LANE_H - BAR_H) / 2
                out.append(f'<path class="redelivery" d="M{x0:.2f} {ty} l7 {BAR_H / 2} l-7 {BAR_H / 2} z" '
                           f'fill="#d62728" data-epoch="{b.epoch}" data-seq="{b.seq}"/>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _tick_step(span: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200,
                 14400, 21600, 43200, 86400):
        if span / step <= 12:
            return step
    return 86400.0 * (int(span / 86400 / 12) + 1)


def render_html(t: Timeline) -> str:
    """A self-contained HTML page around :func:`render_svg` (no script, no external file)."""
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>wq_sql timeline: "
            f"{html.escape(t.queue)}</title></head>\n<body style=\"font-family: sans-serif\">\n"
            f"<p>One lane per worker, one bar per delivery of an item, from its claim to its done "
            f"(or to the release, fail, expiry, recovery or requeue that ended it); colors are epochs. "
            f"Hover a bar for the item.</p>\n{render_svg(t)}\n</body></html>\n")


def render_png(t: Timeline, path: str) -> None:
    """The same picture with matplotlib (``pip install 'wq_sql[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    lanes = {name: k for k, name in enumerate(t.workers)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.35 * max(len(t.workers), 1)))
    for b in t.bars:
        x0 = (b.start - t.t0).total_seconds()
        x1 = ((b.end or t.t1) - t.t0).total_seconds()
        done = b.end_kind == EV_DONE
        ax.broken_barh([(x0, max(x1 - x0, 1e-3))], (lanes[b.worker] - 0.35, 0.7),
                       facecolors=epoch_color(b.epoch), alpha=1.0 if done else 0.45,
                       edgecolors="white" if done else "#d62728", linewidth=0.6,
                       linestyles="-" if done else "--")
        if b.redelivery:
            ax.plot([x0], [lanes[b.worker]], marker=">", color="#d62728", markersize=6)
    ax.set_yticks(range(len(t.workers)), t.workers)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first event")
    epochs = sorted({b.epoch for b in t.bars})[:10]
    ax.legend(handles=[Patch(color=epoch_color(e), label=f"epoch {e}") for e in epochs],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=max(len(epochs), 1), fontsize="small",
              frameon=False)
    ax.set_title(f"queue {t.queue}: {len(t.bars)} deliveries, {t.redeliveries} re-deliveries (red marks)",
                 loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
