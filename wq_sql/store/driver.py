"""Driver-level connections: the hot path's transactions and statements on the driver's own
connection (sqlite3, psycopg2), where SQLAlchemy's per-connection and per-statement machinery
would cost as much as SQLite's own work. ``driver_transaction`` (a write transaction),
``driver_statement`` (Postgres: one query that is a whole transaction), ``driver_read`` (a
read-only statement), ``HotConnection`` (SQLite's one connection kept out of the pool for the
hot path), and ``DriverTx`` / ``last_rows``, which make the same code work directly and through
a transaction pooler. Only ``wq_sql.store`` uses them: the runtime calls ``Db``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from wq_sql.store.dialects import dialect_of, postgresql
from wq_sql.store.dialects.postgresql import PER_TX, psycopg3

T = TypeVar("T")


def _rolled_back_or_gone(dialect: Any, conn: Any, e: BaseException, rollback: Callable[[], object]) -> bool:
    """After ``e`` ended a driver-level transaction on ``conn``: whether the connection is gone
    (the driver or SQLAlchemy says so, or the rollback itself failed); else it was rolled back."""
    driver_error = dialect.loaded_dbapi.Error
    gone = isinstance(e, driver_error) and dialect.is_disconnect(e, conn, None)
    if isinstance(e, DBAPIError):
        gone = gone or e.connection_invalidated
    if not gone:
        try:
            rollback()
        except driver_error:
            gone = True
    return bool(gone)


@contextmanager
def driver_transaction(engine: Engine,
                       turn: Optional[AbstractContextManager[None]] = None) -> Iterator[Any]:
    """A write transaction on a pooled connection, used through the driver itself (sqlite3 or
    psycopg2): the claim round on SQLite (on Postgres it is one query: :func:`driver_statement`)
    and acknowledgements outside a round, where SQLAlchemy's per-connection and per-statement
    machinery cost as much as SQLite's own work. SQLite: ``BEGIN IMMEDIATE`` first, as for
    every write transaction here; psycopg2 begins on the first statement. Commits on success;
    rolls back otherwise. Driver errors come out as SQLAlchemy's
    ``DBAPIError`` (``connection_invalidated`` set, and the connection dropped from the pool, when
    it is gone), as from ``Connection.execute``, so the callers' retry logic is the same.

    ``turn``: held from after the connection is checked out (a turn held while waiting for a
    pooled connection could wait for a thread that waits for the turn) until after the commit
    or rollback: SQLite's writers' queue (``Dialect.writer_queue``)."""
    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error
    fairy = _checkout(engine)
    conn: Any = fairy.dbapi_connection
    begin = dialect_of(engine).begin_write
    tx = DriverTx.of(fairy, conn)  # Postgres: BEGIN and the timeouts in one round trip
    try:
        with turn or nullcontext():  # the writers' queue: released after the commit or rollback
            try:
                if begin:
                    conn.execute(begin)
                tx.begin()
                yield conn
                tx.commit()
            except BaseException as e:
                gone = _rolled_back_or_gone(dialect, conn, e, tx.rollback)
                if gone:
                    fairy.invalidate(e if isinstance(e, Exception) else None)
                if isinstance(e, driver_error):
                    raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e
                raise
    finally:
        tx.close()
        fairy.close()


class HotConnection:
    """SQLite: one driver connection kept out of the pool for the write transactions of the hot
    path (the claim round, acknowledgements: ``Db.driver_tx``), used by whichever thread finds it
    free. Through the pool, each round paid a checkout and a check-in (with its reset), and
    consecutive rounds alternated between the pool's connections, so each found the other's
    commit and SQLite dropped its page cache: a cost every round paid, which at lease-ahead 1
    is every ``take()``. A thread that finds it taken (the refill thread during a take's round)
    uses the pool as before.

    The connection is made by the pool (its connect hook sets WAL, ``isolation_level``, ...) and
    then detached from it, so the pool keeps its whole capacity for the other threads. Fork
    safety as for pooled connections (``Dialect.close_inherited``): :meth:`close` before a
    ``fork()`` (``db._before_fork``, once no transaction is in flight) so the child inherits
    none; a child that finds one anyway (a fork not announced to Python) closes it unused."""

    __slots__ = ("_engine", "_lock", "_conn", "_pid", "closed")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._conn: Any = None
        self._pid = os.getpid()
        self.closed = False

    def transaction(self, fn: Callable[[Any], T], enter: Callable[[], int],
                    leave: Callable[[int], None]) -> T | Busy:
        """``fn(conn)`` in one write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back
        on an error), holding the writers' turn (``enter()`` returns what ``leave()`` takes) from
        before the ``BEGIN`` to after its end, as :func:`driver_transaction` does; driver errors
        come out as SQLAlchemy's ``DBAPIError``. Returns :data:`BUSY` at once, running nothing, if
        another thread uses the connection, or once closed."""
        with self._using() as conn:
            if conn is None:
                return BUSY
            ticket = enter()
            try:
                conn.execute("BEGIN IMMEDIATE")
                result = fn(conn)
                conn.commit()
            except BaseException as e:
                self._abort(conn, e)
                raise  # not reached for a driver error: _abort raises it as SQLAlchemy's
            finally:
                leave(ticket)
            return result

    def read(self, fn: Callable[[Any], T]) -> T | Busy:
        """``fn(conn)``, ONE read-only statement in autocommit mode (as :func:`driver_read` runs
        it), on this connection when no other thread uses it: a worker's reads (``poll.Poll``)
        need no second connection, whose connect and page cache a DataLoader worker of
        ``wq_sql.torch`` would pay each pass. Returns :data:`BUSY`
        at once, running nothing, if another thread uses it, or once closed."""
        with self._using() as conn:
            if conn is None:
                return BUSY
            try:
                return fn(conn)
            except BaseException as e:
                self._abort(conn, e)  # outside a transaction the rollback does nothing
                raise

    @contextmanager
    def _using(self) -> Iterator[Any]:
        """The connection, held by this thread for the block (opened if needed), or None when
        another thread uses it or it is closed."""
        if not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            if self.closed:
                yield None
                return
            conn = self._conn
            yield self._open() if conn is None or self._pid != os.getpid() else conn
        finally:
            self._lock.release()

    def _open(self) -> Any:
        if self._pid != os.getpid():  # a fork Python did not announce: the parent's connection
            self._forget()
        fairy = _checkout(self._engine)
        fairy.detach()  # ours now: the pool opens another in its place when it needs one
        self._conn = fairy.dbapi_connection
        return self._conn

    def _abort(self, conn: Any, e: BaseException) -> None:
        dialect = self._engine.dialect
        driver_error = dialect.loaded_dbapi.Error
        gone = _rolled_back_or_gone(dialect, conn, e, conn.rollback)
        if gone:
            self._conn = None
            try:
                conn.close()
            except driver_error:
                pass
        if isinstance(e, driver_error):
            raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e

    def close(self, *, final: bool = True) -> None:
        """Close the connection (waiting for a transaction on it to end); ``final``: for good,
        else (before a ``fork()``) the next transaction opens a new one."""
        with self._lock:
            self.closed = self.closed or final
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def after_fork(self) -> None:
        """In a forked child: close the parent's connection, if one was inherited (see
        ``Dialect.close_inherited``: safe, and needed, for SQLite), and start afresh (a thread
        of the parent that held the lock at the fork does not exist here)."""
        self._lock = threading.Lock()
        self._forget()

    def _forget(self) -> None:
        conn, self._conn, self._pid = self._conn, None, os.getpid()
        if conn is not None:
            try:
                conn.close()
            except self._engine.dialect.loaded_dbapi.Error:
                pass


class Busy:
    """:meth:`HotConnection.transaction`'s answer when it ran nothing: use the pool."""


