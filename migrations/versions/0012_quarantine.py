"""quarantine: the item state 'quarantined' and the event kind 'quarantine', wq_quarantine (the
works in quarantine, with reason, who and when), wq_tallies.n_quarantined, wq_queues.revoked

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 08:30:00

No row changes on upgrade. The CHECK constraints of ``wq_items.state`` and ``wq_events.kind``
admit the new values (``wq_items.state`` becomes VARCHAR(16): 'quarantined' has 11 letters).
Postgres alters them in place (the views that read ``wq_items.state`` are dropped and made
again around it). SQLite cannot alter a CHECK constraint: each of the two tables is rebuilt,
its stored ``CREATE TABLE`` text with the constraint changed, rows copied, indexes made again
from their stored texts (SQLite's documented procedure for schema changes it has no ALTER for).

Downgrade: quarantined rows go back to pending and the 'quarantine' history rows become
'requeue' rows (their detail kept), then the old constraints come back.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

OLD_STATES = "('pending', 'claimed', 'done', 'failed')"
NEW_STATES = "('pending', 'claimed', 'done', 'failed', 'quarantined')"
OLD_KINDS = "('claim', 'done', 'release', 'fail', 'expire', 'recover', 'requeue')"
NEW_KINDS = "('claim', 'done', 'release', 'fail', 'expire', 'recover', 'requeue', 'quarantine')"

# The two tables as 0011 leaves them on SQLite: what an offline ``upgrade --sql`` (which cannot
# read sqlite_master) rebuilds from.
FROZEN_0011 = {
    "wq_items": ("""CREATE TABLE wq_items (
    id INTEGER NOT NULL,
    queue_id INTEGER NOT NULL,
    epoch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    work_idx INTEGER NOT NULL,
    state VARCHAR(10) DEFAULT 'pending' NOT NULL,
    attempts INTEGER DEFAULT '0' NOT NULL,
    worker_id INTEGER,
    token BIGINT,
    claimed_at DATETIME,
    lease_until DATETIME,
    done_at DATETIME,
    last_error TEXT, ckpt_step BIGINT, source INTEGER, draw BIGINT,
    CONSTRAINT pk_wq_items PRIMARY KEY (id),
    CONSTRAINT ck_wq_items_state CHECK (state IN ('pending', 'claimed', 'done', 'failed')),
    CONSTRAINT fk_wq_items_queue_id_wq_queues FOREIGN KEY(queue_id) REFERENCES wq_queues (id) ON DELETE CASCADE,
    CONSTRAINT fk_wq_items_worker_id_wq_workers FOREIGN KEY(worker_id) REFERENCES wq_workers (id) ON DELETE SET NULL,
    CONSTRAINT uq_wq_items_queue_id UNIQUE (queue_id, epoch, seq)
)""", ["CREATE INDEX ix_wq_items_claimed ON wq_items (queue_id, worker_id, lease_until) WHERE state = 'claimed'",
       "CREATE INDEX ix_wq_items_pending ON wq_items (queue_id, epoch, seq) WHERE state = 'pending'"]),
    "wq_events": ("""CREATE TABLE wq_events (
    id INTEGER NOT NULL,
    queue_id INTEGER NOT NULL,
    item_id BIGINT NOT NULL,
    epoch INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    kind VARCHAR(10) NOT NULL,
    worker_id INTEGER,
    token BIGINT,
    at DATETIME NOT NULL,
    detail TEXT, claimed_at DATETIME, attempt INTEGER,
    CONSTRAINT pk_wq_events PRIMARY KEY (id),
    CONSTRAINT ck_wq_events_kind CHECK (kind IN ('claim', 'done', 'release', 'fail', 'expire', 'recover', 'requeue')),
    CONSTRAINT fk_wq_events_queue_id_wq_queues FOREIGN KEY(queue_id) REFERENCES wq_queues (id) ON DELETE CASCADE
)""", ["CREATE INDEX ix_wq_events_queue_item ON wq_events (queue_id, item_id)"]),
}


def _module(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema() -> str | None:
    return op.get_context().version_table_schema


def _prefix() -> str:
    schema = _schema()
    return f'"{schema}".' if schema else ""


def _drop_views() -> None:
    for name in ("wq_audit", "wq_history"):
        op.execute(f"DROP VIEW IF EXISTS {_prefix()}{name}")


def _make_views() -> None:
    m10 = _module("wq_sql_migration_0010", "0010_weighted_sources.py")  # the views are 0010's
    p = _prefix()
    op.execute(f"CREATE VIEW {p}wq_audit AS {m10.NEW_AUDIT.format(s=p)}")
    op.execute(f"CREATE VIEW {p}wq_history AS {m10.NEW_HISTORY.format(s=p)}")


def _edited(sql: str, edits: list[tuple[str, str]]) -> str:
    for old, replacement in edits:
        assert sql.count(old) == 1, f"the stored table text does not hold {old!r} once"
        sql = sql.replace(old, replacement)
    return sql


def _sqlite_rebuild(table: str, edits: list[tuple[str, str]], *, upgrading: bool) -> None:
    """Rebuild SQLite ``table`` with its stored ``CREATE TABLE`` text changed by ``edits`` (each
    ``(old, new)`` must occur exactly once), keeping its rows and indexes. Offline, the text is
    the frozen one of 0011 (on the way down: with the upgrade's edits made)."""
    if op.get_context().as_sql:
        sql, indexes = FROZEN_0011[table]
        if not upgrading:
            sql = _edited(sql, [(new, old) for old, new in edits])
    else:
        conn = op.get_bind()
        sql = conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).scalar_one()
        indexes = [r[0] for r in conn.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT NULL",
            (table,))]
    # A table made by an earlier rebuild is stored with its name quoted (SQLite's RENAME does so).
    head = re.match(rf'CREATE TABLE "?{table}"? \(', sql)
    assert head, f"{table}'s stored text is not the one this was written for"
    new = _edited(f"CREATE TABLE _new_{table} (" + sql[head.end():], edits)
    op.execute(new)
    op.execute(f"INSERT INTO _new_{table} SELECT * FROM {table}")  # same columns, same order
    op.execute(f"DROP TABLE {table}")
    op.execute(f"ALTER TABLE _new_{table} RENAME TO {table}")
    for index in indexes:
        op.execute(index)


