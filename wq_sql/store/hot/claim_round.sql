-- The claim round of a Postgres worker, as it runs: wq_claim_round(), in one readable text.
--
-- One call acknowledges the worker's finished items (fenced by their lease tokens: done, one
-- history row each in wq_events, the per-epoch tallies) and claims up to p_limit pending items
-- in (epoch, seq) order from the worker's floor on, with SELECT ... FOR UPDATE SKIP LOCKED, in
-- one statement and one round trip. Returned rows: kind 'a' for an accepted acknowledgement,
-- 'c' for a claimed item (with its work).
--
-- The migrations that made it stay frozen (0007 created it, 0008 stamped one time per step,
-- 0011 took the queue's claim lock);
-- this file is what `upgrade head` leaves in the database, which tests/migrations checks
-- against pg_get_functiondef(). {{s}} stands for the schema prefix ("name". or nothing). A change
-- to the function is a new migration that executes this file's new text.
CREATE OR REPLACE FUNCTION {s}wq_claim_round(
    p_queue integer, p_worker integer, p_token bigint, p_lease double precision,
    p_floor_epoch integer, p_floor_seq integer, p_limit integer,
    p_ack_ids bigint[], p_ack_tokens bigint[])
RETURNS TABLE (r_kind text, r_id bigint, r_epoch integer, r_seq integer, r_work_idx integer,
               r_attempts integer, r_work text)
LANGUAGE plpgsql VOLATILE SET plan_cache_mode = force_generic_plan AS $wq$
DECLARE
    ids bigint[];
    v_now timestamptz := clock_timestamp();
BEGIN
    IF cardinality(p_ack_ids) > 0 THEN
        -- Fenced by (id, token); each pair found by primary key ("state || ''" keeps the planner
        -- off the partial index of claimed rows, full of dead entries until VACUUM).
        RETURN QUERY
        WITH acked AS (
            UPDATE {s}wq_items i SET state = 'done', done_at = v_now, lease_until = NULL
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
        -- Shared with every other claim of the queue; a change of its pending rows (a mix
        -- change, a quarantine) takes it exclusively, so that no claim skips the rows that
        -- change has locked and claims past them while it runs (wq_sql.store.mixing).
        PERFORM pg_advisory_xact_lock_shared(2003835757, p_queue);
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
        v_now := clock_timestamp();  -- the rows are locked: claimed now
        RETURN QUERY
        WITH claimed AS (
            UPDATE {s}wq_items i SET state = 'claimed', worker_id = p_worker, token = p_token,
                claimed_at = v_now,
                lease_until = v_now + p_lease * interval '1 second', done_at = NULL
            WHERE i.id = ANY(ids)
            RETURNING i.id, i.epoch, i.seq, i.work_idx, i.attempts
        )
        SELECT 'c'::text, cl.id, cl.epoch, cl.seq, cl.work_idx, cl.attempts, w.work
        FROM claimed cl JOIN {s}wq_works w ON w.queue_id = p_queue AND w.idx = cl.work_idx;
    END IF;
END
$wq$
