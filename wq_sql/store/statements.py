"""Every SQLAlchemy Core statement of the queue, stateless: creating queues and epochs,
completing, releasing, failing, requeueing, expiring, recovering, covering by checkpoints, and
the reads behind them. The hot path's driver-level texts (the claim round, the waiting worker's
poll, the heartbeat's renewal, a clean close's give-back) are in ``wq_sql.store.hot``.

Each function runs inside a transaction its caller opened (``wq_sql.store.db.Db.tx``), and
writes the ``wq_events`` rows and ``wq_tallies`` counters of the transitions it makes in that
same transaction: one history row per delivery it ends (with the delivery's ``claimed_at`` and
attempt, see ``wq_sql.states``), and one per done or failed item it requeues.

The claim, on both backends, has one shape::

    WITH c AS MATERIALIZED (SELECT id FROM wq_items
                            WHERE queue_id = :q AND state = 'pending'
                            ORDER BY epoch, seq LIMIT :n FOR UPDATE SKIP LOCKED)
    UPDATE wq_items SET state = 'claimed', worker_id = :w, token = :t, ...
    FROM c WHERE wq_items.id = c.id RETURNING ...

(Postgres' claim round, ``wq_claim_round()`` in ``store/hot/claim_round.sql``, takes the same
ids first, ``ARRAY(SELECT id ... FOR UPDATE SKIP LOCKED)``, then updates them by primary key.)
Every filter sits inside the CTE, so at most ``n`` rows are updated. On Postgres, ``SKIP
LOCKED`` lets concurrent claimers pass each other's rows. SQLite has no row locks and renders
no ``FOR UPDATE``; it is safe because every write transaction starts with ``BEGIN IMMEDIATE``,
which takes the database's single write lock before the SELECT runs, so two claims never see
the same pending row (the second one waits, then sees the first one's committed update).
"""

from __future__ import annotations

import bisect
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, cast

