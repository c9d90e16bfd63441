"""the claim round as a server-side function (Postgres): wq_claim_round() runs the acks, their
history rows and counters, and the claim, with plans cached per server connection

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 07:45:00

Why: the round used to be one statement of six CTEs sent as a simple query, planned afresh at
every round (no prepared statements: PgBouncer in transaction mode), 0.3-0.9 ms of planning
against ~1.2 ms of execution (``EXPLAIN (ANALYZE, SUMMARY)``, docs/design.md). A PL/pgSQL
function's statements are planned once per server connection; that works through a transaction
pooler too, since it is the server's own cache, not a session's prepared statement.

The plans are forced generic (``plan_cache_mode``): with the default, the planner compares the
generic plan with the custom plans of the first calls and, since a generic ``LIMIT $n`` is
estimated at 10% of the rows, would re-plan at every call. The statements are written so that
the generic plan is the right one whatever the table's size: the claim takes its ids by the
pending index in ``(epoch, seq)`` order (a LIMIT over an ordered index scan, no join), and the
update and the works' read go by primary key (``id = ANY(ids)``, estimated at a few rows).

The steps run as separate statements of one transaction (the caller's simple query, or its
explicit transaction): the acks first, then the claim from the floor, then below the floor only
if the floor found too few (and a floor is given), as the former statement's CTEs did. Rows come
back as (kind, id, epoch, seq, work_idx, attempts, work): kind 'a' for an accepted ack, 'c' for
a claimed item. The text is frozen here; ``wq_sql.claim.ClaimRound`` calls it.

SQLite: nothing (its round is several in-process statements, see wq_sql/claim.py).
"""

from __future__ import annotations

from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION {s}wq_claim_round(
    p_queue integer, p_worker integer, p_token bigint, p_lease double precision,
    p_floor_epoch integer, p_floor_seq integer, p_limit integer,
    p_ack_ids bigint[], p_ack_tokens bigint[])
RETURNS TABLE (r_kind text, r_id bigint, r_epoch integer, r_seq integer, r_work_idx integer,
               r_attempts integer, r_work text)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $wq$
DECLARE
    ids bigint[];
BEGIN
    IF cardinality(p_ack_ids) > 0 THEN
        -- Fenced by (id, token); each pair found by primary key ("state || ''" keeps the planner
        -- off the partial index of claimed rows, full of dead entries until VACUUM).
        RETURN QUERY
        WITH acked AS (
            UPDATE {s}wq_items i SET state = 'done', done_at = clock_timestamp(), lease_until = NULL
            FROM unnest(p_ack_ids, p_ack_tokens) AS a(id, token)
            WHERE i.id = a.id AND i.token = a.token AND i.state || '' = 'claimed'
            RETURNING i.id, i.epoch, i.seq, i.token, i.done_at, i.claimed_at, i.attempts
        ), acked_events AS (
            INSERT INTO {s}wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at,
                                      claimed_at, attempt)
            SELECT p_queue, x.id, x.epoch, x.seq, 'done', p_worker, x.token, x.done_at,
                   x.claimed_at, x.attempts
            FROM acked x
        ), acked_tally AS (
            INSERT INTO {s}wq_tallies AS t (queue_id, epoch, worker_id, n_done)
            SELECT p_queue, x.epoch, p_worker, count(*) FROM acked x GROUP BY x.epoch
            ON CONFLICT (queue_id, epoch, worker_id) DO UPDATE SET n_done = t.n_done + excluded.n_done
        )
        SELECT 'a'::text, x.id, x.epoch, x.seq, 0, 0, NULL::text FROM acked x;
    END IF;
    IF p_limit > 0 THEN
        ids := ARRAY(SELECT i.id FROM {s}wq_items i
                     WHERE i.queue_id = p_queue AND i.state = 'pending'
                       AND (i.epoch, i.seq) >= (p_floor_epoch, p_floor_seq)
                     ORDER BY i.epoch, i.seq LIMIT p_limit FOR UPDATE SKIP LOCKED);
        IF cardinality(ids) < p_limit AND (p_floor_epoch, p_floor_seq) > (-1, -1) THEN
            ids := ids || ARRAY(SELECT i.id FROM {s}wq_items i
                                WHERE i.queue_id = p_queue AND i.state = 'pending'
                                  AND (i.epoch, i.seq) < (p_floor_epoch, p_floor_seq)
                                ORDER BY i.epoch, i.seq LIMIT p_limit - cardinality(ids)
                                FOR UPDATE SKIP LOCKED);
        END IF;
        RETURN QUERY
        WITH claimed AS (
            UPDATE {s}wq_items i SET state = 'claimed', worker_id = p_worker, token = p_token,
                claimed_at = clock_timestamp(),
                lease_until = clock_timestamp() + p_lease * interval '1 second', done_at = NULL
            WHERE i.id = ANY(ids)
            RETURNING i.id, i.epoch, i.seq, i.work_idx, i.attempts
        )
        SELECT 'c'::text, cl.id, cl.epoch, cl.seq, cl.work_idx, cl.attempts, w.work
        FROM claimed cl JOIN {s}wq_works w ON w.queue_id = p_queue AND w.idx = cl.work_idx;
    END IF;
END
$wq$
"""
SIGNATURE = ("wq_claim_round(integer, integer, bigint, double precision, integer, integer, integer, "
             "bigint[], bigint[])")


def _prefix() -> str:
    # The body is text, resolved when it runs: in a named schema it names that schema's tables.
    schema = op.get_context().version_table_schema
    return f'"{schema}".' if schema else ""


def upgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(FUNCTION.format(s=_prefix()))


def downgrade() -> None:
    if op.get_context().dialect.name != "postgresql":
        return
    op.execute(f"DROP FUNCTION IF EXISTS {_prefix()}{SIGNATURE}")
