"""The statements of quarantine: putting works in and taking them out, the sweep that keeps
every path that makes rows claimable from bringing a quarantined work back, and the reads
behind ``wq-sql quarantine`` (which works a pattern or a predicate names, what is in).

A work in quarantine is a ``wq_quarantine`` row. Its item rows that could still be delivered
(pending, claimed, failed) are ``quarantined``, a state no claim selects; a claimed one's token is
cleared, so its holder's ack is rejected, and the queue's ``revoked`` counter moves on, so its
holder drops it from its buffer at its next claim round. Quarantined rows count as finished
(``wq_tallies.n_quarantined`` of worker id 0), so an epoch with a quarantined work still ends.
Rows that become pending later (a new epoch, a mix change's redraw, a requeue, a restore, a
reset) are swept in the transaction that made them (:func:`sweep`). See
``docs/decisions/0009-quarantine-as-a-state.md``.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

from sqlalchemy import Connection, Table, and_, delete, func, insert, literal, select, update

from wq_sql.states import CLAIMED, EV_QUARANTINE, EV_REQUEUE, FAILED, PENDING, QUARANTINE_TALLY, QUARANTINED
from wq_sql.store import accounting
from wq_sql.store.dialects import Dialect, dialect_of
from wq_sql.store.models import Item, QuarantineRow, Queue, SourceRow, Tally, Work, Worker
from wq_sql.store.predicate import parse

items = cast(Table, Item.__table__)
queues = cast(Table, Queue.__table__)
works_t = cast(Table, Work.__table__)
workers = cast(Table, Worker.__table__)
sources_t = cast(Table, SourceRow.__table__)
tallies = cast(Table, Tally.__table__)
quarantine_t = cast(Table, QuarantineRow.__table__)

CHUNK = 10_000  # ids per statement
REASON_PREFIX = "quarantined: "  # a quarantined row's last_error, before the reason


@dataclass(frozen=True)
class QuarantineOutcome:
    """What a quarantine did: works put in (``already``: of those matched, in before), item
    rows it took out of circulation, and how many of those were in flight (claimed)."""

    works: int
    already: int
    items: int
    in_flight: int


@dataclass(frozen=True)
class Quarantined:
    """One work in quarantine, as ``wq-sql quarantine NAME`` lists it."""

    work: str
    reason: str
    by: str
    at: dt.datetime
    items: int  # its item rows in the state quarantined


def quarantine(conn: Connection, qid: int, idxs: Sequence[int], reason: str, by: str) -> QuarantineOutcome:
    """Put the works ``idxs`` of queue ``qid`` in quarantine, in this transaction."""
    b = dialect_of(conn)
    # The queue row first (as a mix change: excludes the epoch maker and other changes), then
    # the claims: a claim in flight finishes first, none starts until this commits.
    conn.execute(select(queues.c.id).where(queues.c.id == qid).with_for_update(key_share=True)).one()
    b.lock_claims(conn, qid)
    wanted = sorted(set(idxs))
    known = {r[0] for r in conn.execute(select(quarantine_t.c.work_idx).where(
        quarantine_t.c.queue_id == qid, quarantine_t.c.work_idx.in_(wanted)))}
    new = [i for i in wanted if i not in known]
    for k in range(0, len(new), CHUNK):  # stamped by the database clock, as every other row
        conn.execute(insert(quarantine_t).values(at=b.now()),
                     [{"queue_id": qid, "work_idx": i, "reason": reason, "by": by[:300]}
                      for i in new[k:k + CHUNK]])
    # The rows still to be delivered, locked, with their state: one pass over the queue's rows
    # (work_idx has no index; an operator action, not a hot path).
    rows: list[Any] = []
    for k in range(0, len(wanted), CHUNK):
        rows += conn.execute(select(items.c.id, items.c.state).where(
            items.c.queue_id == qid, items.c.work_idx.in_(wanted[k:k + CHUNK]),
            items.c.state.in_([PENDING, CLAIMED, FAILED])).with_for_update()).all()
    by_state: dict[str, list[int]] = {PENDING: [], CLAIMED: [], FAILED: []}
    for r in rows:
        by_state[r.state].append(r.id)
    n = 0
    for state, ids in by_state.items():
        n += _take(conn, b, qid, ids, state)
    conn.execute(update(queues).where(queues.c.id == qid).values(revoked=queues.c.revoked + 1))
    return QuarantineOutcome(len(new), len(known), n, len(by_state[CLAIMED]))


def quarantine_item(conn: Connection, qid: int, item_id: int, reason: str, by: str) -> QuarantineOutcome:
    """Put the work of item row ``item_id`` in quarantine (``WorkQueue.quarantine``)."""
    idx = conn.execute(select(items.c.work_idx)
                       .where(items.c.queue_id == qid, items.c.id == item_id)).scalar_one()
    return quarantine(conn, qid, [int(idx)], reason, by)


def _take(conn: Connection, b: Dialect, qid: int, ids: Sequence[int], state: str) -> int:
    """Rows ``ids`` of ``state`` become quarantined: a history row each (ending a claimed one's
    delivery), counted on the quarantine's tally (and off the failed counter for failed ones)."""
    reason = (select(literal(REASON_PREFIX) + quarantine_t.c.reason)
              .where(quarantine_t.c.queue_id == items.c.queue_id, quarantine_t.c.work_idx == items.c.work_idx)
              .scalar_subquery())
    n = 0
    for k in range(0, len(ids), CHUNK):
        rows = conn.execute(
            update(items).where(items.c.id.in_(list(ids[k:k + CHUNK])), items.c.state == state)
            .values(state=QUARANTINED, token=None, lease_until=None, last_error=reason,
                    done_at=b.now())
            .returning(items.c.id, items.c.epoch, items.c.seq, items.c.worker_id, items.c.last_error,
                       items.c.claimed_at, items.c.attempts)).all()
        accounting.history(conn, b, qid, EV_QUARANTINE, rows, delivery=state == CLAIMED,
                           detail_of=lambda r: r.last_error)
        if state == FAILED:
            accounting.untally(conn, qid, rows, "n_failed")
        _count(conn, b, qid, rows, +1)
        n += len(rows)
    return n