from sqlalchemy import (
    Connection,
    Table,
    and_,
    case,
    delete,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql import Select

from wq_sql.errors import InvalidInput
from wq_sql.mixing import Source
from wq_sql.plan import PlannedItem, QueueSpec, epoch_order
from wq_sql.states import (
    CK_RESTORE,
    CK_SAVE,
    CLAIMED,
    DONE,
    EV_DONE,
    EV_EXPIRE,
    EV_FAIL,
    EV_RECOVER,
    EV_RELEASE,
    EV_REQUEUE,
    FAILED,
    PENDING,
)
from wq_sql.store import accounting, mixing, quarantine
from wq_sql.store.dialects import SQLITE_NOW, Dialect, dialect_of, qualifier
from wq_sql.store.models import CheckpointRecord, Event, Item, Queue, StepRecord, Tally, Work, Worker

items = cast(Table, Item.__table__)
queues = cast(Table, Queue.__table__)
works_t = cast(Table, Work.__table__)
workers = cast(Table, Worker.__table__)
tallies = cast(Table, Tally.__table__)
events = cast(Table, Event.__table__)
checkpoints = cast(Table, CheckpointRecord.__table__)
steps = cast(Table, StepRecord.__table__)

INSERT_CHUNK = 10_000
EPOCH_CHUNK = 1_000_000  # item rows per INSERT ... SELECT of an epoch


def new_token() -> int:
    return secrets.randbits(62) + 1


class Claimed(NamedTuple):
    """One claimed row, as the claim returns it (a tuple: a claim round makes one per item,
    several times cheaper than a frozen dataclass). ``work``: its work string, when the
    statement that claimed it read it too (the claim round does; ``works_by_idx`` otherwise)."""

    id: int
    epoch: int
    seq: int
    work_idx: int
    token: int
    attempts: int
    work: Optional[str] = None


# ---------------------------------------------------------------- queue creation and epochs


def find_queue(conn: Connection, name: str) -> Optional[Any]:
    return conn.execute(select(queues).where(queues.c.name == name)).one_or_none()


@dataclass(frozen=True)
class QueueRow:
    """What a queue object needs of its stored queue row (read by :func:`queue_row`)."""

    id: int
    name: str
    works_digest: str
    n_works: int
    num_epochs: int
    shuffle: bool
    seed: int
    num_slices: Optional[int]
    prefix: Optional[str]
    max_attempts: int
    epochs_created: int


_QUEUE_COLUMNS = [f.name for f in QueueRow.__dataclass_fields__.values()]


def queue_row(conn: Connection, name: str) -> Optional[QueueRow]:
    """The queue ``name``'s row, or None: every queue object's opening, in every process (a
    driver-level text, as below: a Core ``SELECT`` of the row was compiled afresh in each
    DataLoader worker)."""
    row = conn.exec_driver_sql(_text(conn, _queue_row_sql), {"n": name}).first()
    if row is None:
        return None
    values = dict(zip(_QUEUE_COLUMNS, row))
    values["shuffle"] = bool(values["shuffle"])  # SQLite stores 0 / 1
    return QueueRow(**values)


def _queue_row_sql(sqlite: bool, p: str) -> str:
    return f"SELECT {', '.join(_QUEUE_COLUMNS)} FROM {p}wq_queues WHERE name = {_binder(sqlite)('n')}"


def find_queue_by_id(conn: Connection, qid: int) -> Any:
    return conn.execute(select(queues).where(queues.c.id == qid)).one()


def create_queue(conn: Connection, b: Dialect, name: str, spec: QueueSpec, works: Sequence[PlannedItem],
                 seed: int, max_attempts: int, by: str = "") -> Optional[int]:
    """Insert the queue, the works of one epoch (``spec.works`` after slicing) and epoch 0;
    ``None`` if a queue of that name exists. A weighted queue (``spec.sources``) also gets its
    sources and its first ``wq_mixes`` row, written as made by ``by``.

    Concurrent creators are serialised by the unique name (Postgres: the loser's INSERT waits for
    the winner's commit, then does nothing; SQLite: ``BEGIN IMMEDIATE``)."""
    stmt = (b.insert(queues).values(
        name=name, works_digest=spec.works_digest, n_works=len(works), num_epochs=spec.num_epochs,
        shuffle=spec.shuffle, seed=seed, num_slices=spec.num_slices, prefix=spec.prefix,
        max_attempts=max_attempts, epochs_created=1,
    ).on_conflict_do_nothing(index_elements=["name"]).returning(queues.c.id))
    qid = conn.execute(stmt).scalar_one_or_none()
    if qid is None:
        return None
    _insert_chunked(conn, works_t, ({"queue_id": qid, "idx": i, "work": w.work, "bounds": w.bounds}
                                    for i, w in enumerate(works)))
    if spec.sources:
        srcs = source_rows(spec, works)
        mixing.insert_sources(conn, qid, srcs, by)
        mixing.make_epoch(conn, qid, 0, len(works), spec.shuffle, seed, srcs)
    else:
        insert_epoch(conn, qid, len(works), 0, spec.shuffle, seed)
    return qid


def source_rows(spec: QueueSpec, works: Sequence[PlannedItem]) -> list[Source]:
    """The sources of a new weighted queue: each source's items are the consecutive ``works``
    that come from its given works (``PlannedItem.of``)."""
    ends, total = [], 0
    for _, n in spec.sources:
        total += n
        ends.append(total)
    count = [0] * len(ends)
    first = [-1] * len(ends)
    for i, w in enumerate(works):
        s = bisect.bisect_right(ends, w.of)
        count[s] += 1
        if first[s] < 0:
            first[s] = i
    for (name, _), n in zip(spec.sources, count):
        if n == 0:
            raise InvalidInput(f"source {name!r} has no items: every work in it is empty")
    return [Source(k, name, first[k], count[k], spec.weights[k])
            for k, (name, _) in enumerate(spec.sources)]


def _insert_chunked(conn: Connection, table: Any, rows: Iterable[dict[str, Any]]) -> None:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= INSERT_CHUNK:
            conn.execute(insert(table), batch)
            batch = []
    if batch:
        conn.execute(insert(table), batch)


def insert_epoch(conn: Connection, qid: int, n: int, epoch: int, shuffle: bool, seed: int) -> None:
    """Insert the ``n`` pending rows of one epoch (see :func:`insert_epoch_rows`)."""
    order = epoch_order(n, epoch, shuffle, seed)
    for start in range(0, n, EPOCH_CHUNK):
        insert_epoch_rows(conn, qid, epoch, order, start, min(n, start + EPOCH_CHUNK))


def insert_epoch_rows(conn: Connection, qid: int, epoch: int, order: Sequence[int], start: int,
                      end: int) -> None:
    """Insert the pending rows ``start <= seq < end`` of one epoch (``order[seq]`` = work index)
    in one statement: the slice goes to the server as one array parameter (Postgres ``unnest ...
    WITH ORDINALITY``, SQLite ``json_each``), so a million rows cost no per-row Python objects or
    parameter sets."""
    b = dialect_of(conn)
    rows, pos, idx = b.int_rows(",".join(map(str, order[start:end])))
    conn.execute(insert(items).from_select(
        ["queue_id", "epoch", "seq", "work_idx", "state", "attempts", "pending_since"],
        select(literal(qid), literal(epoch), pos + start, idx, literal(PENDING), literal(0), b.now())
        .select_from(rows)))


def rows_made(conn: Connection, qid: int, epoch: int) -> int:
    """How many rows of ``epoch`` exist: epochs are made in order of ``seq`` (a prefix per
    transaction), so this is ``max(seq) + 1``, one descent of the ``(queue_id, epoch, seq)`` index."""
    top = conn.execute(select(func.max(items.c.seq))
                       .where(items.c.queue_id == qid, items.c.epoch == epoch)).scalar_one()
    return 0 if top is None else top + 1


def advance_epoch(conn: Connection, qid: int, have: int, *, chunk: Optional[int] = None,
                  order: Optional[Sequence[int]] = None) -> Optional[int]:
    """Make epoch ``have`` (or its next ``chunk`` rows) if the queue has ``have`` complete epochs.

    An epoch is made in transactions of ``chunk`` rows (all at once without ``chunk``), each a
    prefix in ``seq`` order continuing from what exists (:func:`rows_made`), so that no
    transaction holds SQLite's write lock, or fills Postgres' WAL, for long; ``epochs_created``
    counts it with its last rows. Its rows are claimable as soon as they are committed. A
    worker that died halfway leaves a prefix that any worker continues.

    The queue row lock makes it exactly-once under concurrency. On Postgres a second caller
    does not wait for the first one's row lock: it skips the locked row and returns ``None`` at
    once, and goes on claiming. ``FOR NO KEY UPDATE`` does not conflict with the key-share locks
    that concurrent claims take on the queue row (their event and counter rows reference it).
    ``order`` is the epoch's hand-out order if the caller has it (computing it is O(n) Python).

    Returns ``have + 1`` when this call completed the epoch, ``have`` when it added rows and more
    remain, ``None`` if another worker is at it (Postgres), the epoch exists or every epoch
    exists."""
    row = conn.execute(
        select(queues.c.n_works, queues.c.shuffle, queues.c.seed)
        .where(queues.c.id == qid, queues.c.epochs_created == have, queues.c.num_epochs > have)
        .with_for_update(key_share=True, skip_locked=True)).one_or_none()
    if row is None:
        return None
    srcs = mixing.load_sources(conn, qid)
    if srcs:  # a weighted epoch is drawn from the sources' state: all in this transaction
        mixing.make_epoch(conn, qid, have, row.n_works, row.shuffle, row.seed, srcs)
        quarantine.sweep(conn, qid, epoch=have)
        conn.execute(update(queues).where(queues.c.id == qid, queues.c.epochs_created == have)
                     .values(epochs_created=have + 1))
        return have + 1
    start = rows_made(conn, qid, have)
    end = row.n_works if chunk is None else min(row.n_works, start + chunk)
    if order is None:
        order = epoch_order(row.n_works, have, row.shuffle, row.seed)
    if end > start:
        insert_epoch_rows(conn, qid, have, order, start, end)
        quarantine.sweep(conn, qid, epoch=have, seq_from=start)
    if end < row.n_works:
        return have
    conn.execute(update(queues).where(queues.c.id == qid, queues.c.epochs_created == have)
                 .values(epochs_created=have + 1))
    return have + 1


def extend_epochs(conn: Connection, qid: int, num_epochs: int) -> int:
    return conn.execute(
        update(queues).where(queues.c.id == qid, queues.c.num_epochs <= num_epochs)
        .values(num_epochs=num_epochs).returning(queues.c.num_epochs)).scalar_one_or_none() or 0


def item_bounds(conn: Connection, qid: int, item_id: int) -> Optional[tuple[str, Optional[str]]]:
    """The stored work and bounds of one item (``None``: no such item in this queue)."""
    on = and_(items.c.queue_id == works_t.c.queue_id, items.c.work_idx == works_t.c.idx)
    row = conn.execute(select(works_t.c.work, works_t.c.bounds).join(items, on)
                       .where(items.c.id == item_id, items.c.queue_id == qid)).one_or_none()
    return None if row is None else (row.work, row.bounds)


def works_by_idx(conn: Connection, qid: int, idxs: Sequence[int]) -> dict[int, str]:
    rows = conn.execute(select(works_t.c.idx, works_t.c.work)
                        .where(works_t.c.queue_id == qid, works_t.c.idx.in_(sorted(set(idxs)))))
    return {r.idx: r.work for r in rows}


# ---------------------------------------------------------------- events and counters


# What an ending statement returns for its history rows (after the id, epoch, seq it returns).
ENDED = (items.c.claimed_at, items.c.attempts)




# ---------------------------------------------------------------- acks (the claim round: store/hot/claim.py)


def _keyed(pairs: Sequence[tuple[int, int]]) -> Any:
    """The rows among ``(id, token)`` pairs, found by primary key. ``id IN`` too: SQLite plans a
    row-value ``(id, token) IN (...)`` of two or more pairs alone as a scan of every item of the
    queue, all epochs, holding the write lock for a time that grows with the queue (a worker's
    ``close()``, giving back what it claimed ahead; ``tests/sqlite/test_sqlite_write_turns.py``)."""
    return and_(items.c.id.in_([p[0] for p in pairs]), tuple_(items.c.id, items.c.token).in_(list(pairs)))


def _fenced(pairs: Sequence[tuple[int, int]]) -> Any:
    """The claimed rows among ``(id, token)`` pairs, found by primary key (:func:`_keyed`):
    ``state || ''`` keeps Postgres' planner off the partial index of claimed rows (see
    ``ClaimRound``)."""
    return and_(_keyed(pairs), items.c.state.concat("") == CLAIMED)


def complete(conn: Connection, b: Dialect, qid: int, worker_id: int,
             pairs: Sequence[tuple[int, int]]) -> set[int]:
    """Mark claimed items done, fenced by ``(id, token)``; returns the ids accepted.

    An id missing from the result lost its lease: someone else holds it now, or finished it.
    One already done with its token counts as accepted (see :func:`done_already`)."""
    if not pairs:
        return set()
    rows = conn.execute(
        update(items).where(_fenced(pairs))
        .values(state=DONE, done_at=b.now(), lease_until=None)
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.token, *ENDED)).all()
    accounting.history(conn, b, qid, EV_DONE, rows, worker_id)
    accounting.tally(conn, b, qid, rows, "n_done", worker_id)
    accepted = {r.id for r in rows}
    if len(accepted) < len(pairs):
        accepted |= done_already(conn, [p for p in pairs if p[0] not in accepted])
    return accepted


