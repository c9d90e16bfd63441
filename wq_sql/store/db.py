"""A database handle for one queue object: engine, dialect, transactions with retries, the
outage window, and fork safety. Every service below the facade receives a :class:`Db`.

Retries: SQLite locked past its busy handler is retried every few ms up to ``busy_timeout``
(then :class:`DatabaseBusy`); on Postgres a lost or refused connection (a restart, a failover,
``pg_terminate_backend``), a server that turned read-only (a demoted primary: the pool is
dropped, so the retry connects afresh), a deadlock or a serialization failure is retried with
backoff up to ``busy_timeout`` too. Each retry reruns the whole transaction. A database this
handle never reached is not waited for: a refused port or an unknown host is a wrong URL or a
server not started, and raises :class:`DatabaseUnavailable` at once (but a connection that was
made and then lost is waited for: a restart or failover under a worker that is just starting).
"""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time
import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from wq_sql.errors import DatabaseBusy, DatabaseUnavailable
from wq_sql.store.dialects import LOST, dialect_of
from wq_sql.store.driver import Busy, HotConnection, driver_read, driver_statement, driver_transaction
from wq_sql.store.engine import open_error
from wq_sql.store.redact import safe_url

log = logging.getLogger("wq_sql")
T = TypeVar("T")

# SQLite: the longest a statement waits for the write lock before Db.retrying tries again, after
# LOCK_RETRY seconds (with jitter): see engine.make_engine(lock_slice=).
LOCK_SLICE, LOCK_RETRY = 0.05, 0.002
# After an outage, every worker's leases ran on while nobody could renew them: the other workers
# need this long to reconnect (their retry pause is at most 1.5 s), plus a few heartbeats.
RECONNECT_SECONDS = 1.5


