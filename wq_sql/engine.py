"""Engines: URL resolution, engine creation, the driver-level transactions of the hot path, and the
one-line errors of a database that cannot be reached or opened (``open_error``). What differs
between SQLite and Postgres (connection set-up, file checks, what an error means) is asked of
``wq_sql.dialects``.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Optional, TypeVar

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError

from wq_sql import pooling
from wq_sql.dialects import dialect_of
from wq_sql.dialects.postgresql import multihost_as_query
from wq_sql.dialects.sqlite import DEFAULT_FILE as DEFAULT_SQLITE_FILE
from wq_sql.errors import DatabaseUnavailable, InvalidInput

# Where a driver's message may carry a password: a libpq DSN field (psycopg2 quotes a value with
# '...' and backslash escapes), and the userinfo of a URL (SQLAlchemy's own parser lets a password
# hold anything but "@").
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s']+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@]*:)[^\s@]*@")
URL_GIVEN = "url= (or $WQ_SQL_URL)"  # where the API's fixes say the URL comes from
T = TypeVar("T")


def resolve_url(url: Optional[str | URL]) -> URL:
    """``url``, else ``$WQ_SQL_URL``, else ``sqlite:///wq_sql.db`` in the current directory."""
    raw = url if url is not None else os.environ.get("WQ_SQL_URL") or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    return _resolve_text(raw) if isinstance(raw, str) else _resolve(raw)


@functools.lru_cache(maxsize=64)
def _resolve_text(raw: str) -> URL:
    """A URL's text resolved once per process (and inherited by forked children): every queue
    object of every DataLoader worker resolves the same text (``URL`` is immutable)."""
    return _resolve(multihost_as_query(raw))


def _resolve(raw: str | URL) -> URL:
    try:
        parsed = make_url(raw)
    except Exception as e:  # sqlalchemy raises ArgumentError; never echo a password back
        raise InvalidInput(f"not a database URL ({type(e).__name__}); expected e.g. "
                           "sqlite:///path/wq.db or postgresql://user@host/db") from None
    return dialect_of(parsed).check_url(parsed, safe_url(parsed))


def safe_url(url: URL) -> str:
    """The URL as it may appear in logs and errors: the password hidden, nothing else changed."""
    return url.render_as_string(hide_password=True)


def mask_secrets(text: str) -> str:
    """``text`` (say, a driver's error message) with the value of a ``password=`` DSN field and
    the password of a ``scheme://user:password@`` URL replaced by ``***``; nothing else changes,
    so URLs in it stay pasteable."""
    return _URL_PASSWORD.sub(r"\1***@", _DSN_PASSWORD.sub(r"\1***", text))


def first_line(obj: object) -> str:
    """The first non-blank line of ``str(obj)``, stripped (its type name if there is none)."""
    lines = [ln.strip() for ln in str(obj).splitlines() if ln.strip()]
    return lines[0] if lines else type(obj).__name__


def open_error(url: URL, e: DBAPIError, *, given: str = URL_GIVEN) -> Optional[DatabaseUnavailable]:
    """``e`` as a :class:`DatabaseUnavailable` whose one-line message names the fix, if it says
    that the database at ``url`` cannot be reached or opened (Postgres: any failure to connect;
    SQLite: a file it cannot open, that is not a database, or that is read-only); otherwise
    None. ``given`` says where the URL came from, for the fix. The caller chains ``e``."""
    detail = mask_secrets(first_line(e.orig))
    attempts = [ln.strip() for ln in str(e.orig).splitlines()
                if ln.strip().startswith("connection to server")]
    if len(attempts) > 1:  # a multi-host URL: libpq says why each host failed, a line each
        detail = mask_secrets("; ".join(attempts))
    msg = dialect_of(url).open_error(url, e, detail, safe_url(url), given)
    return None if msg is None else DatabaseUnavailable(msg)


@contextmanager
def opening(url: URL, *, given: str = URL_GIVEN) -> Iterator[None]:
    """Raise a driver error from the block that says the database at ``url`` cannot be reached
    or opened as :class:`DatabaseUnavailable` (see :func:`open_error`); others pass unchanged."""
    try:
        yield
    except DBAPIError as e:
        unavailable = open_error(url, e, given=given)
        if unavailable is None:
            raise
        raise unavailable from e