def done_already(conn: Connection, pairs: Sequence[tuple[int, int]]) -> set[int]:
    """The ids among ``(id, token)`` pairs whose row is done with that very token: an
    acknowledgement retried after its first commit went through but its reply was lost (a
    failover, a connection cut during COMMIT). Each delivery gets its own token, so only the
    holder that now retries could have finished it: the retry succeeds instead of reporting a
    lost lease."""
    if not pairs:
        return set()
    rows = conn.execute(select(items.c.id).where(_keyed(pairs), items.c.state.concat("") == DONE)).all()
    return {r.id for r in rows}


def release(conn: Connection, b: Dialect, qid: int, worker_id: int,
            pairs: Sequence[tuple[int, int]]) -> set[int]:
    """Give claimed items back without counting an attempt."""
    if not pairs:
        return set()
    rows = conn.execute(
        update(items).where(_fenced(pairs))
        .values(state=PENDING, token=None, lease_until=None)
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.token, *ENDED)).all()
    accounting.history(conn, b, qid, EV_RELEASE, rows, worker_id)
    return {r.id for r in rows}


def _after_attempt(max_attempts: int) -> Any:
    return case((items.c.attempts + 1 >= max_attempts, FAILED), else_=PENDING)


def fail(conn: Connection, b: Dialect, qid: int, worker_id: int, pairs: Sequence[tuple[int, int]],
         error: str, max_attempts: int) -> set[int]:
    """Count a failed attempt; the item goes back to pending, or to failed after ``max_attempts``."""
    if not pairs:
        return set()
    state = _after_attempt(max_attempts)
    rows = conn.execute(
        update(items).where(_fenced(pairs))
        .values(state=state, attempts=items.c.attempts + 1, last_error=error, lease_until=None,
                done_at=case((state == FAILED, b.now()), else_=None))
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.state, items.c.token, *ENDED)).all()
    accounting.history(conn, b, qid, EV_FAIL, rows, worker_id, error, counted=True)
    accounting.tally(conn, b, qid, [r for r in rows if r.state == FAILED], "n_failed", worker_id)
    return {r.id for r in rows}


