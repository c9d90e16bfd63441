"""wq_claim_round() stamps one time per step (Postgres)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 11:55:00

``wq_claim_round()`` (0007) again, with one change: the round's claimed rows share one time,
taken once they are locked (its acknowledged rows another, taken when it starts), where 0007's
``clock_timestamp()`` was read per row (the claims of one round got stamps microseconds apart in
the order the update met the rows, so ``wq_history`` ordered by time could show an epoch's
first claim a few microseconds before the previous epoch's last one of the same round; SQLite's
statements read one time per statement). Its text is 0007's with that change made to it here,
so the two cannot drift apart otherwise.

A server-side function for the waiting worker's read (``wq_look()``, planned once per server
connection with a generic plan) was tried in this revision and dropped before it landed: with
several queues in the table, the generic plan of ``EXISTS (... WHERE queue_id = $1 AND state =
'pending')`` estimated a quarter of the rows per queue and scanned the table for a queue with
none (1.2 server cores for 100 polls a second at 2,000 waiting workers, bench/cluster_scale.py).

SQLite: nothing (its round is several in-process statements, see wq_sql/claim.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def _prefix() -> str:
    # The body is text, resolved when it runs: in a named schema it names that schema's tables.
    schema = op.get_context().version_table_schema
    return f'"{schema}".' if schema else ""


def _v0007() -> ModuleType:
    """Migration 0007's module (its function's frozen text)."""
    spec = importlib.util.spec_from_file_location("wq_sql_migration_0007",
                                                  Path(__file__).with_name("0007_claim_round_function.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def claim_round_one_stamp(text: str) -> str:
    """0007's ``wq_claim_round()`` with one time per step: ``clock_timestamp()`` read into
    ``v_now`` when the round starts (the acks' done_at) and again once the claim's rows are
    locked (claimed_at and lease_until of every claimed row)."""
    head, body = text.split("    ids bigint[];\nBEGIN\n")
    claim = "        RETURN QUERY\n        WITH claimed AS ("
    assert body.count("clock_timestamp()") == 3 and body.count(claim) == 1, \
        "0007's text is not the one this was written for"
    body = body.replace("clock_timestamp()", "v_now").replace(
        claim, "        v_now := clock_timestamp();  -- the rows are locked: claimed now\n" + claim)
    return head + "    ids bigint[];\n    v_now timestamptz := clock_timestamp();\nBEGIN\n" + body


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(claim_round_one_stamp(_v0007().FUNCTION).format(s=_prefix()))


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(_v0007().FUNCTION.format(s=_prefix()))
