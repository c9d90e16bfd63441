"""Tables of the job table, as typed SQLAlchemy 2.x models, and the audit views.

Every state-changing statement lives in ``wq_sql.store.statements``; this module only declares.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Callable, Optional

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from wq_sql.states import CHECKPOINT_ACTIONS, CLAIMED, EVENT_KINDS, ITEM_STATES, PENDING
from wq_sql.store.dialects import Dialect, qualifier

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Foreign keys that the hot path would check on Postgres at every claim (the claiming worker's
# row) and every history row (the queue's row), and that Postgres therefore does not have
# (migration 0009): each check runs a trigger and takes a KEY SHARE lock on the parent row, and
# with every worker's acknowledgements locking the one queue row at once, Postgres made a new
# MultiXact for nearly every claim round and spent a large share of a round's server CPU on
# the checks (docs/design.md, "Tables"). wq_sql writes these
# columns only from rows it has just read in the same transaction and deletes children before
# parents (statements.drop_queue), so the constraints only restated what the code does. SQLite keeps
# them: its checks are in-process and lock nothing (a single writer).
SQLITE_ONLY_FOREIGN_KEYS = ("fk_wq_items_worker_id_wq_workers", "fk_wq_events_queue_id_wq_queues",
                            "fk_wq_steps_queue_id_wq_queues")


def foreign_keys_of(dialect: str) -> Callable[..., bool]:
    """For Alembic's autogenerate, an ``include_object`` that leaves out the foreign keys the
    ``dialect``'s databases do not have on purpose (``SQLITE_ONLY_FOREIGN_KEYS`` on Postgres),
    which it would otherwise propose to add (it does not read ``ddl_if``)."""
    def include(obj: Any, name: Optional[str], type_: str, reflected: bool, compare_to: Any) -> bool:
        return (dialect == "sqlite" or type_ != "foreign_key_constraint"
                or name not in SQLITE_ONLY_FOREIGN_KEYS)
    return include


def _sqlite_only_fk(column: str, refers: str, ondelete: str) -> ForeignKeyConstraint:
    fk = ForeignKeyConstraint([column], [refers], ondelete=ondelete)
    return fk.ddl_if(dialect="sqlite")


# SQLite has no 64-bit autoincrement type other than INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC timestamp that round-trips on SQLite (stored naive, in UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Optional[dt.datetime], dialect: Any) -> Optional[dt.datetime]:
        if value is not None and value.tzinfo is not None and Dialect(dialect.name).naive_timestamps:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Optional[dt.datetime], dialect: Any) -> Optional[dt.datetime]:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Queue(Base):
    """One queue (DeepRec's ``name``): its configuration and how many epochs have rows."""

    __tablename__ = "wq_queues"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    works_digest: Mapped[str] = mapped_column(String(64))
    n_works: Mapped[int] = mapped_column(Integer)  # items per epoch
    num_epochs: Mapped[int] = mapped_column(BigInteger)
    shuffle: Mapped[bool] = mapped_column(Boolean)
    seed: Mapped[int] = mapped_column(BigInteger)
    num_slices: Mapped[Optional[int]] = mapped_column(Integer)
    prefix: Mapped[Optional[str]] = mapped_column(Text)
    max_attempts: Mapped[int] = mapped_column(Integer)
    # Epochs 0 .. epochs_created-1 have item rows; the next is made on demand, exactly once.
    epochs_created: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime, server_default=text("CURRENT_TIMESTAMP"))
    # Bumped by every quarantine: a worker whose claim round sees it change drops from its
    # buffer the items it no longer holds.
    revoked: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Work(Base):
    """The works of a queue after normalisation (and slicing), in the order given."""

    __tablename__ = "wq_works"

    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    work: Mapped[str] = mapped_column(Text)
    # Sliced works only: JSON that tells the work's source which records the item reads (for a
    # table, the key range counted at creation), so reads stay stable while the data changes.
    bounds: Mapped[Optional[str]] = mapped_column(Text)