def expire(conn: Connection, b: Dialect, qid: int, max_attempts: int) -> int:
    """Return items whose lease ran out to the queue (an attempt each); returns how many.

    Only claimed rows are scanned (partial index). The row keeps ``worker_id``, the last holder,
    which the event records too, so the audit shows who held an item before a crash."""
    return _give_back(conn, b, qid, [items.c.lease_until < b.now()], max_attempts, "lease expired")


def _give_back(conn: Connection, b: Dialect, qid: int, where: list[Any], max_attempts: int,
               why: str) -> int:
    """Claimed items matching ``where`` go back to the queue (or fail, at ``max_attempts``), an
    attempt each, with an ``expire`` event saying ``why``. Rows another transaction has locked
    (an ack in flight) are skipped: that transaction decides their fate."""
    state = _after_attempt(max_attempts)
    locked = (select(items.c.id).where(items.c.queue_id == qid, items.c.state == CLAIMED, *where)
              .with_for_update(skip_locked=True).cte("x").prefix_with("MATERIALIZED"))
    rows = conn.execute(
        update(items).where(items.c.id == locked.c.id)
        .values(state=state, attempts=items.c.attempts + 1, token=None, lease_until=None,
                last_error=why, done_at=case((state == FAILED, b.now()), else_=None))
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.state, items.c.worker_id, *ENDED)).all()
    accounting.history(conn, b, qid, EV_EXPIRE, rows, detail=why, counted=True)
    accounting.tally(conn, b, qid, [r for r in rows if r.state == FAILED], "n_failed")
    return len(rows)


# A worker whose last heartbeat is this many of its own heartbeat periods old is stale: its items
# go back to the queue without waiting for their lease (and its identity may be taken over).
STALE_BEATS = 3


@dataclass(frozen=True)
class Holder:
    """Another worker of the queue that holds claimed items and may be gone: it runs on the
    caller's host (whose process table tells at once) or its heartbeat is stale."""
    id: int
    name: str
    host: str
    pid: int
    proc_start: Optional[int]
    incarnation: str
    age: float             # seconds since its last heartbeat
    stale: bool            # older than STALE_BEATS of its own beats
    held: int


def holders_to_check(conn: Connection, b: Dialect, qid: int, me: int,
                     host: str) -> tuple[list[Holder], int, bool]:
    """The other workers holding items that are stale or on ``host``, how many live workers
    (this one included) the queue has on ``host``, and whether a lease has expired (so that the
    look's write transaction, :func:`expire`, runs only when it has work): a read, two
    statements."""
    age = b.seconds_since(workers.c.heartbeat_at)
    stale = and_(workers.c.beat_seconds.is_not(None), age > STALE_BEATS * workers.c.beat_seconds)
    held = (select(func.count()).where(items.c.queue_id == qid, items.c.worker_id == workers.c.id,
                                       items.c.state == CLAIMED).scalar_subquery())
    rows = conn.execute(
        select(workers.c.id, workers.c.name, workers.c.host, workers.c.pid, workers.c.proc_start,
               workers.c.incarnation, age.label("age"), case((stale, True), else_=False).label("stale"),
               held.label("held"))
        .where(workers.c.queue_id == qid, workers.c.id != me, workers.c.heartbeat_at.is_not(None),
               or_(workers.c.host == host, stale))).all()
    on_host = (select(func.count()).where(workers.c.queue_id == qid, workers.c.host == host,
                                          workers.c.heartbeat_at.is_not(None)).scalar_subquery())
    expired = exists().where(items.c.queue_id == qid, items.c.state == CLAIMED, items.c.lease_until < b.now())
    n, late = conn.execute(select(on_host, expired)).one()
    return [Holder(r.id, r.name, r.host, r.pid, r.proc_start, r.incarnation, float(r.age), bool(r.stale),
                   int(r.held)) for r in rows if r.held], int(n), bool(late)


def give_back_held(conn: Connection, b: Dialect, qid: int, h: Holder, max_attempts: int, why: str,
                   *, dead: bool) -> int:
    """Return the items ``h`` holds to the queue, if that worker is still the same incarnation
    and still gone (``dead``: its process is known dead; else its heartbeat must still be
    stale, re-checked in this transaction). Returns how many."""
    gone = [workers.c.id == h.id, workers.c.incarnation == h.incarnation, workers.c.heartbeat_at.is_not(None)]
    if not dead:
        gone.append(b.seconds_since(workers.c.heartbeat_at) > STALE_BEATS * workers.c.beat_seconds)
    return _give_back(conn, b, qid, [items.c.worker_id == h.id, select(workers.c.id).where(*gone).exists()],
                      max_attempts, why)


# ---------------------------------------------------------------- workers


def find_worker(conn: Connection, qid: int, name: str, lock: bool) -> Optional[Any]:
    stmt: Select[Any] = select(workers).where(workers.c.queue_id == qid, workers.c.name == name)
    if lock:
        stmt = stmt.with_for_update()
    return conn.execute(stmt).one_or_none()


def heartbeat_age(conn: Connection, b: Dialect, worker_id: int) -> Optional[float]:
    """Seconds since the worker's last heartbeat, by the database clock (None: closed cleanly)."""
    age = conn.execute(select(b.seconds_since(workers.c.heartbeat_at))
                       .where(workers.c.id == worker_id)).scalar_one()
    return None if age is None else float(age)


