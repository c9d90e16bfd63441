"""checkpoints: items done by a model checkpoint carry its step; saves and restores are recorded

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_items', sa.Column('ckpt_step', sa.BigInteger(), nullable=True), schema=_schema())
    op.create_table('wq_checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('worker_id', sa.Integer(), nullable=False),
    sa.Column('action', sa.String(length=10), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=True),
    sa.Column('items', sa.Integer(), nullable=False),
    sa.Column('ambiguous', sa.Integer(), server_default='0', nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("action IN ('save', 'restore')", name=op.f('ck_wq_checkpoints_action')),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_checkpoints_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wq_checkpoints'))
    )
    op.create_index('ix_wq_checkpoints_queue_worker', 'wq_checkpoints', ['queue_id', 'worker_id', 'step'], unique=False)


def downgrade() -> None:
    op.drop_table('wq_checkpoints')  # and its index (an unqualified DROP INDEX would follow search_path)
    # A plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+): a batch copy of wq_items would have to
    # drop and recreate the wq_audit view that reads it.
    op.drop_column('wq_items', 'ckpt_step', schema=_schema())
