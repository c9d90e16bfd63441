"""lineage: wq_steps, one row per training step of a rank and item its batch held (with the
range of the item's records), written by the shims with lineage=True; the view wq_lineage

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02 20:00:00

No row changes: a queue trained without lineage has no wq_steps rows.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

# A frozen copy of the view (the models hold the live text).
LINEAGE = """
SELECT q.name AS queue, l.run AS run, l.worker AS worker, l.step AS step, l.part AS part,
       i.epoch AS epoch, i.seq AS seq, w.work AS work, l.first_record AS first_record,
       l.last_record AS last_record, i.ckpt_step AS checkpoint, l.item_id AS item_id
FROM {s}wq_steps l
JOIN {s}wq_queues q ON q.id = l.queue_id
JOIN {s}wq_items i ON i.id = l.item_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
"""


def _prefix() -> str:
    schema = op.get_context().version_table_schema
    return f'"{schema}".' if schema else ""


def upgrade() -> None:
    op.create_table('wq_steps',
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=200), nullable=False),
    sa.Column('run', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('part', sa.Integer(), nullable=False),
    sa.Column('item_id', sa.BigInteger(), nullable=False),
    sa.Column('first_record', sa.BigInteger(), nullable=False),
    sa.Column('last_record', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_steps_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('queue_id', 'worker', 'run', 'step', 'part', name=op.f('pk_wq_steps'))
    )
    op.create_index('ix_wq_steps_item', 'wq_steps', ['item_id'], unique=False)
    p = _prefix()
    op.execute(f"CREATE VIEW {p}wq_lineage AS {LINEAGE.format(s=p)}")


def downgrade() -> None:
    op.execute(f"DROP VIEW IF EXISTS {_prefix()}wq_lineage")
    op.drop_index('ix_wq_steps_item', table_name='wq_steps')
    op.drop_table('wq_steps')