def sweep(conn: Connection, qid: int, *, epoch: Optional[int] = None, seq_from: int = 0,
          ids: Optional[Sequence[int]] = None) -> int:
    """Pending rows of quarantined works become quarantined: the last step of every transaction
    that made rows claimable (of ``epoch`` from ``seq_from`` on, or the rows ``ids``; all the
    queue's without either).
    Takes the queue's claim lock shared first (Postgres): a quarantine that runs meanwhile
    commits first, and this sweep sees it. One read when nothing is in quarantine."""
    b = dialect_of(conn)
    b.lock_claims(conn, qid, shared=True)
    some = select(quarantine_t.c.work_idx).where(quarantine_t.c.queue_id == qid).limit(1)
    if conn.execute(some).first() is None:
        return 0
    cond = [items.c.queue_id == qid, items.c.state == PENDING,
            items.c.work_idx.in_(select(quarantine_t.c.work_idx).where(quarantine_t.c.queue_id == qid))]
    if epoch is not None:
        cond += [items.c.epoch == epoch, items.c.seq >= seq_from]
    if ids is None:
        found = [r[0] for r in conn.execute(select(items.c.id).where(*cond))]
    else:
        found = []
        id_list = list(ids)
        for k in range(0, len(id_list), CHUNK):
            found += [r[0] for r in conn.execute(select(items.c.id).where(
                *cond, items.c.id.in_(id_list[k:k + CHUNK])))]
    return _take(conn, b, qid, found, PENDING) if found else 0


def unquarantine(conn: Connection, qid: int, idxs: Sequence[int], by: str) -> tuple[int, int]:
    """Take the works ``idxs`` out of quarantine: their quarantined rows are pending again, with
    attempts from 0 (``requeue`` history rows). Returns (works taken out, rows back)."""
    b = dialect_of(conn)
    conn.execute(select(queues.c.id).where(queues.c.id == qid).with_for_update(key_share=True)).one()
    wanted = sorted(set(idxs))
    works = 0
    for k in range(0, len(wanted), CHUNK):
        works += conn.execute(delete(quarantine_t).where(
            quarantine_t.c.queue_id == qid, quarantine_t.c.work_idx.in_(wanted[k:k + CHUNK]))).rowcount
    n = 0
    for k in range(0, len(wanted), CHUNK):
        rows = conn.execute(
            update(items).where(items.c.queue_id == qid, items.c.work_idx.in_(wanted[k:k + CHUNK]),
                                items.c.state == QUARANTINED)
            .values(state=PENDING, attempts=0, last_error=None, done_at=None, token=None, lease_until=None)
            .returning(items.c.id, items.c.epoch, items.c.seq, items.c.worker_id)).all()
        accounting.history(conn, b, qid, EV_REQUEUE, rows, delivery=False,
                           detail=f"taken out of quarantine by {by}"[:300])
        _count(conn, b, qid, rows, -1)
        n += len(rows)
    return works, n


