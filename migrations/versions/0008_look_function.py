"""the waiting worker's read as a server-side function (Postgres): wq_look() reads what a poll
reads, with its plan cached per server connection; wq_claim_round() stamps one time per round

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 11:55:00

Why: a waiting worker polls this read about once per ``poll_seconds`` (and its heartbeat's
renewal carries it), so at thousands of waiting workers it is most of what the server does.
Sent as a simple query it was planned at every call (no prepared statements: PgBouncer in
transaction mode): ``EXPLAIN (ANALYZE, SUMMARY)`` here, 0.18-0.23 ms of planning against
0.06-0.09 ms of execution. A PL/pgSQL function's statement is planned once per server
connection, as ``wq_claim_round()``'s (0007). Generic plans: every part is an index probe by
the queue id (the pending and claimed rows' partial indexes, the tallies' primary key, the
queue row), right whatever the table's size.

STABLE: it reads the snapshot of the statement that calls it, as the read did when it was a
derived table of the heartbeat's renewal (``wq_sql.renewal``). The text is frozen here;
``wq_sql.look.Look`` calls it.

And ``wq_claim_round()`` (0007) again, its one change: the round's claimed rows share one time,
taken once they are locked (its acknowledged rows another, taken when it starts), where 0007's
``clock_timestamp()`` was read per row (the claims of one
round got stamps microseconds apart in the order the update met the rows, so ``wq_history``
ordered by time could show an epoch's first claim a few microseconds before the previous epoch's
last one of the same round; SQLite's statements read one time per statement). Its text is
0007's with that change made to it here, so the two cannot drift apart otherwise.

SQLite: nothing (its read is an in-process statement, see wq_sql/look.py).
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

FUNCTION = """
CREATE OR REPLACE FUNCTION {s}wq_look(p_queue integer, p_worker integer)
RETURNS TABLE (pending boolean, expired boolean, mine bigint, finished bigint, failed bigint,
               epochs_created integer, num_epochs bigint)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan AS $wq$
BEGIN
    RETURN QUERY
    SELECT EXISTS (SELECT 1 FROM {s}wq_items WHERE queue_id = p_queue AND state = 'pending'),
           EXISTS (SELECT 1 FROM {s}wq_items WHERE queue_id = p_queue AND state = 'claimed'
                   AND lease_until < clock_timestamp()),
           (SELECT count(*) FROM {s}wq_items WHERE queue_id = p_queue AND worker_id = p_worker
            AND state = 'claimed'),
           t.finished::bigint, t.failed::bigint, q.epochs_created, q.num_epochs
    FROM {s}wq_queues q
    CROSS JOIN (SELECT coalesce(sum(n_done + n_failed), 0) AS finished,
                       coalesce(sum(n_failed), 0) AS failed
                FROM {s}wq_tallies WHERE queue_id = p_queue) t
    WHERE q.id = p_queue;
END
$wq$
"""
SIGNATURE = "wq_look(integer, integer)"


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
    op.execute(FUNCTION.format(s=_prefix()))
    op.execute(claim_round_one_stamp(_v0007().FUNCTION).format(s=_prefix()))


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(f"DROP FUNCTION IF EXISTS {_prefix()}{SIGNATURE}")
    op.execute(_v0007().FUNCTION.format(s=_prefix()))
