"""pending since: each item row holds when it was made claimable (its epoch's rows written),
for the age of the oldest pending item

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 21:45:00

No row changes: rows made before this revision hold NULL, and the age of a queue whose first
pending row is one of them counts from the queue's creation.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    op.add_column('wq_items', sa.Column('pending_since', sa.DateTime(timezone=True), nullable=True), schema=_schema())


def downgrade() -> None:
    op.drop_column('wq_items', 'pending_since', schema=_schema())
