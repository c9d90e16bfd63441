"""input wait: each worker row holds the seconds its process's training loop waited for data,
summed, as its heartbeat last sent it (NULL: not measured)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_workers', sa.Column('input_wait', sa.Float(), nullable=True), schema=_schema())


def downgrade() -> None:
    op.drop_column('wq_workers', 'input_wait', schema=_schema())
