"""Postgres: no foreign key checks on the hot path (the claiming worker's row, the queue's row)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 20:10:00

Drops two foreign keys on Postgres: ``wq_items.worker_id -> wq_workers`` (checked at every claim,
which sets the column) and ``wq_events.queue_id -> wq_queues`` (checked at every history row,
one per delivery). Each check is a trigger that runs a query and takes a ``KEY SHARE`` lock on the
parent row. Every worker's acknowledgements locked the same queue row at once, so Postgres made
a new MultiXact for nearly every claim round (1,957 for the 2,000 rounds of 8 workers draining
8,000 items), and the checks took about a fifth of a round's server CPU (47.5 against 37.5 us
per item claimed and acknowledged in rounds of 256, medians of 5: bench/pg_hot_keys.py). wq_sql writes both columns only from rows it has
just read in the same transaction, and deletes children before parents (``ops.drop_queue``,
``ops.reset_queue``), so nothing else changes. No row changes either: the constraints are
dropped, and the downgrade adds them back, checking every row.

SQLite: nothing. Its checks lock nothing and cost ~2% of a round; the models declare these two
keys for SQLite only (``models.SQLITE_ONLY_FOREIGN_KEYS``).
"""

from __future__ import annotations

from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

# (constraint, table, column, referred table, ON DELETE)
KEYS = [
    ("fk_wq_items_worker_id_wq_workers", "wq_items", "worker_id", "wq_workers", "SET NULL"),
    ("fk_wq_events_queue_id_wq_queues", "wq_events", "queue_id", "wq_queues", "CASCADE"),
]


def _schema() -> str | None:
    # ALTER TABLE names its table by string, which schema_translate_map does not rewrite.
    return op.get_context().version_table_schema


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for name, table, _, _, _ in KEYS:
        op.drop_constraint(name, table, type_="foreignkey", schema=_schema())


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    for name, table, column, referred, ondelete in KEYS:
        op.create_foreign_key(name, table, referred, [column], ["id"], ondelete=ondelete,
                              source_schema=_schema(), referent_schema=_schema())