BUSY = Busy()


@contextmanager
def driver_statement(engine: Engine) -> Iterator[tuple[Any, str]]:
    """Postgres: a pooled driver connection in the driver's autocommit mode, for ONE simple query
    that is its own transaction (several statements in one query run in one implicit
    transaction, committed at its end, rolled back if one fails), and the text to put first in
    that query: the statement that sets the transaction's timeouts, with its ``;`` (``""`` on an
    engine that sets them at startup). The claim round's hot path: one round trip where
    ``driver_transaction`` takes three (``BEGIN``, the statement, ``COMMIT``), and a
    transaction pooler holds the server connection only for the server's own time. Errors come
    out as from ``driver_transaction``."""
    fairy = _checkout(engine)
    conn: Any = fairy.dbapi_connection
    per_tx = fairy.info.get(PER_TX)
    factory = None
    try:
        with _driver_errors(engine, fairy, conn):
            conn.autocommit = True  # a connection the server closed meanwhile fails here
            factory = postgresql.client_binding(conn)
            yield conn, f"{per_tx}; " if per_tx else ""
    finally:
        if not getattr(conn, "closed", False):
            try:
                if factory is not None:
                    conn.cursor_factory = factory
                conn.autocommit = False
            except Exception:  # noqa: BLE001 - a broken connection: the pool discards it
                pass
        fairy.close()


