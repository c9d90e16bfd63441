"""work bounds: how a sliced work's item reads exactly its records

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 04:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_works', sa.Column('bounds', sa.Text(), nullable=True), schema=_schema())


def downgrade() -> None:
    # A plain ALTER TABLE ... DROP COLUMN (SQLite 3.35+): a batch copy of wq_works would have to
    # drop and recreate the wq_audit view that reads it.
    op.drop_column('wq_works', 'bounds', schema=_schema())