def insert_worker(conn: Connection, b: Dialect, qid: int, name: str, incarnation: str, host: str,
                  pid: int, proc_start: Optional[int], beat_seconds: float,
                  run: Optional[tuple[str, int]] = None) -> Optional[int]:
    """The new worker row's id, or None if ``name`` exists (driver-level text: every worker
    process registers once, see ``_text``)."""
    row = conn.exec_driver_sql(_text(conn, _insert_worker_sql),
                               _worker_values(incarnation, host, pid, proc_start, beat_seconds, run,
                                              q=qid, name=name)).one_or_none()
    return None if row is None else int(row[0])


def take_over_worker(conn: Connection, b: Dialect, worker_id: int, incarnation: str, host: str,
                     pid: int, proc_start: Optional[int], beat_seconds: float,
                     run: Optional[tuple[str, int]] = None) -> None:
    conn.exec_driver_sql(_text(conn, _take_over_sql),
                         _worker_values(incarnation, host, pid, proc_start, beat_seconds, run, id=worker_id))


def _worker_values(incarnation: str, host: str, pid: int, proc_start: Optional[int], beat_seconds: float,
                   run: Optional[tuple[str, int]], **more: Any) -> dict[str, Any]:
    run_id, restart = run or (None, None)
    return {"inc": incarnation, "host": host, "pid": pid, "start": proc_start, "beat": float(beat_seconds),
            "run": run_id, "restart": restart, **more}


def _insert_worker_sql(sqlite: bool, p: str) -> str:
    v, now = _binder(sqlite), SQLITE_NOW if sqlite else "clock_timestamp()"
    return (f"INSERT INTO {p}wq_workers (queue_id, name, incarnation, host, pid, proc_start, started_at, "
            f"heartbeat_at, beat_seconds, run_id, run_restart) VALUES ({v('q')}, {v('name')}, {v('inc')}, "
            f"{v('host')}, {v('pid')}, {v('start')}, {now}, {now}, {v('beat')}, {v('run')}, {v('restart')}) "
            "ON CONFLICT (queue_id, name) DO NOTHING RETURNING id")


def _take_over_sql(sqlite: bool, p: str) -> str:
    v, now = _binder(sqlite), SQLITE_NOW if sqlite else "clock_timestamp()"
    return (f"UPDATE {p}wq_workers SET incarnation = {v('inc')}, host = {v('host')}, pid = {v('pid')}, "
            f"proc_start = {v('start')}, started_at = {now}, heartbeat_at = {now}, "
            f"beat_seconds = {v('beat')}, run_id = {v('run')}, run_restart = {v('restart')}, "
            f"input_wait = NULL WHERE id = {v('id')}")  # a new incarnation's own total


def supersede_run(conn: Connection, b: Dialect, qid: int, me: int, run: tuple[str, int],
                  max_attempts: int) -> tuple[list[str], int]:
    """Worker ``me`` belongs to restart ``run[1]`` of job run ``run[0]``: every worker of an
    earlier restart of that run is gone (the job restarted all of its processes), so its items go
    back to the queue now (an attempt each, ``expire`` events saying why) and its row is closed,
    under a new incarnation that fences off any process of it still running. Returns the
    names of the workers superseded and how many items went back."""
    run_id, restart = run
    # Closed rows too: a worker that left may still hold items it handed to another process.
    # SKIP LOCKED: a row another transaction holds is being taken over by a process of the new
    # restart (which recovers its items) or superseded by one; waiting for it could deadlock
    # two workers that register at once, each holding its own row.
    old = conn.execute(select(workers.c.id, workers.c.name, workers.c.heartbeat_at).where(
        workers.c.queue_id == qid, workers.c.run_id == run_id, workers.c.run_restart < restart,
        workers.c.id != me).with_for_update(skip_locked=True)).all()
    if not old:
        return [], 0
    why = f"job run {run_id!r} restarted (restart {restart}): its earlier processes are gone"
    n = _give_back(conn, b, qid, [items.c.worker_id.in_([r.id for r in old])], max_attempts, why)
    live = [r.id for r in old if r.heartbeat_at is not None]
    if live:
        conn.execute(update(workers).where(workers.c.id.in_(live))
                     .values(heartbeat_at=None, incarnation=secrets.token_hex(16)))
    return [r.name for r in old if r.heartbeat_at is not None], n


def close_worker(conn: Connection, worker_id: int, incarnation: str) -> None:
    conn.execute(update(workers).where(workers.c.id == worker_id, workers.c.incarnation == incarnation)
                 .values(heartbeat_at=None))


def live_workers(conn: Connection, qid: int) -> int:
    """Workers of the queue that have not closed."""
    return int(conn.execute(select(func.count()).select_from(workers).where(
        workers.c.queue_id == qid, workers.c.heartbeat_at.is_not(None))).scalar_one())


def all_queues(conn: Connection) -> list[Any]:
    return list(conn.execute(select(queues).order_by(queues.c.name)).all())


def reset_queue(conn: Connection, qid: int, n_works: int, shuffle: bool, seed: int) -> None:
    """Start a queue over at epoch 0: its items, history, counters, workers, checkpoints and
    lineage go."""
    for table in (items, events, tallies, workers, checkpoints, steps):
        conn.execute(delete(table).where(table.c.queue_id == qid))
    conn.execute(update(queues).where(queues.c.id == qid).values(epochs_created=1))
    srcs = mixing.reset_streams(conn, qid)
    if srcs:
        mixing.make_epoch(conn, qid, 0, n_works, shuffle, seed, srcs)
    else:
        insert_epoch(conn, qid, n_works, 0, shuffle, seed)
    quarantine.sweep(conn, qid, epoch=0)  # the works in quarantine stay in it


def drop_queue(conn: Connection, qid: int) -> None:
    """Delete a queue and everything it holds. Children first: SQLite only cascades with
    ``foreign_keys=ON``, which other tools may not set."""
    for table in (items, events, tallies, workers, works_t, checkpoints, steps, mixing.sources_t,
                  mixing.mixes, quarantine.quarantine_t):
        conn.execute(delete(table).where(table.c.queue_id == qid))
    conn.execute(delete(queues).where(queues.c.id == qid))


