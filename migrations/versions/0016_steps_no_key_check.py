"""Postgres: no foreign key check on wq_steps.queue_id (lineage rows are written in the
acknowledgement transactions, the hot path: decision 3, as revision 0009 did for wq_events)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 22:25:00

Each row's check is a trigger that runs a query and takes a ``KEY SHARE`` lock on the queue's
row, which every rank's acknowledgements would lock at once. wq_sql writes the column from the
queue it has open and deletes a queue's lineage before the queue (``statements.drop_queue``,
``reset_queue``). No row changes: the constraint is dropped, and the downgrade adds it back,
checking every row. SQLite: nothing (its check locks nothing).
"""

from __future__ import annotations

from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

KEY = ("fk_wq_steps_queue_id_wq_queues", "wq_steps", "queue_id", "wq_queues", "CASCADE")


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.drop_constraint(KEY[0], KEY[1], type_="foreignkey", schema=_schema())


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    name, table, column, referred, ondelete = KEY
    op.create_foreign_key(name, table, referred, [column], ["id"], ondelete=ondelete,
                          source_schema=_schema(), referent_schema=_schema())
