"""initial schema: queues, works, workers, items, tallies, events and the audit views

Revision ID: 0001
Revises:
Create Date: 2026-11-22 01:00:49.187398
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

# Frozen copies of the view definitions at this revision (a later revision that changes a view
# drops and recreates it with its own copy).
VIEWS = {
    "wq_audit": """
SELECT q.name AS queue, i.epoch AS epoch, i.seq AS seq, w.work AS work,
       wk.name AS worker, i.state AS state, i.attempts AS attempts,
       i.claimed_at AS claimed_at, i.done_at AS done_at, i.last_error AS last_error,
       i.id AS item_id
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
""",
    "wq_history": """
SELECT q.name AS queue, e.epoch AS epoch, e.seq AS seq, e.kind AS kind,
       wk.name AS worker, e.at AS at, e.detail AS detail, e.item_id AS item_id, e.id AS event_id
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
""",
}


def _prefix() -> str:
    schema = op.get_context().version_table_schema
    return f'"{schema}".' if schema else ""


def upgrade() -> None:
    op.create_table('wq_queues',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('works_digest', sa.String(length=64), nullable=False),
    sa.Column('n_works', sa.Integer(), nullable=False),
    sa.Column('num_epochs', sa.BigInteger(), nullable=False),
    sa.Column('shuffle', sa.Boolean(), nullable=False),
    sa.Column('seed', sa.BigInteger(), nullable=False),
    sa.Column('num_slices', sa.Integer(), nullable=True),
    sa.Column('prefix', sa.Text(), nullable=True),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('epochs_created', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_queues')),
    sa.UniqueConstraint('name', name=op.f('uq_wq_queues_name'))
    )
    op.create_table('wq_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('item_id', sa.BigInteger(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=True),
    sa.Column('token', sa.BigInteger(), nullable=True),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.CheckConstraint("kind IN ('claim', 'done', 'release', 'fail', 'expire', 'recover', 'requeue')", name=op.f('ck_wq_events_kind')),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_events_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_events'))
    )
    op.create_index('ix_wq_events_queue_item', 'wq_events', ['queue_id', 'item_id'], unique=False)
    op.create_table('wq_tallies',
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=False),
    sa.Column('n_done', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('n_failed', sa.BigInteger(), server_default='0', nullable=False),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_tallies_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('queue_id', 'epoch', 'worker_id', name=op.f('pk_wq_tallies'))
    )
    op.create_table('wq_workers',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('incarnation', sa.String(length=32), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('proc_start', sa.BigInteger(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_workers_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_workers')),
    sa.UniqueConstraint('queue_id', 'name', name=op.f('uq_wq_workers_queue_id'))
    )
    op.create_table('wq_works',
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('work', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_works_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('queue_id', 'idx', name=op.f('pk_wq_works'))
    )
    op.create_table('wq_items',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('work_idx', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=10), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=True),
    sa.Column('token', sa.BigInteger(), nullable=True),
    sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('done_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'claimed', 'done', 'failed')", name=op.f('ck_wq_items_state')),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_items_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['worker_id'], ['wq_workers.id'], name=op.f('fk_wq_items_worker_id_wq_workers'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_items')),
    sa.UniqueConstraint('queue_id', 'epoch', 'seq', name=op.f('uq_wq_items_queue_id'))
    )
    op.create_index('ix_wq_items_claimed', 'wq_items', ['queue_id', 'worker_id', 'lease_until'], unique=False, sqlite_where=sa.text("state = 'claimed'"), postgresql_where=sa.text("state = 'claimed'"))
    op.create_index('ix_wq_items_pending', 'wq_items', ['queue_id', 'epoch', 'seq'], unique=False, sqlite_where=sa.text("state = 'pending'"), postgresql_where=sa.text("state = 'pending'"))
    p = _prefix()
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {p}{name} AS {body.format(s=p)}")
    if op.get_bind().dialect.name == "postgresql":
        # Claimed and done rows leave dead entries in the pending index until VACUUM; vacuum this
        # hot table early instead of at the default 20% of its size.
        op.execute(f"ALTER TABLE {p}wq_items SET (autovacuum_vacuum_scale_factor = 0.01, "
                   "autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_cost_delay = 0, "
                   "autovacuum_vacuum_insert_scale_factor = 0.05)")


def downgrade() -> None:
    p = _prefix()
    for name in VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {p}{name}")
    op.drop_index('ix_wq_items_pending', table_name='wq_items', sqlite_where=sa.text("state = 'pending'"), postgresql_where=sa.text("state = 'pending'"))
    op.drop_index('ix_wq_items_claimed', table_name='wq_items', sqlite_where=sa.text("state = 'claimed'"), postgresql_where=sa.text("state = 'claimed'"))
    op.drop_table('wq_items')
    op.drop_table('wq_works')
    op.drop_table('wq_workers')
    op.drop_table('wq_tallies')
    op.drop_index('ix_wq_events_queue_item', table_name='wq_events')
    op.drop_table('wq_events')
    op.drop_table('wq_queues')