class Worker(Base):
    """A worker identity within a queue; ``incarnation`` changes each time a process takes it."""

    __tablename__ = "wq_workers"
    __table_args__ = (UniqueConstraint("queue_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    incarnation: Mapped[str] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    proc_start: Mapped[Optional[int]] = mapped_column(BigInteger)
    started_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    # NULL once the worker closed cleanly.
    heartbeat_at: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)
    # How often this incarnation beats (seconds): others judge it stale after missed beats.
    beat_seconds: Mapped[Optional[float]] = mapped_column(Float)
    # Items it has claimed but not yet handed to its consumer, as of its last heartbeat.
    buffered: Mapped[Optional[int]] = mapped_column(Integer)
    # The job run it belongs to (torchrun's TORCHELASTIC_RUN_ID) and that run's restart count:
    # a worker of a later restart of the run returns this one's items at once.
    run_id: Mapped[Optional[str]] = mapped_column(String(200))
    run_restart: Mapped[Optional[int]] = mapped_column(Integer)
    # Seconds the training loop of this incarnation's process waited for its next batch, summed
    # (the shims measure it; NULL: not measured), as of its last heartbeat or its close.
    input_wait: Mapped[Optional[float]] = mapped_column(Float)


class Item(Base):
    """One work item of one epoch. ``seq`` is its hand-out position within the epoch."""

    __tablename__ = "wq_items"
    __table_args__ = (
        UniqueConstraint("queue_id", "epoch", "seq"),
        _sqlite_only_fk("worker_id", "wq_workers.id", "SET NULL"),
        CheckConstraint(_in("state", ITEM_STATES), name="state"),
        # The claim's ORDER BY, on claimable rows only.
        Index(
            "ix_wq_items_pending",
            "queue_id",
            "epoch",
            "seq",
            sqlite_where=text(f"state = '{PENDING}'"),
            postgresql_where=text(f"state = '{PENDING}'"),
        ),
        # Lease expiry, heartbeat renewal and crash recovery scan only claimed rows.
        Index(
            "ix_wq_items_claimed",
            "queue_id",
            "worker_id",
            "lease_until",
            sqlite_where=text(f"state = '{CLAIMED}'"),
            postgresql_where=text(f"state = '{CLAIMED}'"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"))
    epoch: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    work_idx: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), server_default=PENDING)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    worker_id: Mapped[Optional[int]] = mapped_column(Integer)
    token: Mapped[Optional[int]] = mapped_column(BigInteger)
    claimed_at: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)
    lease_until: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)
    done_at: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)
    last_error: Mapped[Optional[str]] = mapped_column(Text)
    # Checkpoint-consistent consumption only: the global step of the holder's checkpoint that
    # covered this item and made it done (NULL for items done otherwise). Restoring an older
    # checkpoint re-opens the holder's items with a larger step.
    ckpt_step: Mapped[Optional[int]] = mapped_column(BigInteger)
    # Weighted queues only (``wq_sources``): the source this row was drawn from and its position
    # in that source's stream (``wq_sql.mixing``); NULL in a queue without sources.
    source: Mapped[Optional[int]] = mapped_column(Integer)
    draw: Mapped[Optional[int]] = mapped_column(BigInteger)
    # When the row was made claimable: its epoch's rows were written (the database clock). A
    # requeue, and a mix change's redraw in place, keep it (a message queue's age counts from
    # the enqueue), so the age of the oldest pending item (the metric) is the first pending
    # row's in claim order: one descent of the pending index. NULL: made before revision 0015.
    pending_since: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)


class SourceRow(Base):
    """One named source of a weighted queue: its works are ``wq_works`` rows ``first`` ..
    ``first + n_works - 1``; ``weight`` is the weight in force (changed by ``wq-sql mix``),
    ``drawn`` the next position of its stream (``wq_sql.mixing``)."""

    __tablename__ = "wq_sources"

    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    first: Mapped[int] = mapped_column(Integer)
    n_works: Mapped[int] = mapped_column(Integer)
    weight: Mapped[float] = mapped_column(Float)
    drawn: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # JSON list of positions >= drawn that item rows hold (left by a mix change), or NULL.
    skip: Mapped[Optional[str]] = mapped_column(Text)