def _count(conn: Connection, b: Dialect, qid: int, rows: Iterable[Any], sign: int) -> None:
    per_epoch: dict[int, int] = {}
    for r in rows:
        per_epoch[r.epoch] = per_epoch.get(r.epoch, 0) + 1
    for epoch, k in per_epoch.items():
        stmt = b.insert(tallies).values(queue_id=qid, epoch=epoch, worker_id=QUARANTINE_TALLY,
                                        n_quarantined=sign * k)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["queue_id", "epoch", "worker_id"],
            set_={"n_quarantined": tallies.c.n_quarantined + stmt.excluded.n_quarantined}))


# ---------------------------------------------------------------- which works


def works_matching(conn: Connection, qid: int, pattern: str) -> list[int]:
    """The works of queue ``qid`` that ``pattern`` names: the work itself, or a shell-style
    pattern (``*``, ``?``, ``[...]``) over the whole work string, case-sensitive on every backend."""
    rows = conn.execute(select(works_t.c.idx, works_t.c.work).where(works_t.c.queue_id == qid)
                        .order_by(works_t.c.idx))
    return [int(i) for i, w in rows if w == pattern or fnmatch.fnmatchcase(w, pattern)]


# The columns a --where predicate may name: the works' own, and (naming any other) their item rows'.
WORK_COLUMNS = ("work", "source")
ITEM_COLUMNS = ("epoch", "seq", "state", "attempts", "worker", "last_error")


def works_where(conn: Connection, qid: int, predicate: str) -> list[int]:
    """The works of queue ``qid`` that ``predicate`` (``wq_sql.store.predicate``) selects: over
    the work and its source alone, every work; naming an item column (``epoch``, ``state``,
    ``attempts``, ...), the works of the item rows it selects."""
    names = {"work": works_t.c.work, "source": sources_t.c.name, "epoch": items.c.epoch, "seq": items.c.seq,
             "state": items.c.state, "attempts": items.c.attempts, "worker": workers.c.name,
             "last_error": items.c.last_error}
    expr, used = parse(predicate, names)
    if used <= set(WORK_COLUMNS):
        in_source = and_(sources_t.c.queue_id == works_t.c.queue_id, works_t.c.idx >= sources_t.c.first,
                         works_t.c.idx < sources_t.c.first + sources_t.c.n_works)
        stmt = (select(works_t.c.idx).select_from(works_t.outerjoin(sources_t, in_source))
                .where(works_t.c.queue_id == qid, expr))
    else:
        own = and_(works_t.c.queue_id == items.c.queue_id, works_t.c.idx == items.c.work_idx)
        joined = (items.join(works_t, own)
                  .outerjoin(workers, workers.c.id == items.c.worker_id)
                  .outerjoin(sources_t, and_(sources_t.c.queue_id == items.c.queue_id,
                                             sources_t.c.idx == items.c.source)))
        stmt = select(items.c.work_idx).select_from(joined).where(items.c.queue_id == qid, expr).distinct()
    return sorted(int(r[0]) for r in conn.execute(stmt))


def in_quarantine(conn: Connection, qid: int) -> list[Quarantined]:
    """The queue's works in quarantine, in work order, each with its quarantined rows' count."""
    counts = (select(items.c.work_idx, func.count().label("n"))
              .where(items.c.queue_id == qid, items.c.state == QUARANTINED)
              .group_by(items.c.work_idx).subquery())
    rows = conn.execute(
        select(works_t.c.work, quarantine_t.c.reason, quarantine_t.c.by, quarantine_t.c.at,
               func.coalesce(counts.c.n, 0))
        .select_from(quarantine_t.join(works_t, and_(works_t.c.queue_id == quarantine_t.c.queue_id,
                                                     works_t.c.idx == quarantine_t.c.work_idx))
                     .outerjoin(counts, counts.c.work_idx == quarantine_t.c.work_idx))
        .where(quarantine_t.c.queue_id == qid).order_by(quarantine_t.c.work_idx)).all()
    return [Quarantined(w, r, by, Dialect.clock_value(at), int(n)) for w, r, by, at, n in rows]


def quarantined_idxs(conn: Connection, qid: int) -> set[int]:
    rows = conn.execute(select(quarantine_t.c.work_idx).where(quarantine_t.c.queue_id == qid))
    return {int(r[0]) for r in rows}


def still_held(conn: Connection, qid: int, worker_id: int, keys: Sequence[tuple[int, int]]) -> set[int]:
    """The ids among ``(id, token)`` pairs that ``worker_id`` still holds with that token."""
    held: set[int] = set()
    for k in range(0, len(keys), CHUNK):
        part = {(int(i), int(t)) for i, t in keys[k:k + CHUNK]}
        rows = conn.execute(select(items.c.id, items.c.token).where(
            items.c.queue_id == qid, items.c.id.in_([i for i, _ in part]), items.c.worker_id == worker_id,
            items.c.state == CLAIMED))
        held |= {int(i) for i, t in rows if t is not None and (int(i), int(t)) in part}
    return held
