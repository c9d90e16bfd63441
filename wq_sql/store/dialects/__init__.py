"""Every difference between SQLite and PostgreSQL that the rest of wq_sql needs, in one room.

A :class:`Dialect` answers in SQL expressions (the clock, upserts, array parameters) or in
plain facts (which driver errors are transient, how large an epoch chunk is, what a fork does to
inherited connections). Modules above it ask it instead of branching on the backend's name; the
claim round (``store/hot/claim.py``) keeps its two statement texts side by side and names its dialect once.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Integer,
    Text,
    bindparam,
    func,
    literal_column,
    select,
    text,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.sql.elements import ColumnElement

from wq_sql.errors import InvalidInput
from wq_sql.store.dialects import postgresql as _pg
from wq_sql.store.dialects import sqlite as _sqlite

SQLITE, POSTGRESQL = "sqlite", "postgresql"

# Item rows per transaction when a worker makes the next epoch (``epochs.EpochMaker``): a few ms
# of SQLite's write lock, a few MB of Postgres WAL.
EPOCH_CHUNK_SQLITE = 2_000
EPOCH_CHUNK_PG = 10_000

# SQLite's clock as text in SQLAlchemy's storage format (microseconds, six digits), now and a
# bound number of seconds later ('+60.0 seconds'): text timestamps compare as strings.
SQLITE_NOW = "(strftime('%Y-%m-%d %H:%M:%f', 'now') || '000')"
SQLITE_LATER = "(strftime('%Y-%m-%d %H:%M:%f', 'now', ?) || '000')"

# Postgres: the transaction this starts commits without waiting for its WAL flush. For what a
# server crash may lose harmlessly: a leave that gives back nothing (``Outcomes.leave``), and a
# ring, which is best effort (a NOTIFY gives its transaction an id, so its commit would wait for
# a flush of its own, at the end of every drain, on the last worker's path).
PG_LAZY_COMMIT = "SET LOCAL synchronous_commit = off; "


def pg_bigints(values: Iterable[int]) -> str:
    """Postgres: integers as the text of an array literal (``'{1,2,3}'``), for a parameter cast
    with ``::bigint[]``. psycopg2 adapts a Python list element by element, as ``ARRAY[...]``,
    an adapter call per integer while holding the GIL, where this is one ``join``; it runs on
    the refill thread while the pipeline's own threads wait for the GIL. ``int()`` makes
    anything else an error, never SQL text."""
    return "{" + ",".join(map(str, map(int, values))) + "}"


# Why a Postgres error is worth retrying: the connection is gone, or could not be made, or the
# server it reached no longer takes writes (a primary turned standby or read-only: failover).
LOST = ("disconnected", "cannot connect", "read-only")
# A server that answers, but cannot take this connection yet: worth waiting for on a first connect.
# The last two are libpq's when target_session_attrs=read-write (or primary) found no primary
# among the hosts of a multi-host URL: a failover in progress.
_SERVER_BUSY = ("the database system is starting up", "too many clients", "remaining connection slots",
                "session is read-only", "server is in hot standby mode")
# SQLSTATE read_only_sql_transaction: a write on a standby, or on a server made read-only.
_READ_ONLY = _pg.READ_ONLY
# Postgres' key for "the wq_sql migration lock" among a database's advisory locks (any constant).
_PG_MIGRATION_LOCK = 0x77715F73716C
# The queue's claim lock (with the queue id as second key): see claim_round.sql and migration 0011.
CLAIM_LOCK = 2003835757


@dataclass(frozen=True)
class Dialect:
    """The backend of one engine: ``"sqlite"`` or ``"postgresql"``."""

    name: str

    @property
    def is_sqlite(self) -> bool:
        return self.name == SQLITE

    # ------------------------------------------------------------------ engines

    def check_url(self, url: URL, shown: str) -> URL:
        """``url`` with wq_sql's driver; :class:`InvalidInput` for a URL that cannot be meant."""
        if self.is_sqlite:
            _sqlite.check_url(url, shown)
            return url
        return _pg.with_driver(url) if self.name == POSTGRESQL else url

    def make_engine(self, url: URL, *, schema: Optional[str], busy_timeout: float,
                    statement_timeout: Optional[float], startup_options: bool, pool_size: int,
                    autocheckpoint: bool, lock_slice: Optional[float]) -> Engine:
        """A new engine for ``url`` (see ``engine.make_engine`` for the options)."""
        if self.name not in (SQLITE, POSTGRESQL):
            raise InvalidInput(f"unsupported database {self.name!r}: use sqlite:///file.db or postgresql://...")
        if self.is_sqlite:
            return _sqlite.make_engine(url, schema=schema, busy_timeout=busy_timeout, pool_size=pool_size,
                                       autocheckpoint=autocheckpoint, lock_slice=lock_slice)
        return _pg.make_engine(url, schema=schema, statement_timeout=statement_timeout,
                               startup_options=startup_options, pool_size=pool_size)

    def writer_queue(self, url: URL) -> Optional[_sqlite.WriterQueue]:
        """SQLite: the queue that hands the write lock of the file ``url`` names to this host's
        writers in the order they asked (``WriterQueue.turn()`` around each write transaction,
        from before ``BEGIN IMMEDIATE`` to after its end); None on Postgres (row locks, no single
        write lock), for an in-memory database, or where it cannot work (see
        ``sqlite.writer_queue``)."""
        return _sqlite.writer_queue(url) if self.is_sqlite else None

    def open_error(self, url: URL, e: DBAPIError, detail: str, shown: str, given: str) -> Optional[str]:
        """The one-line message, naming the fix, of ``e`` if it says that the database cannot be
        reached or opened; else None."""
        if self.is_sqlite:
            return _sqlite.open_error(url, detail, given)
        return _pg.open_error(url, e, detail, shown, given)

    # ------------------------------------------------------------------ the clock

    def now(self) -> ColumnElement[Any]:
        """The database clock, as a value comparable to stored timestamps.

        SQLite's text timestamps compare as strings, so the format must match SQLAlchemy's
        storage format exactly (microseconds, six digits)."""
        return literal_column(SQLITE_NOW if self.is_sqlite else "clock_timestamp()")

    def now_plus(self, seconds: float) -> ColumnElement[Any]:
        s = repr(float(seconds))  # a float we produced, never user text
        if self.is_sqlite:
            return literal_column(f"(strftime('%Y-%m-%d %H:%M:%f', 'now', '{s} seconds') || '000')")
        return literal_column(f"(clock_timestamp() + interval '{s} seconds')")

    def seconds_since(self, column: Any) -> ColumnElement[Any]:
        """Seconds from a stored timestamp to the database clock, as a float, in SQL."""
        if self.is_sqlite:
            return (func.julianday("now") - func.julianday(column)) * 86400.0
        return func.extract("epoch", literal_column("clock_timestamp()") - column)

    @staticmethod
    def clock_value(value: Any) -> dt.datetime:
        """A value of :meth:`now` as read back (SQLite: its text), as an aware UTC datetime."""
        if isinstance(value, str):
            value = dt.datetime.fromisoformat(value[:26])
        return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)

    def db_now(self, conn: Connection) -> dt.datetime:
        """The database clock, read now."""
        return self.clock_value(conn.execute(select(self.now())).scalar_one())

    # ------------------------------------------------------------------ statements

    def insert(self, table: Any) -> Any:
        """An INSERT that supports ``on_conflict_do_nothing`` / ``on_conflict_do_update``."""
        from sqlalchemy.dialects import postgresql, sqlite

        return sqlite.insert(table) if self.is_sqlite else postgresql.insert(table)

    def int_rows(self, values: str) -> tuple[Any, Any, Any]:
        """A table of ``values`` (ints joined by commas) sent as one parameter: (the table, the
        0-based position column, the value column). Postgres ``unnest ... WITH ORDINALITY``,
        SQLite ``json_each``: a million values cost no per-value Python objects."""
        if self.is_sqlite:
            js = bindparam("order", "[" + values + "]", type_=Text)
            rows = func.json_each(js).table_valued("key", "value")
            return rows, rows.c.key, rows.c.value
        arr = sql_cast(bindparam("order", "{" + values + "}", type_=Text), ARRAY(Integer))
        rows = func.unnest(arr).table_valued("idx", with_ordinality="ord").render_derived()
        return rows, rows.c.ord - 1, rows.c.idx

    def int_columns(self, columns: Sequence[Sequence[int]]) -> tuple[Any, Any, list[Any]]:
        """A table of several int columns of equal length, sent as one parameter each (Postgres
        ``unnest(a, b, ...) WITH ORDINALITY``) or as one JSON array of rows (SQLite
        ``json_each``): (the table, its 0-based position column, the columns). Values must fit
        a bigint."""
        if self.is_sqlite:
            body = ",".join("[" + ",".join(map(str, r)) + "]" for r in zip(*columns))
            js = bindparam("rows", "[" + body + "]", type_=Text)
            rows = func.json_each(js).table_valued("key", "value")
            return rows, rows.c.key, [func.json_extract(rows.c.value, f"$[{k}]") for k in range(len(columns))]
        arrays = [sql_cast(bindparam(f"c{k}", "{" + ",".join(map(str, c)) + "}", type_=Text),
                           ARRAY(BigInteger)) for k, c in enumerate(columns)]
        names = [f"c{k}" for k in range(len(columns))]
        rows = func.unnest(*arrays).table_valued(*names, with_ordinality="ord").render_derived()
        return rows, rows.c.ord - 1, [rows.c[n] for n in names]

    def lock_claims(self, conn: Connection, qid: int, *, shared: bool = False) -> None:
        """Hold back every claim of queue ``qid`` until this transaction ends (a change of its
        pending rows: a mix change, a quarantine). Postgres: the queue's claim lock, exclusive
        (``wq_claim_round()`` takes it shared); ``shared``: as the claims take it, to wait for
        such a change instead (the quarantine's sweep). SQLite: nothing, the transaction's
        ``BEGIN IMMEDIATE`` already excludes every other writer."""
        if not self.is_sqlite:
            how = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
            conn.execute(text(f"SELECT {how}(:k, :q)"), {"k": CLAIM_LOCK, "q": qid})

    def lock_for_migration(self, conn: Connection) -> None:
        """Serialise schema upgrades: Postgres takes a transaction-scoped advisory lock; on
        SQLite the transaction began with ``BEGIN IMMEDIATE``, which already excludes writers."""
        if not self.is_sqlite:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})

    @property
    def snapshot_options(self) -> dict[str, Any]:
        """Execution options under which several reads see one snapshot (SQLite's transactions
        always do)."""
        return {} if self.is_sqlite else {"isolation_level": "REPEATABLE READ"}

    def commit_horizon(self, conn: Connection) -> Optional[tuple[int, int]]:
        """For readers that follow a table by its id (``snapshot.HistoryCounts``): ids are taken when
        a row is inserted and become visible when its transaction commits, not in id order.

        SQLite: None, ids are visible in order (one writer at a time, from ``BEGIN IMMEDIATE``
        to its commit). Postgres: ``(xmin, xmax)`` of the caller's snapshot, as numbers: every
        transaction that took an id at most the highest one this snapshot sees had its
        transaction id below ``xmax`` (wq_sql writes an item row before the history rows of that
        change), so once a later snapshot's ``xmin`` reaches it, those ids are all settled."""
        if self.is_sqlite:
            return None
        row = conn.execute(text("SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint "
                                "FROM pg_current_snapshot() AS s")).one()
        return int(row[0]), int(row[1])

    # ------------------------------------------------------------------ offline DDL (upgrade --sql)

    def ddl_preamble(self, schema: Optional[str], new: bool) -> list[str]:
        """Lines before an offline upgrade script. Alembic wraps Postgres's script in
        BEGIN/COMMIT but not SQLite's, whose DDL is transactional too: one transaction, so that a
        script failing halfway leaves the old revision intact. Postgres' offline DDL names its
        tables unqualified: a schema comes from the search path."""
        if self.is_sqlite:
            return ["BEGIN;"]
        if not schema:
            return []
        create = [f'CREATE SCHEMA IF NOT EXISTS "{schema}";'] if new else []
        return create + [f'SET search_path TO "{schema}";\n']

    def ddl_postscript(self) -> list[str]:
        return ["COMMIT;"] if self.is_sqlite else []

    # ------------------------------------------------------------------ facts

    @property
    def naive_timestamps(self) -> bool:
        """Whether timestamps are stored without a zone (SQLite: in UTC, as text)."""
        return self.is_sqlite

    @property
    def epoch_chunk(self) -> int:
        return EPOCH_CHUNK_SQLITE if self.is_sqlite else EPOCH_CHUNK_PG

    @property
    def close_inherited(self) -> bool:
        """After ``fork()``, whether the child closes the connections it inherited. SQLite: yes,
        or its new ones share their in-process lock state (copied by fork) instead of taking real
        file locks, and the parent's last close deletes the WAL under the child's feet. An
        inherited connection cannot take the write lock while the parent holds the database
        open, so closing is safe. Postgres: never close the parent's sockets."""
        return self.is_sqlite

    @property
    def wal_checkpoint(self) -> Optional[str]:
        """The statement that copies committed WAL pages into the database file, waiting for no
        reader or writer (SQLite); None where the server does it."""
        return "PRAGMA wal_checkpoint(PASSIVE)" if self.is_sqlite else None

    @property
    def begin_write(self) -> Optional[str]:
        """What a write transaction on a raw driver connection starts with (None: the driver
        begins on the first statement). SQLite takes its single write lock up front."""
        return "BEGIN IMMEDIATE" if self.is_sqlite else None

    @property
    def one_query_rounds(self) -> bool:
        """Whether a claim round goes as one simple query that is its own transaction
        (``engine.driver_statement``): Postgres, where each statement is a network round trip;
        SQLite's statements are in-process calls, run inside ``BEGIN IMMEDIATE``."""
        return not self.is_sqlite

    def transient(self, e: DBAPIError, reached: bool) -> Optional[str]:
        """Why ``e`` is worth retrying, or None: SQLite's lock (``"locked"``), a lost or refused
        Postgres connection or a server that no longer takes writes (one of :data:`LOST`), a
        deadlock or serialization failure. Before ``reached`` (no transaction of this client
        succeeded yet), a connection that could not be made is not worth retrying, unless the
        server said it is busy (or, through a multi-host URL, that no host is a primary yet);
        one that was made and then lost is."""
        if self.is_sqlite:
            msg = str(e.orig)
            return "locked" if ("locked" in msg or "busy" in msg) else None
        code = getattr(e.orig, "pgcode", None)
        lost: Optional[str] = None
        if e.connection_invalidated:
            lost = "disconnected"
        elif code is None and isinstance(e, OperationalError):
            msg = str(e.orig)
            if any(m in msg for m in ("authentication", "does not exist", "no password", "permission")):
                return None  # a configuration error: retrying cannot help
            lost = "cannot connect"  # refused, reset, server starting up: psycopg2 gives no code
        elif code and (code.startswith("08") or code in ("57P01", "57P02", "57P03")):
            lost = "disconnected"
        elif code == _READ_ONLY:
            lost = "read-only"  # the caller reconnects: see Db.retrying
        if lost is not None:
            # A connection made and then lost (a restart, a failover, a terminated session) is
            # worth waiting for even on a first transaction; one that could not be made is a
            # wrong URL or a server not started, unless the server said it is busy.
            made = lost == "disconnected"
            return lost if reached or made or any(m in str(e.orig) for m in _SERVER_BUSY) else None
        if code in ("40P01", "40001"):
            return "deadlock or serialization failure"
        return None


def qualifier(schema: Optional[str]) -> str:
    """What goes before a table's name in a hand-written statement: ``"schema".`` for a queue in
    a Postgres schema (a plain identifier, checked where the schema is given), else nothing."""
    return f'"{schema}".' if schema else ""


def sqlite_file(url: URL) -> Optional[Path]:
    """The file a SQLite URL names (None: another backend, or an in-memory database)."""
    if url.get_backend_name() != SQLITE or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).expanduser()


def dialect_of(bind: Engine | Connection | URL) -> Dialect:
    """The :class:`Dialect` of an engine, a connection or a URL (a source table's database may
    be another backend: it gets Postgres' answers, which are standard SQL)."""
    name = bind.get_backend_name() if isinstance(bind, URL) else bind.dialect.name
    return Dialect(POSTGRESQL if name == "postgres" else name)  # postgres:// is libpq's alias