class MixChange(Base):
    """One change of a weighted queue's weights (and its creation): who, when, the weights set
    (JSON, source name -> weight), and where it took effect: the first epoch it redrew and how
    many undelivered rows it redrew."""

    __tablename__ = "wq_mixes"
    __table_args__ = (Index("ix_wq_mixes_queue", "queue_id", "id"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    by: Mapped[str] = mapped_column(String(300))
    weights: Mapped[str] = mapped_column(Text)
    epoch: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    redrawn: Mapped[int] = mapped_column(BigInteger)


class QuarantineRow(Base):
    """One work in quarantine (``wq-sql quarantine``): no claim, requeue, restore or later epoch
    delivers its items until it is taken out (``wq-sql unquarantine``)."""

    __tablename__ = "wq_quarantine"

    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"), primary_key=True)
    work_idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    by: Mapped[str] = mapped_column(String(300))
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class Tally(Base):
    """Counters per (queue, epoch, worker): each worker only writes its own rows, so acks never
    contend on a shared counter; progress is a sum over a handful of rows, never a scan of items."""

    __tablename__ = "wq_tallies"

    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    n_done: Mapped[int] = mapped_column(BigInteger, server_default="0")
    n_failed: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Items in quarantine, counted on the epoch's row of worker id 0 (``QUARANTINE_TALLY``).
    n_quarantined: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Event(Base):
    """Append-only history: one row per delivery, written in the transaction that ended it (and
    one per requeue of a done or failed item, ``claimed_at`` NULL). See ``wq_sql.states``."""

    __tablename__ = "wq_events"
    __table_args__ = (
        CheckConstraint(_in("kind", EVENT_KINDS), name="kind"),
        Index("ix_wq_events_queue_item", "queue_id", "item_id"),
        _sqlite_only_fk("queue_id", "wq_queues.id", "CASCADE"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    queue_id: Mapped[int] = mapped_column(Integer)
    item_id: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(10))
    worker_id: Mapped[Optional[int]] = mapped_column(Integer)
    token: Mapped[Optional[int]] = mapped_column(BigInteger)
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime)  # when the delivery ended
    detail: Mapped[Optional[str]] = mapped_column(Text)
    # The delivery this row ends: when its holder claimed the item (``wq_items.claimed_at``: a
    # delivery begun by a recovery keeps the claim's time) and ``wq_items.attempts`` during it
    # (failed attempts before it: 0 on the first). NULL on a requeue of a done or failed item.
    claimed_at: Mapped[Optional[dt.datetime]] = mapped_column(UTCDateTime)
    attempt: Mapped[Optional[int]] = mapped_column(Integer)


class CheckpointRecord(Base):
    """One checkpoint save or restore of one worker (checkpoint-consistent consumption):
    ``items`` is how many items the save covered (made done) or the restore re-opened;
    ``ambiguous`` how many hand-outs overlapped the save and were left for a later one."""

    __tablename__ = "wq_checkpoints"
    __table_args__ = (
        CheckConstraint(_in("action", CHECKPOINT_ACTIONS), name="action"),
        Index("ix_wq_checkpoints_queue_worker", "queue_id", "worker_id", "step"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    queue_id: Mapped[int] = mapped_column(ForeignKey("wq_queues.id", ondelete="CASCADE"))
    worker_id: Mapped[int] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(10))
    step: Mapped[Optional[int]] = mapped_column(BigInteger)  # NULL: a restore without checkpoint
    items: Mapped[int] = mapped_column(Integer)
    ambiguous: Mapped[int] = mapped_column(Integer, server_default="0")
    at: Mapped[dt.datetime] = mapped_column(UTCDateTime)


class StepRecord(Base):
    """Lineage (``lineage=True`` in the shims): one row per training step of a rank and item the
    step's batch held, with the range of the item's records it held (``first_record`` ..
    ``last_record``, 0-based positions in what the reader yields for the item, both included).
    ``worker`` is the rank's identity; ``run`` counts the rank's trainer-side starts and
    restores (a restored checkpoint numbers its steps again from the state's step)."""

    __tablename__ = "wq_steps"
    __table_args__ = (
        Index("ix_wq_steps_item", "item_id"),
        # Written in every acknowledgement transaction: no key check on Postgres (decision 3).
        _sqlite_only_fk("queue_id", "wq_queues.id", "CASCADE"),
    )

    queue_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker: Mapped[str] = mapped_column(String(200), primary_key=True)
    run: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    # The row's place in the step's batch: its records come after those of parts 0 .. part - 1.
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    item_id: Mapped[int] = mapped_column(BigInteger)
    first_record: Mapped[int] = mapped_column(BigInteger)
    last_record: Mapped[int] = mapped_column(BigInteger)


# Stable, documented views for auditors. Plain SQL, identical on both backends.
AUDIT_VIEW = "wq_audit"
AUDIT_VIEW_SQL = """
SELECT q.name AS queue, i.epoch AS epoch, i.seq AS seq, w.work AS work,
       wk.name AS worker, i.state AS state, i.attempts AS attempts,
       i.claimed_at AS claimed_at, i.done_at AS done_at, i.last_error AS last_error,
       i.id AS item_id, src.name AS source
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
LEFT JOIN {s}wq_sources src ON src.queue_id = i.queue_id AND src.idx = i.source
"""

EVENTS_VIEW = "wq_history"
# One row per stored event, plus a 'claim' row per delivery, made from the row that ended it (at
# its claimed_at) or, while it is in flight, from the claimed item row. A delivery that began
# with a recovery has no claim row: the 'recover' row before it stands for its start, as it did
# when claims were stored. event_id: a stored row's id; a claim made from an ending row sits just
# before it (id - 0.5), one made from an item row after every stored row (max id + 0.5). So each
# item's rows in event_id order read as they did; across items, order by ``at``.
EVENTS_VIEW_SQL = """
SELECT q.name AS queue, e.epoch AS epoch, e.seq AS seq, e.kind AS kind,
       wk.name AS worker, e.at AS at, e.detail AS detail, e.item_id AS item_id, e.id AS event_id,
       src.name AS source
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
LEFT JOIN {s}wq_items si ON si.id = e.item_id
LEFT JOIN {s}wq_sources src ON src.queue_id = e.queue_id AND src.idx = si.source
UNION ALL
SELECT q.name, e.epoch, e.seq, 'claim', wk.name, e.claimed_at, NULL, e.item_id,
       e.id - CAST(0.5 AS DOUBLE PRECISION), src.name
FROM {s}wq_events e
JOIN {s}wq_queues q ON q.id = e.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = e.worker_id
LEFT JOIN {s}wq_items si ON si.id = e.item_id
LEFT JOIN {s}wq_sources src ON src.queue_id = e.queue_id AND src.idx = si.source
WHERE e.claimed_at IS NOT NULL AND e.kind <> 'claim'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = e.queue_id
                AND p.item_id = e.item_id AND p.id < e.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
UNION ALL
SELECT q.name, i.epoch, i.seq, 'claim', wk.name, i.claimed_at, NULL, i.id,
       (SELECT COALESCE(MAX(x.id), 0) FROM {s}wq_events x) + CAST(0.5 AS DOUBLE PRECISION),
       src.name
FROM {s}wq_items i
JOIN {s}wq_queues q ON q.id = i.queue_id
LEFT JOIN {s}wq_workers wk ON wk.id = i.worker_id
LEFT JOIN {s}wq_sources src ON src.queue_id = i.queue_id AND src.idx = i.source
WHERE i.state = 'claimed'
  AND COALESCE((SELECT p.kind FROM {s}wq_events p WHERE p.queue_id = i.queue_id
                AND p.item_id = i.id ORDER BY p.id DESC LIMIT 1), '') <> 'recover'
"""

LINEAGE_VIEW = "wq_lineage"
# One row per (step, item) of ``wq_steps``, with the item's epoch, seq and work and the step of
# the checkpoint that made it done (consumed="checkpoint"; NULL otherwise). Rows of items
# compacted away (``wq-sql compact``) go with them.
LINEAGE_VIEW_SQL = """
SELECT q.name AS queue, l.run AS run, l.worker AS worker, l.step AS step, l.part AS part,
       i.epoch AS epoch, i.seq AS seq, w.work AS work, l.first_record AS first_record,
       l.last_record AS last_record, i.ckpt_step AS checkpoint, l.item_id AS item_id
FROM {s}wq_steps l
JOIN {s}wq_queues q ON q.id = l.queue_id
JOIN {s}wq_items i ON i.id = l.item_id
JOIN {s}wq_works w ON w.queue_id = i.queue_id AND w.idx = i.work_idx
"""

VIEWS = {AUDIT_VIEW: AUDIT_VIEW_SQL, EVENTS_VIEW: EVENTS_VIEW_SQL, LINEAGE_VIEW: LINEAGE_VIEW_SQL}


def create_view_sql(name: str, schema: Optional[str] = None) -> str:
    """``CREATE VIEW`` for one of :data:`VIEWS`, its tables qualified by ``schema`` when given."""
    s = qualifier(schema)
    return f"CREATE VIEW {s}{name} AS {VIEWS[name].format(s=s)}"


def drop_view_sql(name: str, schema: Optional[str] = None) -> str:
    s = qualifier(schema)
    return f"DROP VIEW IF EXISTS {s}{name}"
