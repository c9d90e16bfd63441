"""wq_claim_round() takes the queue's claim lock, shared (Postgres)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 05:10:00

``wq_claim_round()`` (0008) again, with one change: before it claims, it takes a transaction-
scoped advisory lock of the queue in shared mode (``pg_advisory_xact_lock_shared(2003835757,
queue)``). Claims never wait for each other on it. A change of the queue's pending rows (a mix
change redraws them) takes it exclusively: it waits for the claims in flight and holds new ones
back until it commits, a few milliseconds. Without it a claim that met the rows the change had
locked skipped them (``SKIP LOCKED``) and claimed past them, rows of the old mix out of their
order, possibly of the next epoch. The text is 0008's with that change made to it here, so the
two cannot drift apart otherwise.

SQLite: nothing (a change of the rows is a ``BEGIN IMMEDIATE`` transaction, which excludes
every claim).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

CLAIM_LOCK = 2003835757


def _prefix() -> str:
    # The body is text, resolved when it runs: in a named schema it names that schema's tables.
    schema = op.get_context().version_table_schema
    return f'"{schema}".' if schema else ""


def _module(name: str, file: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def v0008_text() -> str:
    """0008's ``wq_claim_round()`` (made from 0007's frozen text, as 0008 makes it)."""
    m8 = _module("wq_sql_migration_0008", "0008_claim_round_stamps.py")
    return str(m8.claim_round_one_stamp(m8._v0007().FUNCTION))


def with_claim_lock(text: str) -> str:
    """0008's text with the shared claim lock taken first thing in the claim step."""
    step = "    IF p_limit > 0 THEN\n        ids := ARRAY("
    assert text.count(step) == 1, "0008's text is not the one this was written for"
    return text.replace(step, "    IF p_limit > 0 THEN\n" + LOCK + "        ids := ARRAY(")


LOCK = (
    "        -- Shared with every other claim of the queue; a change of its pending rows (a mix\n"
    "        -- change, a quarantine) takes it exclusively, so that no claim skips the rows that\n"
    "        -- change has locked and claims past them while it runs (wq_sql.store.mixing).\n"
    f"        PERFORM pg_advisory_xact_lock_shared({CLAIM_LOCK}, p_queue);\n")


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(with_claim_lock(v0008_text()).format(s=_prefix()))


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(v0008_text().format(s=_prefix()))
