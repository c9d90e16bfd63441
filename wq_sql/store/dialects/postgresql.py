"""PostgreSQL's engine: READ COMMITTED (the server default), statement and idle-in-transaction
timeouts set in each transaction (``wq_sql.store.dialects.postgresql``: nothing relies on session state, so
PgBouncer in transaction mode works with a plain URL), an optional schema through
``schema_translate_map``, and what its connection errors mean."""

from __future__ import annotations

import re
from typing import Any, Optional

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from wq_sql.errors import InvalidInput

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
    if factory is None or not psycopg3(conn):
        return None
    import psycopg

    conn.cursor_factory = psycopg.ClientCursor
    return factory


def psycopg3(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "psycopg"


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
READ_ONLY = "25006"  # SQLSTATE read_only_sql_transaction: a standby, or a server made read-only


def with_driver(url: URL) -> URL:
    """A plain ``postgresql://`` URL with wq_sql's driver: SQLAlchemy 2.1 defaults to psycopg 3,
    wq_sql depends on psycopg2 (its claim path is tuned on it)."""
    if url.drivername in ("postgresql", "postgres"):
        return url.set(drivername="postgresql+psycopg2")
    return url


def multihost_as_query(raw: str) -> str:
    """A libpq multi-host URL (``postgresql://u@h1:p1,h2:p2/db?target_session_attrs=read-write``,
    the usual way to name a primary and its standbys) in the form SQLAlchemy reads
    (``postgresql://u@/db?host=h1,h2&port=p1,p2&target_session_attrs=read-write``); SQLAlchemy's
    own parser takes one host only and fails on the port. Other URLs are returned unchanged."""
    scheme, sep, body = raw.partition("://")
    if not sep or not re.match(r"^postgres(ql)?(\+\w+)?$", scheme):
        return raw
    head, q, query = body.partition("?")
    userinfo, at, hostpath = head.rpartition("@")
    hosts, slash, path = hostpath.partition("/")
    if "," not in hosts:
        return raw
    names, ports = [], []
    for token in hosts.split(","):
        m = re.match(r"^(\[[^\]]*\]|[^:\[\]]*)(?::(\d*))?$", token)
        if m is None or not m.group(1):
            raise InvalidInput(f"cannot read host {token!r} of a multi-host URL: expected "
                               "postgresql://user@host1:port1,host2:port2/db")
        names.append(m.group(1).strip("[]"))
        ports.append(m.group(2) or "")
    params = [p.split("=", 1)[0] for p in query.split("&") if p]
    if "host" in params or "port" in params:
        raise InvalidInput("a multi-host URL names its hosts before the /; drop host= and port= "
                           "from its query")
    query = "&".join(filter(None, ["host=" + ",".join(names),
                                   "port=" + ",".join(ports) if any(ports) else "", query]))
    return f"{scheme}://{userinfo}{at}/{path}?{query}"


def make_engine(url: URL, *, schema: Optional[str], statement_timeout: Optional[float],
                startup_options: bool, pool_size: int) -> Engine:
    """See ``engine.make_engine``."""
    connect_args: dict[str, Any] = {"application_name": "wq_sql",
                                    **driver_connect_args(url.get_driver_name())}
    timeouts = None
    if statement_timeout is not None:
        timeouts = Timeouts(int(statement_timeout * 1000), startup_options)
        connect_args.update(timeouts.connect_args())
    opts: dict[str, Any] = {}
    if schema:
        if not _IDENT.match(schema):
            raise InvalidInput(f"schema must be a plain identifier (letters, digits, _), got {schema!r}")
        opts["schema_translate_map"] = {None: schema}
    # LIFO: a thread's consecutive rounds get the connection it just returned, whose server
    # backend has planned wq_claim_round() (ClaimRound.warm); first-in-first-out alternated
    # between the pool's connections, and each one's first round paid to plan it again.
    engine = create_engine(url, pool_size=pool_size, max_overflow=0, pool_pre_ping=False, pool_use_lifo=True,
                           execution_options=opts, connect_args=connect_args)
    if timeouts is not None:
        timeouts.install(engine)
    return engine


def open_error(url: URL, e: DBAPIError, detail: str, shown: str, given: str) -> Optional[str]:
    """The one-line message, naming the fix, of a failure to connect (or of a server that takes
    no writes); None for other errors."""
    low = detail.lower()
    if getattr(e.orig, "pgcode", None) == READ_ONLY:
        return (f"the server at {shown} is read-only ({detail}): a standby, or a primary being "
                f"demoted; point {given} at the primary, or list every node in a multi-host URL with "
                "?target_session_attrs=read-write")
    # psycopg2 gives a failure to connect (or a connection lost mid-statement) no SQLSTATE.
    connecting = isinstance(e, OperationalError) and getattr(e.orig, "pgcode", None) is None
    if not connecting and "invalid dsn" not in low:
        return None
    if "password authentication failed" in low or "no password supplied" in low:
        fix = f"check the user and password in {given}, or ~/.pgpass"
    elif "database" in low and "does not exist" in low:
        fix = f"create the database (createdb {url.database}) or fix the database name in {given}"
    elif "role" in low and "does not exist" in low:
        fix = f"fix the user name in {given}"
    elif "translate host name" in low:
        fix = f"check the host name in {given}"
    elif "pg_hba.conf" in low:
        fix = ("the server does not let this user in from this host (pg_hba.conf): check the user "
               f"and database in {given}, or ask the server's administrator")
    elif "invalid dsn" in low:
        fix = f"fix the options after ? in {given}"
    elif "session is read-only" in low or "hot standby mode" in low:
        fix = ("no host in the URL is a primary: a failover still in progress (raise busy_timeout= to "
               "wait longer), or the URL lists only standbys")
    elif "refused" in low:
        fix = f"start the server, or check the host and port in {given}"
    else:
        fix = f"check the host and port in {given} and that the server is running"
    return f"cannot connect to {shown}: {detail}; {fix}"