class Db:
    """Transactions on one engine for one queue object (``label`` names it in log lines).

    ``quiet_seconds``: after an outage, :attr:`may_expire` stays false this long, so that no
    worker returns another's items before that one could renew its leases. ``stall_seconds``:
    a transaction that took longer than this counts as an outage too (a commit that waited for
    a lost synchronous standby, a server frozen meanwhile): every worker's commits waited as
    long, so their heartbeats arrive late, not missing."""

    def __init__(self, engine: Engine, url: URL, *, busy_timeout: float, label: str,
                 quiet_seconds: float = 0.0, stall_seconds: float = float("inf")) -> None:
        self.engine = engine
        self.url = url
        self.dialect = dialect_of(engine)
        self.busy_timeout = busy_timeout
        self.label = label
        self.quiet_seconds = quiet_seconds
        self.stall_seconds = stall_seconds
        self.reached = False          # a transaction succeeded: outages are waited for
        self._quiet_until = 0.0
        self._in_outage: set[int] = set()  # threads retrying a lost connection right now
        self._busy: dict[int, float] = {}  # thread -> when its transaction (retries included) began
        self._gate = _TxGate()
        # SQLite: this host's write transactions take the write lock in the order they asked.
        self._writers = self.dialect.writer_queue(url)
        self._writing = _Writing()
        # SQLite: the driver connection of the hot path's write transactions (driver_tx).
        self._hot = HotConnection(engine) if self.dialect.is_sqlite else None
        self._pid = os.getpid()
        self.closed = False
        _open_dbs.add(self)

    @property
    def may_expire(self) -> bool:
        """Whether other workers had time to renew their leases since the last outage: none of
        this handle's threads is in one, or in a transaction running longer than
        ``stall_seconds`` (its heartbeat thread may get through while its main thread still
        waits, and must not expire the items of workers still cut off), and the quiet window
        after the last one is over."""
        now = time.monotonic()
        oldest = min(self._busy.values(), default=now)
        return not self._in_outage and now - oldest <= self.stall_seconds and now >= self._quiet_until

    def tx(self, fn: Callable[[Connection], T], *, read: bool = False) -> T:
        """Run ``fn`` in one transaction, retried (see the module docstring). ``read``: a
        read-only transaction (no write lock on SQLite)."""
        def once() -> T:
            with self._gate, self.engine.connect() as conn:
                if read:
                    conn.execution_options(wq_read=True)
                with nullcontext() if read else self._write_turn(), conn.begin():
                    return fn(conn)
        return self.retrying(once)

    def expire_tx(self, fn: Callable[[Connection], T], *, default: T, read: bool = False) -> T:
        """:meth:`tx` for what decides to return other workers' items: each attempt runs only
        while :attr:`may_expire`, else ``default``. So an attempt retried after an outage (or
        begun while another thread of this handle waits for one) gives up instead of acting on
        heartbeats the others could not renew yet; a later heartbeat tries again."""
        def guarded(conn: Connection) -> T:
            if not self.may_expire:
                raise _Skipped
            return fn(conn)
        try:
            return self.tx(guarded, read=read)
        except _Skipped:
            return default

    def driver_tx(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn`` on the driver's own connection in one write transaction (the claim round's
        SQLite path and acknowledgements outside a round: ``engine.driver_transaction``),
        retried like :meth:`tx`. SQLite: on this handle's :class:`~wq_sql.store.driver.HotConnection`
        when no other thread uses it, else on a pooled connection."""
        hot = self._hot
        if hot is not None:
            def hot_once() -> T:
                with self._gate:
                    got = hot.transaction(fn, self._enter_write, self._leave_write)
                    if not isinstance(got, Busy):
                        return got
                    with driver_transaction(self.engine, self._write_turn()) as conn:
                        return fn(conn)
            return self.retrying(hot_once)

        def once() -> T:
            with self._gate, driver_transaction(self.engine, self._write_turn()) as conn:
                return fn(conn)
        return self.retrying(once)

    def driver_round(self, fn: Callable[[Any, str], T]) -> T:
        """Run ``fn(conn, prefix)``, one claim round, retried like :meth:`tx`: on Postgres as one
        simple query that is its own transaction (``engine.driver_statement``: ``fn`` sends
        ``prefix`` first in its query); on SQLite in a write transaction (:meth:`driver_tx`,
        ``prefix`` empty)."""
        if not self.dialect.one_query_rounds:
            return self.driver_tx(lambda conn: fn(conn, ""))

        def once() -> T:
            with self._gate, driver_statement(self.engine) as (conn, prefix), self._write_turn():
                return fn(conn, prefix)
        return self.retrying(once)

    def driver_read(self, fn: Callable[[Any, str], T]) -> T:
        """Run ``fn(conn, prefix)``, one read-only statement on a driver connection
        (``engine.driver_read``: on Postgres one simple query that sends ``prefix`` first),
        retried like :meth:`tx`. SQLite: on this handle's :class:`~wq_sql.store.driver.HotConnection`
        when no other thread uses it, else on a pooled connection."""
        hot = self._hot

        def once() -> T:
            with self._gate:
                if hot is not None:
                    got = hot.read(lambda conn: fn(conn, ""))
                    if not isinstance(got, Busy):
                        return got
                with driver_read(self.engine) as (conn, prefix):
                    return fn(conn, prefix)
        return self.retrying(once)

    def _write_turn(self) -> AbstractContextManager[None]:
        """Around one write transaction (one attempt: a retry asks again): SQLite's writers'
        queue, taken after the connection is checked out and before ``BEGIN IMMEDIATE``, left
        after its end (``Dialect.writer_queue``); nothing elsewhere. Counted while held
        (:meth:`wait_writes`)."""
        return _Held(self._writers.turn() if self._writers is not None else None, self._writing)

    def _enter_write(self) -> int:
        """:meth:`_write_turn` entered without a context manager (``HotConnection``): returns
        what :meth:`_leave_write` takes."""
        ticket = self._writers.enter() if self._writers is not None else -1
        self._writing.enter()
        return ticket

    def _leave_write(self, ticket: int) -> None:
        self._writing.leave()
        if self._writers is not None:
            self._writers.leave(ticket)

    def wait_writes(self, timeout: float) -> bool:
        """Wait until no thread of this handle is in a write transaction, at most ``timeout``
        seconds; False if one still is. For a background thread's CPU-bound work (the epoch
        maker's shuffle): a transaction waits for the GIL after each of its statements, and on
        SQLite every other writer of the machine waits behind it (the writers' queue)."""
        return self._writing.wait_idle(timeout)

    def retrying(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying what is transient (see the module docstring)."""
        me = threading.get_ident()
        outer = me not in self._busy
        if outer:
            self._busy[me] = time.monotonic()
        try:
            return self._retry_loop(fn)
        finally:
            if outer:
                self._busy.pop(me, None)
                if me in self._in_outage:  # however it ended: the others need time to renew
                    self._in_outage.discard(me)
                    self._quiet_until = max(self._quiet_until,
                                            time.monotonic() + RECONNECT_SECONDS + self.quiet_seconds)

    def _retry_loop(self, fn: Callable[[], T]) -> T:
        start = time.monotonic()
        deadline = start + self.busy_timeout
        delay = 0.01
        outage = False
        while True:
            try:
                began = time.monotonic()
                result = fn()
                self.reached = True
                if time.monotonic() - began > self.stall_seconds:
                    self._quiet_until = max(self._quiet_until,
                                            time.monotonic() + RECONNECT_SECONDS + self.quiet_seconds)
                if outage:
                    log.warning("queue %r: the database is back after %.1fs; continuing", self.label,
                                time.monotonic() - start)
                    self._quiet_until = time.monotonic() + RECONNECT_SECONDS + self.quiet_seconds
                return result
            except DBAPIError as e:
                why = self.dialect.transient(e, self.reached)
                if why is None:
                    unavailable = open_error(self.url, e)
                    if unavailable is None:
                        raise
                    raise unavailable from e
                if time.monotonic() >= deadline:
                    if why == "locked":
                        raise DatabaseBusy(
                            f"the SQLite database {safe_url(self.url)} stayed locked for "
                            f"{self.busy_timeout:.0f}s; raise busy_timeout= or use fewer writers") from None
                    if why in LOST:
                        unavailable = open_error(self.url, e)
                        raise DatabaseUnavailable(
                            f"the database stayed unreachable for {self.busy_timeout:.0f}s (busy_timeout=, "
                            f"raise it to wait longer): {unavailable or safe_url(self.url)}") from e
                    raise
                if why in LOST and not outage:
                    # Operators should see a restart or failover, not only DEBUG logs.
                    log.warning("queue %r: database connection lost (%s); retrying for up to %.0fs "
                                "(busy_timeout)", self.label, why, self.busy_timeout)
                    outage = True
                    self._in_outage.add(threading.get_ident())
                if why == "read-only":
                    # The pooled connections lead to a server that is no longer the primary;
                    # new ones find the primary (multi-host URL, pooler, DNS) once there is one.
                    self.engine.dispose()
                log.debug("retrying transaction: %s", why)
                if why == "locked":  # every few ms, not backing off: see LOCK_SLICE
                    time.sleep(LOCK_RETRY * (0.5 + random.random()))
                    continue
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)

    def checkpoint_wal(self) -> None:
        """SQLite: copy committed WAL pages into the database file (the dialect's statement
        waits for no reader or writer, and does what it can). wq_sql's engines turn SQLite's
        automatic checkpoint off, which would otherwise run inside whichever claim's commit
        crossed 1,000 WAL pages, fsync included; a heartbeat thread calls this instead. Another
        process checkpointing at the same time makes this one a no-op."""
        statement = self.dialect.wal_checkpoint
        if statement is None:
            return
        with self._gate:
            if self.closed or os.getpid() != self._pid:
                return
            try:
                fairy = self.engine.raw_connection()
                try:
                    fairy.dbapi_connection.execute(statement).fetchall()  # type: ignore[union-attr]
                finally:
                    fairy.close()
            except sqlite3.Error as e:  # best effort (busy: another checkpoint runs); never
                # let it end the heartbeat thread, whose lease renewals matter
                log.debug("checkpoint of %s skipped: %s", safe_url(self.url), e)

    def in_child(self) -> bool:
        """After ``fork()``, the first call in the child: forget the parent's connections (see
        ``Dialect.close_inherited``) and return True; False in the process that opened it."""
        if os.getpid() == self._pid:
            return False
        self.engine.dispose(close=self.dialect.close_inherited)
        if self._hot is not None:
            self._hot.after_fork()
        self._pid = os.getpid()
        self._in_outage, self._busy = set(), {}  # the parent's threads are not here
        return True

    def close(self, *, own: bool = True) -> None:
        """Close the pooled connections (``own=False``: an engine the caller passed in, and the
        child of a fork, only drop them)."""
        self.closed = True
        _open_dbs.discard(self)
        if self._writers is not None:
            self._writers.close()
        if self._hot is not None:
            if os.getpid() == self._pid:
                self._hot.close()
            else:  # a forked child that never used it: the parent's connection, if inherited
                self._hot.after_fork()
                self._hot.close()
        self.engine.dispose(close=own and os.getpid() == self._pid)


class _Writing:
    """How many of a handle's threads are in a write transaction, and a wait for none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._n = 0

    def enter(self) -> None:
        with self._lock:
            self._n += 1

    def leave(self) -> None:
        with self._lock:
            self._n -= 1
            if not self._n:
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self._cond.wait_for(lambda: not self._n, timeout)


class _Held:
    """A write transaction's turn (SQLite's writers' queue, or none), counted in ``writing``
    while held."""

    __slots__ = ("_turn", "_writing")

    def __init__(self, turn: Optional[AbstractContextManager[None]], writing: _Writing) -> None:
        self._turn, self._writing = turn, writing

    def __enter__(self) -> None:
        if self._turn is not None:
            self._turn.__enter__()
        self._writing.enter()

    def __exit__(self, *exc: Any) -> Optional[bool]:
        self._writing.leave()
        return self._turn.__exit__(*exc) if self._turn is not None else None


class _Skipped(Exception):
    """An :meth:`Db.expire_tx` attempt that must not run now."""


class _TxGate:
    """Counts the transactions in flight, so that ``fork()`` can wait until there are none and
    hold new ones back meanwhile. Entered around every transaction: the lock is used directly
    (the condition's own ``with`` is Python code), and exits notify only while shut."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = 0
        self._shut = False

    def __enter__(self) -> None:
        with self._lock:
            while self._shut:
                self._cond.wait()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._shut:  # shut() waits for none in flight
                self._cond.notify_all()

    def shut(self) -> None:
        with self._lock:
            self._shut = True
            while self._active:
                self._cond.wait()

    def open(self) -> None:
        with self._lock:
            self._shut = False
            self._cond.notify_all()


_open_dbs: weakref.WeakSet[Db] = weakref.WeakSet()
_forking: list[_TxGate] = []


def _before_fork() -> None:
    """SQLite keeps per-process lock state that ``fork()`` copies: a child that inherits an open
    connection (worse, one inside another thread's write transaction) shares that state instead
    of taking real file locks, and waits forever or loses its commits. So wait until no thread
    is inside a SQLite transaction, and close the idle connections: the child inherits none."""
    for db in list(_open_dbs):
        if db.dialect.close_inherited and db._pid == os.getpid() and not db.closed:
            db._gate.shut()
            _forking.append(db._gate)
            db.engine.dispose()
            if db._hot is not None:
                db._hot.close(final=False)


def _after_fork_in_parent() -> None:
    while _forking:
        _forking.pop().open()


def _after_fork_in_child() -> None:
    """A gate that the parent shut, or that another thread of the parent was inside at ``fork()``,
    would stay shut or busy forever in the child: give every handle a fresh one (and a fresh
    count of write transactions)."""
    _forking.clear()
    for db in list(_open_dbs):
        db._gate = _TxGate()
        db._writing = _Writing()  # the parent's transactions are not here
        if db._hot is not None:
            db._hot.after_fork()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)

