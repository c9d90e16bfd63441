"""weighted sources: wq_sources (names, works ranges, weights in force, stream cursors),
wq_mixes (every change of the weights, who and when), and each item row's source and stream
position; wq_audit and wq_history show the source

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 05:00:00

No row changes: queues without sources have NULL in the new columns, as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

# Frozen copies of the views before and after this revision (the models hold the live text).
OLD_AUDIT = """
SELECT q.name AS queue, i.epoch AS epoch, i.seq AS seq, w.work AS work,
       wk.name AS worker, i.state AS state, i.attempts AS attempts,
       i.claimed_at AS claimed_at, i.done_at AS done_at, i.last_error AS last_error,
       i.id AS item_id
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
"""

OLD_HISTORY = """
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

NEW_AUDIT = """
SELECT q.name AS queue, i.epoch AS epoch, i.seq AS seq, w.work AS work,
       wk.name AS worker, i.state AS state, i.attempts AS attempts,
       i.claimed_at AS claimed_at, i.done_at AS done_at, i.last_error AS last_error,
       i.id AS item_id, src.name AS source
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
LEFT JOIN {s}wq_sources src ON src.queue_id = i.queue_id AND src.idx = i.source
"""

NEW_HISTORY = """
SELECT q.name AS queue, e.epoch AS epoch, e.seq AS seq, e.kind AS kind,
       wk.name AS worker, e.at AS at, e.detail AS detail, e.item_id AS item_id, e.id AS event_id,
       src.name AS source
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
LEFT JOIN {s}wq_items si ON si.id = e.item_id
LEFT JOIN {s}wq_sources src ON src.queue_id = e.queue_id AND src.idx = si.source
UNION ALL
SELECT q.name, e.epoch, e.seq, 'claim', wk.name, e.claimed_at, NULL, e.item_id,
       e.id - CAST(0.5 AS DOUBLE PRECISION), src.name
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
LEFT JOIN {s}wq_items si ON si.id = e.item_id
LEFT JOIN {s}wq_sources src ON src.queue_id = e.queue_id AND src.idx = si.source
WHERE e.claimed_at IS NOT NULL AND e.kind <> 'claim'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = e.queue_id
                AND p.item_id = e.item_id AND p.id < e.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
UNION ALL
SELECT q.name, i.epoch, i.seq, 'claim', wk.name, i.claimed_at, NULL, i.id,
       (SELECT COALESCE(MAX(x.id), 0) FROM {s}wq_events x) + CAST(0.5 AS DOUBLE PRECISION),
       src.name
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
LEFT JOIN {s}wq_sources src ON src.queue_id = i.queue_id AND src.idx = i.source
WHERE i.state = 'claimed'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = i.queue_id
                AND p.item_id = i.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
"""


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def _prefix() -> str:
    schema = _schema()
    return f'"{schema}".' if schema else ""


def _views(audit: str, history: str) -> None:
    p = _prefix()
    for name in ("wq_audit", "wq_history"):
        op.execute(f"DROP VIEW IF EXISTS {p}{name}")
    op.execute(f"CREATE VIEW {p}wq_audit AS {audit.format(s=p)}")
    op.execute(f"CREATE VIEW {p}wq_history AS {history.format(s=p)}")


def upgrade() -> None:
    schema = _schema()
    op.add_column('wq_items', sa.Column('source', sa.Integer(), nullable=True), schema=schema)
    op.add_column('wq_items', sa.Column('draw', sa.BigInteger(), nullable=True), schema=schema)
    op.create_table('wq_sources',
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('first', sa.Integer(), nullable=False),
    sa.Column('n_works', sa.Integer(), nullable=False),
    sa.Column('weight', sa.Float(), nullable=False),
    sa.Column('drawn', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('skip', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_sources_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('queue_id', 'idx', name=op.f('pk_wq_sources'))
    )
    op.create_table('wq_mixes',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('by', sa.String(length=300), nullable=False),
    sa.Column('weights', sa.Text(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('redrawn', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_mixes_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_mixes'))
    )
    op.create_index('ix_wq_mixes_queue', 'wq_mixes', ['queue_id', 'id'], unique=False)
    _views(NEW_AUDIT, NEW_HISTORY)


def downgrade() -> None:
    _views(OLD_AUDIT, OLD_HISTORY)
    op.drop_table('wq_mixes')
    op.drop_table('wq_sources')
    # Plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+); the views that read wq_items are the
    # old ones again, which do not name these columns.
    op.drop_column('wq_items', 'draw', schema=_schema())
    op.drop_column('wq_items', 'source', schema=_schema())