def make_engine(url: URL, *, schema: Optional[str] = None, busy_timeout: float = 30.0,
                statement_timeout: Optional[float] = 60.0, startup_options: bool = False,
                pool_size: int = 2, autocheckpoint: bool = True,
                lock_slice: Optional[float] = None) -> Engine:
    """An engine for a worker process: at most ``pool_size`` connections (claims and heartbeat).

    SQLite, ``autocheckpoint=False``: commits never copy the WAL into the database file (SQLite
    does that in the commit that crosses 1,000 WAL pages, fsync included: a claim that happens
    to be that commit took up to a second here); the engine's owner checkpoints from a
    background thread instead (``WorkQueue``'s heartbeat thread, every second).

    SQLite, ``lock_slice``: a statement waits at most this long for the write lock (SQLite's busy
    handler sleeps 1, 2, 5 ms ... then 100 ms at a time, so under a saturated lock a waiter that
    reached 100 ms naps starved for seconds here while fresher waiters took turns); the caller
    retries every few ms up to ``busy_timeout`` (``WorkQueue._retrying``). Default: the busy
    handler waits up to ``busy_timeout`` itself.

    Postgres, ``statement_timeout`` (seconds; None: none): also the idle-in-transaction timeout,
    both set at the start of each transaction (``SET LOCAL``), which works directly and through
    PgBouncer in transaction mode (:mod:`wq_sql.pooling`). ``startup_options=True``: as libpq
    startup options instead, one statement less per transaction, for direct connections only
    (PgBouncer refuses them)."""
    return dialect_of(url).make_engine(
        url, schema=schema, busy_timeout=busy_timeout, statement_timeout=statement_timeout,
        startup_options=startup_options, pool_size=pool_size, autocheckpoint=autocheckpoint,
        lock_slice=lock_slice)


# Engines made ahead in a process that forks worker processes (a DataLoader's main process):
# make_engine's arguments -> (the process that made it, the engine). See keep_for_children.
_spares: dict[tuple[Any, ...], tuple[int, Engine]] = {}


def _spare_key(url: URL, options: dict[str, Any]) -> tuple[Any, ...]:
    return (url.render_as_string(hide_password=False), *sorted(options.items()))


def keep_for_children(url: URL, **options: Any) -> None:
    """In a process about to fork worker processes that open ``url`` with
    ``make_engine(url, **options)`` (the DataLoader's main process, ``wq_sql.torch``): make
    that engine now, connect it once so that SQLAlchemy initialises its dialect (server version,
    ...), and keep it without any connection, for :func:`worker_engine` in each forked child.
    A DataLoader worker otherwise spent 5-7 ms of CPU making its engine and initialising the
    dialect on its first connection (``bench/torch_phases.py``), every pass unless its workers
    are persistent. No connection crosses the fork: the kept engine's pool is empty."""
    key = _spare_key(url, options)
    kept = _spares.get(key)
    if kept is not None and kept[0] == os.getpid():
        return
    engine = make_engine(url, **options)
    with opening(url):
        engine.connect().close()
    engine.dispose()  # closes that connection: the pool the children inherit is empty
    _spares[key] = (os.getpid(), engine)


def worker_engine(url: URL, **options: Any) -> Engine:
    """``make_engine(url, **options)``, or the engine a parent process kept for its children
    (:func:`keep_for_children`): the first caller in a forked child takes it (its pool was never
    used: no connection, and no lock another thread of the parent could have held at the fork);
    the process that kept it keeps it for its next children."""
    key = _spare_key(url, options)
    kept = _spares.get(key)
    if kept is not None and kept[0] != os.getpid():
        del _spares[key]
        engine = kept[1]
        pool: Any = engine.pool
        if pool.checkedin() or pool.checkedout():  # not reached: nothing uses a kept engine
            engine.dispose(close=False)  # a pool of its own, the parent's connections untouched
        return engine
    return make_engine(url, **options)


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
    machinery cost as much as SQLite's own work (``bench/claim_throughput.py``). SQLite: ``BEGIN
    IMMEDIATE`` first, as for every write transaction here; psycopg2 begins on the first
    statement. Commits on success; rolls back otherwise. Driver errors come out as SQLAlchemy's
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
    tx = pooling.DriverTx.of(fairy, conn)  # Postgres: BEGIN and the timeouts in one round trip
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
    commit and SQLite dropped its page cache: ~100 us of CPU per round at lease-ahead 1, a third
    of a ``take()`` (``bench/claim_throughput.py``). A thread that finds it taken (the refill
    thread during a take's round) uses the pool as before.

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
        it), on this connection when no other thread uses it: a worker's reads (``look.Look``)
        need no second connection, whose connect and page cache cost a DataLoader worker of
        ``wq_sql.torch`` ~2 ms of CPU per pass (``bench/torch_phases.py``). Returns :data:`BUSY`
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
    per_tx = fairy.info.get(pooling.PER_TX)
    factory = None
    try:
        with _driver_errors(engine, fairy, conn):
            conn.autocommit = True  # a connection the server closed meanwhile fails here
            factory = pooling.client_binding(conn)
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
    """For ONE read-only statement through the driver (``look.Look``): on Postgres
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
