"""The statements of weighted sources: their rows, a weighted epoch's rows, a change of the
weights in force (``set_mix``) and the shares a queue realized. The rules they follow (what
an epoch draws, stream positions, the interleave) are ``wq_sql.mixing``'s.

A change of the weights redraws, in one transaction, every item row that no worker has claimed
yet (pending, ``claimed_at`` NULL) in the epochs made so far, at the new weights, in place (the
rows keep their ids and seqs: an epoch keeps its length), and gives their stream positions back
to their sources first. Rows already delivered, in flight or sent back by a requeue keep their
work. Later epochs are drawn at the weights in force when they are made.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

from sqlalchemy import Connection, Table, case, func, insert, literal, select, update

from wq_sql.errors import QueueNotFound
from wq_sql.mixing import Draws, Source, Streams, draw
from wq_sql.plan import check_weights
from wq_sql.states import DONE, PENDING
from wq_sql.store import quarantine
from wq_sql.store.dialects import dialect_of
from wq_sql.store.models import Item, MixChange, Queue, SourceRow

items = cast(Table, Item.__table__)
queues = cast(Table, Queue.__table__)
sources_t = cast(Table, SourceRow.__table__)
mixes = cast(Table, MixChange.__table__)

ROWS_PER_STATEMENT = 50_000


def insert_sources(conn: Connection, qid: int, sources: Sequence[Source], by: str) -> None:
    """A new weighted queue's sources, and its first ``wq_mixes`` row (the weights at creation)."""
    conn.execute(insert(sources_t), [{"queue_id": qid, "idx": s.idx, "name": s.name, "first": s.first,
                                      "n_works": s.n, "weight": s.weight, "drawn": 0} for s in sources])
    _record(conn, qid, sources, [s.weight for s in sources], by, 0, 0, 0)


def load_sources(conn: Connection, qid: int) -> list[Source]:
    """The queue's sources in order (empty: a queue without sources)."""
    rows = conn.execute(select(sources_t).where(sources_t.c.queue_id == qid).order_by(sources_t.c.idx)).all()
    return [Source(r.idx, r.name, r.first, r.n_works, r.weight, r.drawn,
                   tuple(json.loads(r.skip)) if r.skip else ()) for r in rows]


def make_epoch(conn: Connection, qid: int, epoch: int, n: int, shuffle: bool, seed: int,
               sources: Sequence[Source]) -> None:
    """Insert all ``n`` rows of ``epoch`` of a weighted queue, drawn at the weights in force, and
    move the sources' streams on. The caller holds the queue row (``advance_epoch``)."""
    taken = [set(s.skip) for s in sources]
    d = draw(Streams(sources, shuffle, seed), [s.drawn for s in sources], [s.weight for s in sources],
             n, seed, epoch, 0, taken)
    _insert_rows(conn, qid, epoch, 0, d)
    _move_streams(conn, qid, sources, d.cursor, taken)


def reset_streams(conn: Connection, qid: int) -> list[Source]:
    """A reset starts every source's stream over; returns the sources (weights in force kept)."""
    conn.execute(update(sources_t).where(sources_t.c.queue_id == qid).values(drawn=0, skip=None))
    return load_sources(conn, qid)


@dataclass(frozen=True)
class MixOutcome:
    """What a change of the weights did: the weights now in force (by source name), how many
    undelivered rows it redrew, and from where: the first epoch with such rows and the lowest
    seq redrawn there (``None``: no undelivered row, only later epochs follow the change)."""

    weights: dict[str, float]
    redrawn: int
    epoch: Optional[int]
    seq: Optional[int]


def set_mix(conn: Connection, qid: int, given: Mapping[str, Any], by: str, shuffle: bool,
            seed: int) -> MixOutcome:
    """Put ``given`` weights in force for queue ``qid`` in this transaction (see the module's
    docstring). Raises ``InvalidInput`` (nothing written) for weights that are not valid for the
    queue's sources, ``QueueNotFound`` for a queue without sources."""
    # The queue row first: excludes the epoch maker (advance_epoch) and other changes; then
    # the claims, which would otherwise skip the rows locked below and claim past them.
    conn.execute(select(queues.c.id).where(queues.c.id == qid).with_for_update(key_share=True)).one()
    b = dialect_of(conn)
    b.lock_claims(conn, qid)
    sources = load_sources(conn, qid)
    if not sources:
        raise QueueNotFound("this queue has no weighted sources (it was created from a list of works); "
                            "create it from a dict of sources with weights= to mix them")
    weights = check_weights(given, [s.name for s in sources])
    open_epochs = [e for (e,) in conn.execute(
        select(items.c.epoch).where(items.c.queue_id == qid, items.c.state == PENDING)
        .group_by(items.c.epoch).order_by(items.c.epoch))]
    # The rows no worker has claimed: locked (a claim in flight that got one first wins it).
    tails: list[tuple[int, list[Any]]] = []
    for e in open_epochs:
        rows = conn.execute(
            select(items.c.id, items.c.seq, items.c.source, items.c.draw)
            .where(items.c.queue_id == qid, items.c.epoch == e, items.c.state == PENDING,
                   items.c.claimed_at.is_(None))
            .order_by(items.c.seq).with_for_update()).all()
        if rows:
            tails.append((e, list(rows)))
    # Their stream positions go back to their sources: each stream restarts at the lowest one
    # given back, skipping the positions that rows kept still hold.
    redrawn_ids = {r.id for _, rows in tails for r in rows}
    cursor = [s.drawn for s in sources]
    for _, rows in tails:
        for r in rows:
            cursor[r.source] = min(cursor[r.source], r.draw)
    taken = [_held(conn, qid, s.idx, cursor[s.idx], exclude=redrawn_ids) for s in sources]
    streams = Streams(sources, shuffle, seed)
    for e, rows in tails:
        d = draw(streams, cursor, weights, len(rows), seed, e, rows[0].seq, taken)
        cursor = d.cursor
        for k in range(0, len(rows), ROWS_PER_STATEMENT):
            part = range(k, min(len(rows), k + ROWS_PER_STATEMENT))
            t, _, (rid, w, src, pos) = b.int_columns([[rows[j].id for j in part], [d.works[j] for j in part],
                                                      [d.sources[j] for j in part],
                                                      [d.positions[j] for j in part]])
            conn.execute(update(items).where(items.c.id == rid)
                         .values(work_idx=w, source=src, draw=pos))
    for s, w in zip(sources, weights):
        conn.execute(update(sources_t).where(sources_t.c.queue_id == qid, sources_t.c.idx == s.idx)
                     .values(weight=w))
    _move_streams(conn, qid, sources, cursor, taken)
    quarantine.sweep(conn, qid, ids=sorted(redrawn_ids))  # a redrawn row may now hold one
    first = tails[0] if tails else None
    epoch = first[0] if first else conn.execute(
        select(queues.c.epochs_created).where(queues.c.id == qid)).scalar_one()
    seq = first[1][0].seq if first else 0
    n = len(redrawn_ids)
    _record(conn, qid, sources, weights, by, epoch, seq, n)
    return MixOutcome({s.name: w for s, w in zip(sources, weights)}, n,
                      first[0] if first else None, seq if first else None)


