"""worker runs: each worker row names the job run it belongs to and the run's restart count, so
that a restarted job (torchrun) returns its previous incarnation's items at once

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 21:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_workers', sa.Column('run_id', sa.String(length=200), nullable=True), schema=_schema())
    op.add_column('wq_workers', sa.Column('run_restart', sa.Integer(), nullable=True), schema=_schema())


def downgrade() -> None:
    op.drop_column('wq_workers', 'run_restart', schema=_schema())
    op.drop_column('wq_workers', 'run_id', schema=_schema())
