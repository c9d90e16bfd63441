"""worker liveness: each worker row says how often it beats and how many claimed items it holds
not yet handed out

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_workers', sa.Column('beat_seconds', sa.Float(), nullable=True), schema=_schema())
    op.add_column('wq_workers', sa.Column('buffered', sa.Integer(), nullable=True), schema=_schema())


def downgrade() -> None:
    op.drop_column('wq_workers', 'buffered', schema=_schema())
    op.drop_column('wq_workers', 'beat_seconds', schema=_schema())