def leave(conn: Connection, b: Dialect, qid: int, worker_id: int, incarnation: str, *,
          done: Sequence[tuple[int, int]], give_back: Sequence[tuple[int, int]],
          failing: Sequence[tuple[int, int]], error: str, max_attempts: int) -> set[int]:
    """A worker leaves cleanly: its ``done`` items are completed, ``give_back`` released,
    ``failing`` failed with ``error``, and its row says it closed. Returns the accepted acks."""
    accepted = complete(conn, b, qid, worker_id, done)
    release(conn, b, qid, worker_id, give_back)
    fail(conn, b, qid, worker_id, failing, error, max_attempts)
    close_worker(conn, worker_id, incarnation)
    return accepted


def recover(conn: Connection, b: Dialect, qid: int, worker_id: int, lease_seconds: float,
            max_attempts: int) -> list[Claimed]:
    """A restarted worker takes back the items its dead predecessor still held, before their lease
    expires (DeepRec's LocalWorkMgr replays restored works first). The crash counts as an attempt,
    so an item that kills its worker every time ends ``failed`` instead of looping."""
    # Mostly the predecessor held nothing (it closed cleanly, as a wq_sql.torch DataLoader worker
    # of the last pass did): one driver-level probe then, not the update (see ``_text``).
    if conn.exec_driver_sql(_text(conn, _holds_sql), {"q": qid, "w": worker_id}).first() is None:
        return []
    token = new_token()
    rows = conn.execute(
        update(items).where(items.c.queue_id == qid, items.c.worker_id == worker_id,
                            items.c.state == CLAIMED)
        .values(attempts=items.c.attempts + 1,
                state=case((items.c.attempts + 1 >= max_attempts, FAILED), else_=CLAIMED),
                token=token, lease_until=b.now_plus(lease_seconds),
                done_at=case((items.c.attempts + 1 >= max_attempts, b.now()), else_=None))
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.work_idx, items.c.attempts,
                   items.c.state, items.c.worker_id, items.c.claimed_at)).all()
    failed = [r for r in rows if r.state == FAILED]
    kept = [r for r in rows if r.state != FAILED]
    # Each row ends the dead process's delivery; a kept item's next delivery begins with it.
    accounting.history(conn, b, qid, EV_RECOVER, kept, worker_id, "restarted worker took its items back",
                       counted=True)
    accounting.history(conn, b, qid, EV_FAIL, failed, worker_id, "worker died holding it too often",
                       counted=True)
    accounting.tally(conn, b, qid, failed, "n_failed", worker_id)
    return sorted((Claimed(r.id, r.epoch, r.seq, r.work_idx, token, r.attempts) for r in kept),
                  key=lambda c: (c.epoch, c.seq))


# ---------------------------------------------------------------- progress


def progress(conn: Connection, qid: int) -> tuple[int, int, int]:
    """(done, failed, quarantined) over all epochs, from the counters."""
    row = conn.exec_driver_sql(_text(conn, _progress_sql), {"q": qid}).one()
    return int(row[0]), int(row[1]), int(row[2])


def ended_per_epoch(conn: Connection, qid: int) -> dict[int, int]:
    """Items done, failed or quarantined, per epoch, from the counters."""
    rows = conn.execute(select(tallies.c.epoch, func.sum(tallies.c.n_done + tallies.c.n_failed
                                                         + tallies.c.n_quarantined))
                        .where(tallies.c.queue_id == qid).group_by(tallies.c.epoch)).all()
    return {int(e): int(n or 0) for e, n in rows}


def _progress_sql(sqlite: bool, p: str) -> str:
    q = _binder(sqlite)("q")
    return (f"SELECT coalesce(sum(n_done), 0), coalesce(sum(n_failed), 0), coalesce(sum(n_quarantined), 0) "
            f"FROM {p}wq_tallies WHERE queue_id = {q}")


# What every worker process runs once (registering, the end of its take()s: the poll, the
# counters) as driver-level texts, not Core statements: each engine has its own compiled cache,
# so a Core statement is built and compiled afresh in every process: a DataLoader worker of
# wq_sql.torch, which opens a queue object per pass unless its workers are persistent, would
# pay that each pass. Texts by builder, dialect and schema; parameters by name
# (``:q`` for sqlite3, ``%(q)s`` for psycopg2).
_TEXTS: dict[tuple[Callable[[bool, str], str], bool, Optional[str]], str] = {}


def _binder(sqlite: bool) -> Callable[[str], str]:
    """A named parameter's marker in a driver-level text."""
    return (lambda name: f":{name}") if sqlite else (lambda name: f"%({name})s")


def _text(conn: Connection, build: Callable[[bool, str], str]) -> str:
    sqlite = conn.dialect.name == "sqlite"
    schema = (conn.get_execution_options().get("schema_translate_map") or {}).get(None)
    key = (build, sqlite, schema)
    sql = _TEXTS.get(key)
    if sql is None:
        sql = _TEXTS[key] = build(sqlite, qualifier(schema))
    return sql


def _holds_sql(sqlite: bool, p: str) -> str:
    v = _binder(sqlite)
    return (f"SELECT 1 FROM {p}wq_items WHERE queue_id = {v('q')} AND worker_id = {v('w')} "
            f"AND state = '{CLAIMED}' LIMIT 1")


def held_by(conn: Connection, qid: int, worker_id: int) -> list[Claimed]:
    """The items ``worker_id`` holds (claimed), in hand-out order."""
    rows = conn.execute(select(items.c.id, items.c.epoch, items.c.seq, items.c.work_idx, items.c.token,
                               items.c.attempts)
                        .where(items.c.queue_id == qid, items.c.worker_id == worker_id,
                               items.c.state == CLAIMED)
                        .order_by(items.c.epoch, items.c.seq)).all()
    return [Claimed(r.id, r.epoch, r.seq, r.work_idx, r.token, r.attempts) for r in rows]


