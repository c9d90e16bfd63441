"""Postgres connections that work the same directly and through a transaction-pooling pooler.

Behind PgBouncer in transaction mode (``pool_mode = transaction``) consecutive transactions of
one client connection may run on different server connections, so a connection may rely on no
session state. What wq_sql keeps to (``docs/scale.md`` lists the checks):

- its timeouts (``statement_timeout``, ``idle_in_transaction_session_timeout``) are set in each
  transaction, by one ``SELECT set_config(..., true)`` (``SET LOCAL``) right after it begins: it
  ends with the transaction, so nothing leaks to the pooler's other clients. Not as libpq startup
  options (``options=-c ...``): PgBouncer refuses those (``unsupported startup parameter:
  options``), and PgBouncer 1.18 was seen here to leave such a refused client hanging for
  minutes instead of closing it, so trying them first and falling back is not safe either.
  ``make_engine(startup_options=True)`` still sends them (direct connections only), saving that
  statement; ``bench/claim_throughput.py --variants wq_sql,wq_local`` measures what it saves;
- no session-level ``SET``, no session advisory lock (the migration lock is
  ``pg_advisory_xact_lock``), no ``LISTEN``; isolation levels go with each ``BEGIN``
  (psycopg2 >= 2.7 and psycopg 3 send ``BEGIN ISOLATION LEVEL ...``);
- no named server-side prepared statements: psycopg2 never prepares; psycopg 3 would, after 5
  executions of a statement (PgBouncer 1.18 then fails with ``prepared statement "_pg3_0" does
  not exist``), so its engines are made with ``prepare_threshold=None``.
"""

from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import Connection, Engine, event

# The pool record's info key: the statement that sets the timeouts in each transaction, on the
# connections of an engine that does not set them at startup.
PER_TX = "wq_sql_timeouts_per_transaction"
_NAMES = ("statement_timeout", "idle_in_transaction_session_timeout")


def startup_options(ms: int) -> str:
    """The libpq ``options`` value that sets both timeouts for the session (milliseconds)."""
    return " ".join(f"-c {n}={ms}" for n in _NAMES)


def set_local_sql(ms: int) -> str:
    """One statement, one round trip, valid in any protocol: both timeouts for this transaction."""
    return "SELECT " + ", ".join(f"set_config('{n}', '{ms}', true)" for n in _NAMES)


class Timeouts:
    """The timeouts of one engine's connections (see the module docstring): as startup options
    (``startup=True``), else in every transaction."""

    def __init__(self, ms: int, startup: bool) -> None:
        self.ms = ms
        self.startup = startup
        self.per_tx = set_local_sql(ms)

    def connect_args(self) -> dict[str, Any]:
        return {"options": startup_options(self.ms)} if self.startup else {}

    def install(self, engine: Engine) -> None:
        if self.startup:
            return
        event.listen(engine, "connect", self._connected)
        event.listen(engine, "begin", self._begin)

    def _connected(self, dbapi_conn: Any, rec: Any) -> None:
        rec.info[PER_TX] = self.per_tx  # read by begin_driver_tx, which sees no engine

    def _begin(self, conn: Connection) -> None:
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            conn.exec_driver_sql(self.per_tx)


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


def driver_connect_args(url_driver: str) -> dict[str, Any]:
    """Connection arguments a driver needs to work through a transaction pooler."""
    return {"prepare_threshold": None} if url_driver == "psycopg" else {}


def client_binding(conn: Any) -> Optional[Any]:
    """Make ``conn``'s cursors send their parameters inside the query text, so that one query may
    hold several statements (``engine.driver_statement``); returns the cursor factory to put
    back, or None when there is nothing to change. psycopg2 always does so; psycopg 3 binds on
    the server by default (the extended protocol: one statement per query), its
    ``ClientCursor`` in the client."""
    factory = getattr(conn, "cursor_factory", None)
    if factory is None or not _psycopg3(conn):
        return None
    import psycopg

    conn.cursor_factory = psycopg.ClientCursor
    return factory


def last_rows(cur: Any) -> list[Any]:
    """The rows of the last statement that returns rows in a query that held several (a
    ``SET LOCAL`` among them returns none): psycopg2 keeps only the last statement's, psycopg 3
    keeps every statement's (``nextset()`` steps to the next)."""
    if not _psycopg3(cur):
        return list(cur.fetchall())
    rows: list[Any] = []
    while True:
        if cur.description is not None:
            rows = cur.fetchall()
        if not cur.nextset():
            return rows


def _psycopg3(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "psycopg"