@contextmanager
def driver_read(engine: Engine) -> Iterator[tuple[Any, str]]:
    """For ONE read-only statement through the driver (``poll.Poll``): on Postgres
    :func:`driver_statement`; on SQLite a pooled connection as it is, in autocommit mode
    (``isolation_level = None``), where a lone ``SELECT`` is its own read transaction and takes
    no write lock. Yields the connection and the text to put first in the query (Postgres'
    timeouts, else ``""``); errors come out as from ``driver_transaction``."""
    if engine.dialect.name != "sqlite":
        with driver_statement(engine) as got:
            yield got
        return
    fairy = _checkout(engine)
    try:
        with _driver_errors(engine, fairy, fairy.dbapi_connection):
            yield fairy.dbapi_connection, ""
    finally:
        fairy.close()


@contextmanager
def _driver_errors(engine: Engine, fairy: Any, conn: Any) -> Iterator[None]:
    """Driver errors out as SQLAlchemy's ``DBAPIError``, the connection dropped from the pool
    (``connection_invalidated``) when it is gone."""
    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error
    try:
        yield
    except driver_error as e:
        gone = dialect.is_disconnect(e, conn, None)
        if gone:
            fairy.invalidate(e)
        raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e
    except DBAPIError as e:
        if e.connection_invalidated:
            fairy.invalidate(e)
        raise


def _checkout(engine: Engine) -> Any:
    """A pooled connection (its pool proxy) for driver-level use; a driver error (refused, server
    starting up, ...) comes out as SQLAlchemy's ``DBAPIError``, as ``engine.connect()`` raises it."""
    driver_error = engine.dialect.loaded_dbapi.Error
    try:
        return engine.raw_connection()
    except driver_error as e:
        gone = engine.dialect.is_disconnect(e, None, None)
        raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e


class DriverTx:
    """The control of one write transaction on a driver's own connection
    (``engine.driver_transaction``; the claim round itself is one query, see
    ``engine.driver_statement``). Without per-transaction
    timeouts (SQLite; ``startup_options=True``): the driver's own ``commit()`` and
    ``rollback()``, psycopg2 beginning on the first statement. With them: the connection is in
    the driver's autocommit mode for the duration, and ``BEGIN; SELECT set_config(...)`` go as
    one simple query, so the timeouts cost no round trip of their own (psycopg2 would send its
    implicit ``BEGIN`` alone, then the ``set_config``); ``COMMIT`` and ``ROLLBACK`` are sent as
    statements, and :meth:`close` turns autocommit off again."""

    def __init__(self, conn: Any, begin_sql: Optional[str]) -> None:
        self.conn, self.begin_sql = conn, begin_sql

    @classmethod
    def of(cls, fairy: Any, conn: Any) -> DriverTx:
        sql: Optional[str] = fairy.info.get(PER_TX)
        return cls(conn, f"BEGIN; {sql}" if sql else None)

    def _run(self, sql: str) -> None:
        cur = self.conn.cursor()
        try:
            cur.execute(sql)
        finally:
            cur.close()

    def begin(self) -> None:
        if self.begin_sql:
            self.conn.autocommit = True
            self._run(self.begin_sql)

    def commit(self) -> None:
        self._run("COMMIT") if self.begin_sql else self.conn.commit()

    def rollback(self) -> None:
        self._run("ROLLBACK") if self.begin_sql else self.conn.rollback()

    def close(self) -> None:
        if self.begin_sql and not getattr(self.conn, "closed", False):
            try:
                self.conn.autocommit = False
            except Exception:  # noqa: BLE001 - a broken connection: the pool discards it
                pass


def last_rows(cur: Any) -> list[Any]:
    """The rows of the last statement that returns rows in a query that held several (a
    ``SET LOCAL`` among them returns none): psycopg2 keeps only the last statement's, psycopg 3
    keeps every statement's (``nextset()`` steps to the next)."""
    if not psycopg3(cur):
        return list(cur.fetchall())
    rows: list[Any] = []
    while True:
        if cur.description is not None:
            rows = cur.fetchall()
        if not cur.nextset():
            return rows