def epochs_created(conn: Connection, qid: int) -> int:
    return conn.execute(select(queues.c.epochs_created).where(queues.c.id == qid)).scalar_one()


def finished_epochs(conn: Connection, qid: int, n_works: int) -> list[int]:
    """Epochs whose every item is done, failed or quarantined, by the counters."""
    rows = conn.execute(select(tallies.c.epoch).where(tallies.c.queue_id == qid)
                        .group_by(tallies.c.epoch)
                        .having(func.sum(tallies.c.n_done + tallies.c.n_failed + tallies.c.n_quarantined)
                                >= n_works))
    return sorted(r.epoch for r in rows)


def compacted_epochs(conn: Connection, qid: int, per_epoch: int, created: int) -> list[int]:
    """The created epochs with fewer item rows than an epoch has: their done rows were compacted."""
    rows = conn.execute(select(items.c.epoch, func.count()).where(items.c.queue_id == qid)
                        .group_by(items.c.epoch)).all()
    counts = {int(e): int(n) for e, n in rows}
    return [e for e in range(created) if counts.get(e, 0) < per_epoch]


def compact(conn: Connection, qid: int, epochs: Sequence[int], keep_events: bool) -> int:
    """Delete the ``done`` item rows of finished ``epochs``, with their lineage rows (and their
    events unless ``keep_events``). Failed items and their events stay; ``wq_tallies`` keeps the per-epoch,
    per-worker counts. Returns the number of item rows deleted."""
    from sqlalchemy import delete

    if not epochs:
        return 0
    in_epochs = [items.c.queue_id == qid, items.c.epoch.in_(list(epochs))]
    if not keep_events:
        failed_ids = select(items.c.id).where(*in_epochs, items.c.state == FAILED)
        conn.execute(delete(events).where(events.c.queue_id == qid, events.c.epoch.in_(list(epochs)),
                                          events.c.item_id.not_in(failed_ids)))
    done_ids = select(items.c.id).where(*in_epochs, items.c.state == DONE)
    conn.execute(delete(steps).where(steps.c.queue_id == qid, steps.c.item_id.in_(done_ids)))
    return conn.execute(delete(items).where(*in_epochs, items.c.state == DONE)).rowcount



# ---------------------------------------------------------------- checkpoint-consistent consumption


def cover(conn: Connection, b: Dialect, qid: int, worker_id: int, pairs: Sequence[tuple[int, int]],
          step: int, ambiguous: int) -> set[int]:
    """A model checkpoint at global ``step`` covers these claimed items: mark them done, stamped
    with ``step`` (``ckpt_step`` and the ``done`` event's detail), fenced by ``(id, token)`` like
    :func:`complete`, and record the save in ``wq_checkpoints``. Returns the ids accepted."""
    rows: list[Any] = []
    if pairs:
        rows = list(conn.execute(
            update(items).where(_fenced(pairs))
            .values(state=DONE, done_at=b.now(), lease_until=None, ckpt_step=step)
            .returning(items.c.id, items.c.epoch, items.c.seq, items.c.token, *ENDED)))
        accounting.history(conn, b, qid, EV_DONE, rows, worker_id, f"checkpoint step {step}")
        accounting.tally(conn, b, qid, rows, "n_done", worker_id)
    conn.execute(insert(checkpoints).values(queue_id=qid, worker_id=worker_id, action=CK_SAVE, step=step,
                                            items=len(rows), ambiguous=ambiguous, at=b.now()))
    return {r.id for r in rows}


def adopt(conn: Connection, b: Dialect, worker_id: int, holder: int, pairs: Sequence[tuple[int, int]],
          lease_seconds: float) -> set[int]:
    """Take over claimed items that ``holder`` handed to this worker's process, fenced by
    ``(id, token)``: they stay claimed under the same token, now held (and renewed) by
    ``worker_id`` until a checkpoint covers them. Rows already held by ``worker_id`` count as
    accepted (a retry whose first commit went through). Returns the ids accepted."""
    if not pairs:
        return set()
    rows = conn.execute(
        update(items).where(_fenced(pairs), items.c.worker_id.in_([holder, worker_id]))
        .values(worker_id=worker_id, lease_until=b.now_plus(lease_seconds)).returning(items.c.id)).all()
    return {r.id for r in rows}


def reopen_after(conn: Connection, b: Dialect, qid: int, worker_id: int, step: Optional[int],
                 lineages: Sequence[tuple[int, Optional[int]]],
                 since: Optional[tuple[Sequence[int], int]] = None) -> int:
    """A worker restored its model from a checkpoint whose state says ``step`` (``None``: from
    none): put back to ``pending`` every item that the restored model has not trained although a
    checkpoint covered it (``requeue`` events saying why, counters corrected), and record the
    restore. Returns how many.

    ``lineages``: ``(worker id, step)``: that worker's checkpoints after its own ``step`` (its
    steps, which only its own states share) are forgotten: this worker's, the identity that
    saved the restored state if another (a new job run), the ranks that did not come back whose
    states are restored with it. ``since``: ``(worker ids, event id)``: what those workers (ranks
    that did not come back, whose states nobody restores) covered after that event (the
    restored state's save) is forgotten too."""
    owners = [and_(items.c.worker_id == wid, items.c.ckpt_step > s) if s is not None
              else items.c.worker_id == wid for wid, s in lineages]
    if since is not None and since[0]:
        later = (select(events.c.id).where(events.c.queue_id == qid, events.c.item_id == items.c.id,
                                                 events.c.kind == EV_DONE, events.c.id > since[1])
                 .exists())
        owners.append(and_(items.c.worker_id.in_(list(since[0])), later))
    if not owners:
        return 0
    cond = [items.c.queue_id == qid, items.c.state == DONE, items.c.ckpt_step.is_not(None), or_(*owners)]
    locked = select(items.c.id).where(*cond).with_for_update().cte("r").prefix_with("MATERIALIZED")
    rows = conn.execute(
        update(items).where(items.c.id == locked.c.id, items.c.state == DONE)
        .values(state=PENDING, token=None, lease_until=None, done_at=None, ckpt_step=None)
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.worker_id)).all()
    why = (f"model restored from checkpoint step {step}" if step is not None
           else "model restored without a checkpoint")
    accounting.history(conn, b, qid, EV_REQUEUE, rows, worker_id, why, delivery=False)
    accounting.untally(conn, qid, rows, "n_done")
    quarantine.sweep(conn, qid, ids=[r.id for r in rows])
    conn.execute(insert(checkpoints).values(queue_id=qid, worker_id=worker_id, action=CK_RESTORE, step=step,
                                            items=len(rows), ambiguous=0, at=b.now()))
    return len(rows)


