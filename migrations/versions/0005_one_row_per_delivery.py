"""one history row per delivery: a claim writes no wq_events row; the row that ends the delivery
carries its claimed_at and attempt, and wq_history makes the 'claim' rows from them

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 21:30:00

Converting the history, per item in id order (``_fold``): each ``claim`` row is folded into the
row that ends its delivery (``done``, ``release``, ``fail``, ``expire``, ``recover``, or the
``requeue`` of a claimed item), which gets the claim's time as ``claimed_at`` and the attempts
counted before it as ``attempt``; a delivery begun by a ``recover`` keeps the claim's time, as
``wq_items.claimed_at`` does. A claim whose delivery has not ended and whose item is still claimed
by it (same worker and token) is dropped: the item row shows it. Any other claim without an
ending row (its end was never recorded) stays, as a ``claim`` row with ``claimed_at`` = its time,
so that no delivery is lost. Downgrade writes the claim rows back and renumbers the history's ids
in the order the old code wrote them (a claim before the row that ended its delivery).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Optional

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

# Frozen copies of wq_history at revisions 0004 (as made by 0001) and 0005.
OLD_HISTORY = """
SELECT q.name AS queue, e.epoch AS epoch, e.seq AS seq, e.kind AS kind,
       wk.name AS worker, e.at AS at, e.detail AS detail, e.item_id AS item_id, e.id AS event_id
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
"""
NEW_HISTORY = """
SELECT q.name AS queue, e.epoch AS epoch, e.seq AS seq, e.kind AS kind,
       wk.name AS worker, e.at AS at, e.detail AS detail, e.item_id AS item_id, e.id AS event_id
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
UNION ALL
SELECT q.name, e.epoch, e.seq, 'claim', wk.name, e.claimed_at, NULL, e.item_id,
       e.id - CAST(0.5 AS DOUBLE PRECISION)
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
WHERE e.claimed_at IS NOT NULL AND e.kind <> 'claim'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = e.queue_id
                AND p.item_id = e.item_id AND p.id < e.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
UNION ALL
SELECT q.name, i.epoch, i.seq, 'claim', wk.name, i.claimed_at, NULL, i.id,
       (SELECT COALESCE(MAX(x.id), 0) FROM {s}wq_events x) + CAST(0.5 AS DOUBLE PRECISION)
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
WHERE i.state = 'claimed'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = i.queue_id
                AND p.item_id = i.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