def _constraints(was: tuple[str, str, str], states: str, kinds: str, state_type: str) -> None:
    """The constraints go from ``was`` (states, kinds, state type) to the ones given."""
    if op.get_context().dialect.name == "sqlite":
        old_states, old_kinds, old_type = was
        upgrading = old_type == "VARCHAR(10)"
        _sqlite_rebuild("wq_items", [(f"state IN {old_states}", f"state IN {states}"),
                                     (f"state {old_type}", f"state {state_type}")], upgrading=upgrading)
        _sqlite_rebuild("wq_events", [(f"kind IN {old_kinds}", f"kind IN {kinds}")], upgrading=upgrading)
        return
    p = _prefix()
    op.execute(f"ALTER TABLE {p}wq_items ALTER COLUMN state TYPE {state_type}")
    op.execute(f"ALTER TABLE {p}wq_items DROP CONSTRAINT ck_wq_items_state")
    op.execute(f"ALTER TABLE {p}wq_items ADD CONSTRAINT ck_wq_items_state CHECK (state IN {states})")
    op.execute(f"ALTER TABLE {p}wq_events DROP CONSTRAINT ck_wq_events_kind")
    op.execute(f"ALTER TABLE {p}wq_events ADD CONSTRAINT ck_wq_events_kind CHECK (kind IN {kinds})")


def upgrade() -> None:
    schema = _schema()
    _drop_views()
    _constraints((OLD_STATES, OLD_KINDS, "VARCHAR(10)"), NEW_STATES, NEW_KINDS, "VARCHAR(16)")
    op.add_column('wq_queues', sa.Column('revoked', sa.BigInteger(), server_default='0', nullable=False),
                  schema=schema)
    op.add_column('wq_tallies', sa.Column('n_quarantined', sa.BigInteger(), server_default='0',
                                          nullable=False), schema=schema)
    op.create_table('wq_quarantine',
    sa.Column('queue_id', sa.Integer(), nullable=False),
    sa.Column('work_idx', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('by', sa.String(length=300), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['queue_id'], ['wq_queues.id'], name=op.f('fk_wq_quarantine_queue_id_wq_queues'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('queue_id', 'work_idx', name=op.f('pk_wq_quarantine')),
    schema=schema,
    )
    _make_views()


def downgrade() -> None:
    schema, p = _schema(), _prefix()
    op.execute(f"UPDATE {p}wq_items SET state = 'pending', token = NULL, lease_until = NULL, attempts = 0 "
               "WHERE state = 'quarantined'")
    op.execute(f"UPDATE {p}wq_events SET kind = 'requeue' WHERE kind = 'quarantine'")
    op.drop_table('wq_quarantine', schema=schema)
    op.drop_column('wq_tallies', 'n_quarantined', schema=schema)
    op.drop_column('wq_queues', 'revoked', schema=schema)
    _drop_views()
    _constraints((NEW_STATES, NEW_KINDS, "VARCHAR(16)"), OLD_STATES, OLD_KINDS, "VARCHAR(10)")
    _make_views()