def cover_listed(conn: Connection, b: Dialect, qid: int, worker_id: int, writer_id: int, ids: Sequence[int],
                 step: int) -> int:
    """Items a restored state lists as covered by its checkpoint whose writer (another identity,
    gone) never learnt that the checkpoint was saved: done now, stamped with ``step``, under this
    worker, if they are still claimed by the writer or back in the queue (never an item another
    worker holds now, nor one done). Returns how many."""
    if not ids:
        return 0
    rows = list(conn.execute(
        update(items).where(items.c.queue_id == qid, items.c.id.in_(list(ids)),
                            or_(items.c.state == PENDING,
                                and_(items.c.state == CLAIMED, items.c.worker_id == writer_id)))
        .values(state=DONE, done_at=b.now(), lease_until=None, ckpt_step=step, token=None)
        .returning(items.c.id, items.c.epoch, items.c.seq, *ENDED)))
    accounting.history(conn, b, qid, EV_DONE, rows, worker_id, f"checkpoint step {step} (restored)")
    accounting.tally(conn, b, qid, rows, "n_done", worker_id)
    return len(rows)


def worker_ids(conn: Connection, qid: int, names: Sequence[str]) -> dict[str, int]:
    """The row ids of the named worker identities of the queue that exist."""
    if not names:
        return {}
    rows = conn.execute(select(workers.c.name, workers.c.id)
                        .where(workers.c.queue_id == qid, workers.c.name.in_(list(names)))).all()
    return {r.name: int(r.id) for r in rows}


def run_workers(conn: Connection, qid: int, name: str) -> list[tuple[int, str]]:
    """The workers of the job run of the identity ``name`` (``(id, name)``; none without a run)."""
    run = select(workers.c.run_id).where(workers.c.queue_id == qid, workers.c.name == name).scalar_subquery()
    rows = conn.execute(select(workers.c.id, workers.c.name)
                        .where(workers.c.queue_id == qid, workers.c.run_id.is_not(None),
                               workers.c.run_id == run)).all()
    return [(int(r.id), str(r.name)) for r in rows]


def event_mark(conn: Connection) -> int:
    """The newest history row's id: what happened after a moment is what has a higher one."""
    return int(conn.execute(select(func.coalesce(func.max(events.c.id), 0))).scalar_one())

# ---------------------------------------------------------------- operator actions


def requeue(conn: Connection, b: Dialect, qid: int, from_state: str, *, epoch: Optional[int] = None,
            worker_id: Optional[int] = None, lease_expired: bool = False,
            detail: Optional[str] = None) -> list[Any]:
    """Put items of ``from_state`` (``done``, ``failed`` or ``claimed``) back to ``pending``,
    optionally only those of ``epoch``, held last by ``worker_id``, or (claimed) whose lease ran
    out. Writes a ``requeue`` event per item and, for ``done``/``failed`` items, takes them off the
    ``wq_tallies`` counters of the (epoch, worker) that counted them, so progress and
    ``QueueExhausted`` stay exact. Returns the rows moved (``id, epoch, seq, worker_id``).

    ``attempts`` restart at 0 for failed items (the operator grants new attempts) and are kept
    otherwise; no attempt is counted. The token is cleared, so a holder of a requeued claimed item
    is fenced off: its ack is rejected (``LeaseLost``)."""
    if from_state not in (DONE, FAILED, CLAIMED):
        raise ValueError(f"cannot requeue items in state {from_state!r}")
    cond = [items.c.queue_id == qid, items.c.state == from_state]
    if epoch is not None:
        cond.append(items.c.epoch == epoch)
    if worker_id is not None:
        cond.append(items.c.worker_id == worker_id)
    if lease_expired:
        cond.append(items.c.lease_until < b.now())
    # A MATERIALIZED CTE locks the rows first (Postgres re-checks the state of a row a concurrent
    # ack changed meanwhile); on SQLite the caller's BEGIN IMMEDIATE serialises writers.
    locked = select(items.c.id).where(*cond).with_for_update().cte("r").prefix_with("MATERIALIZED")
    values: dict[str, Any] = {"state": PENDING, "token": None, "lease_until": None, "done_at": None,
                              "ckpt_step": None}
    if from_state == FAILED:
        values.update(attempts=0, last_error=None)
    rows = conn.execute(
        update(items).where(items.c.id == locked.c.id, items.c.state == from_state).values(**values)
        .returning(items.c.id, items.c.epoch, items.c.seq, items.c.worker_id, *ENDED)).all()
    # A requeued claimed item ends its delivery; a done or failed one ends none.
    accounting.history(conn, b, qid, EV_REQUEUE, rows,
                       detail=detail or f"operator requeued a {from_state} item",
                       delivery=from_state == CLAIMED)
    if from_state in (DONE, FAILED):
        accounting.untally(conn, qid, rows, "n_done" if from_state == DONE else "n_failed")
    quarantine.sweep(conn, qid, ids=[r.id for r in rows])  # a quarantined work's rows stay out
    return list(rows)


