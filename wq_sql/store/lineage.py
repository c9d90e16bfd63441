"""Lineage rows (``wq_steps``): the driver-level insert that the trainer side's
acknowledgement transaction carries (:class:`StepWriter`), and the reads of ``wq-sql trace``
and of replay. What a row means: ``wq_sql.store.models.StepRecord``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, cast

from sqlalchemy import Connection, Table, and_, func, select

from wq_sql.store.dialects import Dialect, pg_bigints, qualifier
from wq_sql.store.models import Item, Queue, StepRecord, Work

steps = cast(Table, StepRecord.__table__)
items = cast(Table, Item.__table__)
works = cast(Table, Work.__table__)
queues = cast(Table, Queue.__table__)

Row = tuple[int, int, int, int, int]  # (step, part, item id, first record, last record)


class Steps(NamedTuple):
    """Lineage rows of one rank (``worker``) and run, for one acknowledgement transaction."""

    worker: str
    run: int
    rows: Sequence[Row]


class StepWriter:
    """The insert of :class:`Steps`, on a DBAPI connection inside a transaction that is open
    (the acknowledgement's). A row already there (the same rank, run, step and item) is kept."""

    def __init__(self, b: Dialect, schema: Optional[str] = None) -> None:
        p = qualifier(schema)
        self._sqlite = b.is_sqlite
        if b.is_sqlite:
            self._sql = (f"INSERT OR IGNORE INTO {p}wq_steps (queue_id, worker, run, step, part, "
                         "item_id, first_record, last_record) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
        else:
            self._sql = (
                f"INSERT INTO {p}wq_steps (queue_id, worker, run, step, part, item_id, first_record, "
                "last_record) SELECT %(q)s, %(w)s, %(r)s, t.s, t.p, t.i, t.f, t.l "
                "FROM unnest(%(s)s::bigint[], %(p)s::int[], %(i)s::bigint[], %(f)s::bigint[], "
                "%(l)s::bigint[]) AS t(s, p, i, f, l) "
                "ON CONFLICT DO NOTHING")

    def text(self, conn: Any, qid: int, s: Steps) -> str:
        """Postgres: the insert of ``s`` as literal SQL with its ``;``, to go first in a simple
        query that runs other statements with parameters (its ``%`` doubled for them):
        the claim round's, so the rows ride in its transaction with no round trip of their own."""
        assert not self._sqlite
        if not s.rows:
            return ""
        cur = conn.cursor()
        try:
            sql = cur.mogrify(self._sql, self._params(qid, s))
        finally:
            cur.close()
        return (sql.decode() if isinstance(sql, bytes) else sql).replace("%", "%%") + "; "

    def _params(self, qid: int, s: Steps) -> dict[str, Any]:
        # Array literals as text (pg_bigints): psycopg2 adapts a list element by element.
        cols = list(zip(*s.rows))
        return {"q": qid, "w": s.worker, "r": s.run, "s": pg_bigints(cols[0]), "p": pg_bigints(cols[1]),
                "i": pg_bigints(cols[2]), "f": pg_bigints(cols[3]), "l": pg_bigints(cols[4])}

    def write(self, conn: Any, qid: int, s: Steps) -> None:
        if not s.rows:
            return
        cur = conn.cursor()
        try:
            if self._sqlite:
                cur.executemany(self._sql, [(qid, s.worker, s.run, *r) for r in s.rows])
            else:
                cur.execute(self._sql, self._params(qid, s))
        finally:
            cur.close()


def next_run(conn: Connection, qid: int, worker: str) -> int:
    """The run number the next lineage rows of ``worker`` take: one more than its last."""
    last = conn.execute(select(func.max(steps.c.run))
                        .where(steps.c.queue_id == qid, steps.c.worker == worker)).scalar()
    return 1 if last is None else int(last) + 1


class Recorded(NamedTuple):
    """What lineage holds for one rank and run: its steps' range and its row count."""

    worker: str
    run: int
    first_step: int
    last_step: int
    rows: int


def recorded(conn: Connection, qid: int) -> list[Recorded]:
    """Every rank and run with lineage rows in the queue, in (worker, run) order."""
    q = (select(steps.c.worker, steps.c.run, func.min(steps.c.step), func.max(steps.c.step), func.count())
         .where(steps.c.queue_id == qid).group_by(steps.c.worker, steps.c.run)
         .order_by(steps.c.worker, steps.c.run))
    return [Recorded(w, int(r), int(a), int(b), int(n)) for w, r, a, b, n in conn.execute(q)]


class Traced(NamedTuple):
    """One lineage row with its item: what ``wq-sql trace`` prints and replay reads."""

    worker: str
    run: int
    step: int
    epoch: int
    seq: int
    work: str
    first_record: int
    last_record: int
    checkpoint: Optional[int]
    item_id: int
    bounds: Optional[str]
    handed: str  # the work as handed out: with the queue's prefix


def traced(conn: Connection, qid: int, *, worker: Optional[str] = None, run: Optional[int] = None,
           steps_from: Optional[int] = None, steps_to: Optional[int] = None,
           checkpoint: Optional[int] = None, work_idxs: Optional[Sequence[int]] = None) -> list[Traced]:
    """Lineage rows of queue ``qid`` with their items, in (worker, run, step, part) order: a
    rank's, a run's, steps ``steps_from`` .. ``steps_to - 1``, the items a
    checkpoint's step covered, or the items of some works."""
    on_item = and_(items.c.id == steps.c.item_id)
    on_work = and_(works.c.queue_id == items.c.queue_id, works.c.idx == items.c.work_idx)
    q = (select(steps.c.worker, steps.c.run, steps.c.step, items.c.epoch, items.c.seq, works.c.work,
                steps.c.first_record, steps.c.last_record, items.c.ckpt_step, steps.c.item_id, works.c.bounds,
                queues.c.prefix)
         .select_from(steps.join(items, on_item).join(works, on_work)
                      .join(queues, queues.c.id == steps.c.queue_id))
         .where(steps.c.queue_id == qid))
    if worker is not None:
        q = q.where(steps.c.worker == worker)
    if run is not None:
        q = q.where(steps.c.run == run)
    if steps_from is not None:
        q = q.where(steps.c.step >= steps_from)
    if steps_to is not None:
        q = q.where(steps.c.step < steps_to)
    if checkpoint is not None:
        q = q.where(items.c.ckpt_step == checkpoint)
    if work_idxs is not None:
        q = q.where(items.c.work_idx.in_(list(work_idxs)))
    q = q.order_by(steps.c.worker, steps.c.run, steps.c.step, steps.c.part)
    return [Traced(r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), r[5], int(r[6]), int(r[7]),
                   None if r[8] is None else int(r[8]), int(r[9]), r[10], (r[11] or "") + r[5])
            for r in conn.execute(q)]


def checkpoints_recorded(conn: Connection, qid: int) -> list[int]:
    """The checkpoint steps that covered items with lineage rows."""
    q = (select(items.c.ckpt_step).distinct().select_from(steps.join(items, items.c.id == steps.c.item_id))
         .where(steps.c.queue_id == qid, items.c.ckpt_step.is_not(None)).order_by(items.c.ckpt_step))
    return [int(s) for (s,) in conn.execute(q)]


def work_indexes(conn: Connection, qid: int, work: str, prefix: Optional[str]) -> list[int]:
    """The indexes of the works stored as ``work``, or handed out as ``work`` (with ``prefix``)."""
    names = [work]
    if prefix and work.startswith(prefix):
        names.append(work[len(prefix):])
    q = select(works.c.idx).where(works.c.queue_id == qid, works.c.work.in_(names)).order_by(works.c.idx)
    return [int(i) for (i,) in conn.execute(q)]