@dataclass(frozen=True)
class Share:
    """One source in one epoch: rows drawn (the epoch's plan as it stands), delivered (claimed
    at least once: in flight, done or failed) and done."""

    epoch: int
    source: str
    drawn: int
    delivered: int
    done: int


def shares(conn: Connection, qid: int) -> list[Share]:
    """Per epoch and source, what the queue drew and delivered (one pass over its item rows)."""
    rows = conn.execute(
        select(items.c.epoch, sources_t.c.name, func.count(),
               func.sum(case((items.c.claimed_at.is_not(None), 1), else_=0)),
               func.sum(case((items.c.state == DONE, 1), else_=0)))
        .join(sources_t, (sources_t.c.queue_id == items.c.queue_id) & (sources_t.c.idx == items.c.source))
        .where(items.c.queue_id == qid)
        .group_by(items.c.epoch, sources_t.c.idx, sources_t.c.name)
        .order_by(items.c.epoch, sources_t.c.idx)).all()
    return [Share(int(e), n, int(c), int(d or 0), int(k or 0)) for e, n, c, d, k in rows]


def changes(conn: Connection, qid: int) -> list[Any]:
    """The queue's ``wq_mixes`` rows, oldest first."""
    return list(conn.execute(select(mixes).where(mixes.c.queue_id == qid).order_by(mixes.c.id)))


# ---------------------------------------------------------------- helpers


def _held(conn: Connection, qid: int, source: int, start: int,
          exclude: Collection[int] = frozenset()) -> set[int]:
    """Stream positions ``>= start`` of ``source`` that item rows hold (other than ``exclude``):
    a scan of the queue's rows, once per mix change (no index on ``draw``: every claim and ack
    would write an entry into it on Postgres)."""
    rows = conn.execute(select(items.c.id, items.c.draw)
                        .where(items.c.queue_id == qid, items.c.source == source, items.c.draw >= start,
                               items.c.draw.is_not(None)))
    return {int(p) for i, p in rows if i not in exclude}


def _insert_rows(conn: Connection, qid: int, epoch: int, start: int, d: Draws) -> None:
    """The rows of ``d`` at seqs ``start`` on, ``ROWS_PER_STATEMENT`` per ``INSERT ... SELECT``
    from one table parameter (``Dialect.int_columns``)."""
    b = dialect_of(conn)
    for k in range(0, len(d.works), ROWS_PER_STATEMENT):
        end = k + ROWS_PER_STATEMENT
        t, pos, (w, src, at) = b.int_columns([d.works[k:end], d.sources[k:end], d.positions[k:end]])
        conn.execute(insert(items).from_select(
            ["queue_id", "epoch", "seq", "work_idx", "state", "attempts", "source", "draw", "pending_since"],
            select(literal(qid), literal(epoch), pos + (start + k), w, literal(PENDING), literal(0), src, at,
                   b.now())
            .select_from(t)))


def _move_streams(conn: Connection, qid: int, sources: Sequence[Source], cursor: Sequence[int],
                  taken: Sequence[Collection[int]]) -> None:
    """Store each source's next position and the held positions at or after it (usually none:
    no query of the item rows is needed to draw the next epoch)."""
    for s, c, held in zip(sources, cursor, taken):
        skip = tuple(sorted(p for p in held if p >= c))
        if c != s.drawn or skip != s.skip:
            conn.execute(update(sources_t).where(sources_t.c.queue_id == qid, sources_t.c.idx == s.idx)
                         .values(drawn=c, skip=json.dumps(skip) if skip else None))


def _record(conn: Connection, qid: int, sources: Sequence[Source], weights: Sequence[float], by: str,
            epoch: int, seq: int, redrawn: int) -> None:
    conn.execute(insert(mixes).values(
        queue_id=qid, at=dt.datetime.now(dt.timezone.utc), by=by[:300],
        weights=json.dumps({s.name: round(w, 12) for s, w in zip(sources, weights)}),
        epoch=epoch, seq=seq, redrawn=redrawn))