"""

ENDINGS = ('done', 'release', 'fail', 'expire', 'recover', 'requeue')
ITEMS_PER_CHUNK = 20_000


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def _prefix() -> str:
    schema = _schema()
    return f'"{schema}".' if schema else ""


def _item_chunks(conn: Any, p: str) -> Iterator[tuple[int, int, int]]:
    """(queue_id, first item_id, last item_id) ranges of the history, ITEMS_PER_CHUNK items each."""
    for qid, in conn.execute(sa.text(f"SELECT DISTINCT queue_id FROM {p}wq_events ORDER BY queue_id")).all():
        ids = [r[0] for r in conn.execute(sa.text(
            f"SELECT DISTINCT item_id FROM {p}wq_events WHERE queue_id = :q ORDER BY item_id"), {"q": qid})]
        for k in range(0, len(ids), ITEMS_PER_CHUNK):
            part = ids[k:k + ITEMS_PER_CHUNK]
            yield qid, part[0], part[-1]


class _Item:
    __slots__ = ("state", "worker_id", "token")

    def __init__(self, state: str, worker_id: Optional[int], token: Optional[int]) -> None:
        self.state, self.worker_id, self.token = state, worker_id, token


def _fold(events: Sequence[Any], item: Optional[Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """One item's old history (rows ``id, kind, worker_id, token, at, detail`` in id order; the
    item row ``state, worker_id, token`` or None) -> (updates ``{id, c, a}`` of the rows that end
    deliveries or stay as claims, ids of the claim rows to delete)."""
    updates: list[dict[str, Any]] = []
    deleted: list[int] = []
    open_: Optional[Any] = None      # the claim or recover row that began the open delivery
    claimed_at: Any = None           # its claim's time (a recovery keeps it)
    attempts = 0                     # wq_items.attempts as the old code moved it
    last_end: Optional[str] = None
    for ev in events:
        if ev.kind == 'claim':
            if open_ is not None and open_.kind == 'claim':
                # The open delivery's end was never recorded: keep its claim.
                updates.append({"id": open_.id, "c": open_.at, "a": attempts})
            elif open_ is not None:
                # A recovered delivery whose end was never recorded (the old code wrote a
                # recover and the next claim's rows only with an end between them). The view
                # makes no claim after a recover row, so this claim stays stored, and its
                # ending row gets no claimed_at lest the view make it a second time.
                updates.append({"id": ev.id, "c": ev.at, "a": attempts})
                open_, claimed_at = None, None
                continue
            open_, claimed_at = ev, ev.at
            continue
        if ev.kind not in ENDINGS:
            continue
        if open_ is None:
            # No delivery open: a requeue of a done or failed item (from failed: attempts start
            # over), or an end whose claim is gone; neither is a delivery the view can show.
            if ev.kind == 'requeue' and last_end in ('fail', 'expire'):
                attempts = 0
            last_end = ev.kind
            continue
        updates.append({"id": ev.id, "c": claimed_at, "a": attempts})
        if open_.kind == 'claim':
            deleted.append(open_.id)
        if ev.kind in ('fail', 'expire', 'recover'):
            attempts += 1
        open_ = None
        if ev.kind == 'recover':
            open_ = ev  # the restarted worker's delivery begins here, with the same claimed_at
        last_end = ev.kind
    if open_ is not None and open_.kind == 'claim':
        if (item is not None and item.state == 'claimed' and item.worker_id == open_.worker_id
                and (open_.token is None or item.token == open_.token)):
            deleted.append(open_.id)  # in flight: the item row shows it
        else:
            updates.append({"id": open_.id, "c": open_.at, "a": attempts})
    return updates, deleted


def upgrade() -> None:
    p, schema = _prefix(), _schema()
    conn = op.get_bind()
    op.execute(f"DROP VIEW IF EXISTS {p}wq_history")
    op.add_column('wq_events', sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=True), schema=schema)
    op.add_column('wq_events', sa.Column('attempt', sa.Integer(), nullable=True), schema=schema)
    if op.get_context().as_sql:
        # Offline (--sql): the conversion below reads the history, which a script cannot.
        op.execute("-- wq_events: history written before 0005 is NOT converted by this script; "
                   "upgrade online (python -m wq_sql upgrade) where wq_events has rows")
        chunks: list[tuple[int, int, int]] = []
    else:
        chunks = list(_item_chunks(conn, p))
    for qid, lo, hi in chunks:
        rows = conn.execute(sa.text(
            f"SELECT e.id, e.item_id, e.kind, e.worker_id, e.token, e.at, e.detail, "
            f"i.state AS i_state, i.worker_id AS i_worker, i.token AS i_token "
            f"FROM {p}wq_events e LEFT JOIN {p}wq_items i ON i.id = e.item_id "
            f"WHERE e.queue_id = :q AND e.item_id BETWEEN :lo AND :hi ORDER BY e.item_id, e.id"),
            {"q": qid, "lo": lo, "hi": hi}).all()
        updates: list[dict[str, Any]] = []
        deleted: list[int] = []
        k = 0
        while k < len(rows):
            j = k
            while j < len(rows) and rows[j].item_id == rows[k].item_id:
                j += 1
            r = rows[k]
            item = _Item(r.i_state, r.i_worker, r.i_token) if r.i_state is not None else None
            u, d = _fold(rows[k:j], item)
            updates += u
            deleted += d
            k = j
        if updates:
            conn.execute(sa.text(f"UPDATE {p}wq_events SET claimed_at = :c, attempt = :a WHERE id = :id"), updates)
        for k in range(0, len(deleted), 500):
            conn.execute(sa.text(f"DELETE FROM {p}wq_events WHERE id IN ({', '.join(map(str, deleted[k:k + 500]))})"))
    op.execute(f"CREATE VIEW {p}wq_history AS {NEW_HISTORY.format(s=p)}")


def downgrade() -> None:
    p, schema = _prefix(), _schema()
    if op.get_context().as_sql:
        raise NotImplementedError("downgrade from 0005 rewrites the history: run it online")
    conn = op.get_bind()
    op.execute(f"DROP VIEW IF EXISTS {p}wq_history")
    cols = "queue_id, item_id, epoch, seq, kind, worker_id, token, at, detail"
    rows = conn.execute(sa.text(f"SELECT id, {cols}, claimed_at FROM {p}wq_events ORDER BY id")).all()
    last_kind: dict[int, str] = {}
    out: list[dict[str, Any]] = []
    for r in rows:
        if r.claimed_at is not None and r.kind != 'claim' and last_kind.get(r.item_id) != 'recover':
            out.append({"queue_id": r.queue_id, "item_id": r.item_id, "epoch": r.epoch, "seq": r.seq,
                        "kind": 'claim', "worker_id": r.worker_id, "token": r.token, "at": r.claimed_at,
                        "detail": None})
        out.append({c: getattr(r, c) for c in cols.split(", ")})
        last_kind[r.item_id] = r.kind
    for i in conn.execute(sa.text(
            f"SELECT id, queue_id, epoch, seq, worker_id, token, claimed_at FROM {p}wq_items "
            f"WHERE state = 'claimed' ORDER BY claimed_at, id")).all():
        if last_kind.get(i.id) != 'recover':
            out.append({"queue_id": i.queue_id, "item_id": i.id, "epoch": i.epoch, "seq": i.seq,
                        "kind": 'claim', "worker_id": i.worker_id, "token": i.token, "at": i.claimed_at,
                        "detail": None})
    conn.execute(sa.text(f"DELETE FROM {p}wq_events"))
    for n, row in enumerate(out, 1):
        row["id"] = n
    params = ", ".join(f":{c}" for c in cols.split(", "))
    for k in range(0, len(out), 10_000):
        conn.execute(sa.text(f"INSERT INTO {p}wq_events (id, {cols}) VALUES (:id, {params})"), out[k:k + 10_000])
    if conn.dialect.name == "postgresql":
        seq = f"{schema}.wq_events" if schema else "wq_events"
        conn.execute(sa.text("SELECT setval(pg_get_serial_sequence(:t, 'id'), "
                             f"(SELECT COALESCE(MAX(id), 0) + 1 FROM {p}wq_events), false)"), {"t": seq})
    op.drop_column('wq_events', 'attempt', schema=schema)
    op.drop_column('wq_events', 'claimed_at', schema=schema)
    op.execute(f"CREATE VIEW {p}wq_history AS {OLD_HISTORY.format(s=p)}")
