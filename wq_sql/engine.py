"""Engines: URL resolution, per-backend connection setup, the few dialect differences, and the
one-line errors of a database that cannot be reached or opened (``open_error``).

SQLite: WAL, ``busy_timeout`` and ``BEGIN IMMEDIATE`` for every write transaction, so a
transaction takes the single write lock up front instead of failing halfway with
``database is locked``. Postgres: READ COMMITTED (the server default), statement and
idle-in-transaction timeouts set in each transaction (``pooling``: nothing relies on session
state, so PgBouncer in transaction mode works with a plain URL), and an optional schema via
``schema_translate_map``.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from wq_sql import pooling
from wq_sql.dialects import dialect_of
from wq_sql.errors import DatabaseUnavailable, InvalidInput, UnsafeDatabase

DEFAULT_SQLITE_FILE = "wq_sql.db"
NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smbfs", "smb3", "fuse.sshfs", "ceph", "fuse.cephfs",
    "glusterfs", "fuse.glusterfs", "9p", "afs", "beegfs", "fuse.s3fs", "fuse.gcsfuse",
}
MIN_SQLITE = (3, 35, 0)  # RETURNING
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# Where a driver's message may carry a password: a libpq DSN field (psycopg2 quotes a value with
# '...' and backslash escapes), and the userinfo of a URL (SQLAlchemy's own parser lets a password
# hold anything but "@").
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'?|[^\s']+)", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@]*:)[^\s@]*@")
URL_GIVEN = "url= (or $WQ_SQL_URL)"  # where the API's fixes say the URL comes from


def resolve_url(url: Optional[str | URL]) -> URL:
    """``url``, else ``$WQ_SQL_URL``, else ``sqlite:///wq_sql.db`` in the current directory."""
    raw = url if url is not None else os.environ.get("WQ_SQL_URL") or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    if isinstance(raw, str):
        raw = multihost_as_query(raw)
    try:
        parsed = make_url(raw)
    except Exception as e:  # sqlalchemy raises ArgumentError; never echo a password back
        raise InvalidInput(f"not a database URL ({type(e).__name__}); expected e.g. "
                           "sqlite:///path/wq.db or postgresql://user@host/db") from None
    if parsed.drivername in ("postgresql", "postgres"):
        # SQLAlchemy 2.1 defaults to psycopg 3; wq_sql depends on psycopg2.
        parsed = parsed.set(drivername="postgresql+psycopg2")
    if parsed.get_backend_name() == "sqlite" and parsed.host:
        # sqlite://jobs.db: SQLAlchemy reads jobs.db as a host and opens an in-memory database.
        path = "/".join(p for p in (parsed.host, parsed.database) if p)
        raise InvalidInput(
            f"{safe_url(parsed)!r} names {parsed.host!r} as a host, and SQLite has none: a slash is "
            f"probably missing. Use sqlite:///{path} (relative to the working directory) or "
            f"sqlite:////abs/path/{Path(path).name} (an absolute path: four slashes)")
    return parsed


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
    low = detail.lower()
    if url.get_backend_name() == "sqlite":
        path = Path(url.database or "").expanduser().resolve()
        if "unable to open" in low:
            if path.is_dir():
                msg = (f"the SQLite path {str(path)!r} is a folder; name a file in it, e.g. "
                       f"sqlite:///{path / DEFAULT_SQLITE_FILE}")
            elif not path.parent.is_dir():
                msg = _missing_folder(path)
            else:
                msg = (f"cannot open the SQLite database {str(path)!r} ({detail}); check the path in "
                       f"{given} and the permissions of the file and its folder")
        elif "not a database" in low:
            msg = (f"{str(path)!r} is not a SQLite database ({detail}); check the path in {given}, or "
                   "name a new file for wq_sql to create")
        elif "readonly" in low or "read-only" in low:
            msg = (f"the SQLite database {str(path)!r} is read-only ({detail}) and wq_sql writes to it; "
                   f"make the file and its folder writable (SQLite keeps {path.name}-wal and "
                   f"{path.name}-shm beside it)")
        else:
            return None
        return DatabaseUnavailable(msg)
    if getattr(e.orig, "pgcode", None) == "25006":  # read_only_sql_transaction
        return DatabaseUnavailable(
            f"the server at {safe_url(url)} is read-only ({detail}): a standby, or a primary being "
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
    return DatabaseUnavailable(f"cannot connect to {safe_url(url)}: {detail}; {fix}")


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


def _missing_folder(path: Path) -> str:
    return f"the folder of the SQLite file {str(path)!r} does not exist; create it first"


def _mount_fstype(path: Path) -> Optional[str]:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, fstype = "", None
    target = str(path)
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def check_sqlite_path(url: URL) -> None:
    """Refuse what SQLite cannot do safely: old versions, WAL on network filesystems."""
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise UnsafeDatabase(
            f"SQLite {sqlite3.sqlite_version} is too old: wq_sql needs >= 3.35 (RETURNING). "
            "Use a Python built against a newer SQLite, or PostgreSQL.")
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        raise InvalidInput("wq_sql needs a SQLite file shared by its workers, not an in-memory "
                           "database: use sqlite:///path/to/queue.db")
    path = Path(db).expanduser().resolve()
    if not path.parent.is_dir():
        raise DatabaseUnavailable(_missing_folder(path))
    fstype = _mount_fstype(path.parent)
    if fstype in NETWORK_FILESYSTEMS and not os.environ.get("WQ_SQL_ALLOW_NETWORK_FS"):
        raise UnsafeDatabase(
            f"{str(path)!r} is on a {fstype} filesystem, where SQLite's WAL locking is unsafe and the "
            "queue could hand out an item twice. Put the file on a local disk, or use PostgreSQL "
            "(WQ_SQL_URL=postgresql://...) for workers on several machines.")


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
    backend = url.get_backend_name()
    if backend == "sqlite":
        if schema:
            raise InvalidInput("schema= is for PostgreSQL; SQLite has one schema per file")
        check_sqlite_path(url)
        wait = lock_slice or busy_timeout
        engine = create_engine(url, pool_size=pool_size, max_overflow=0,
                               connect_args={"timeout": wait, "check_same_thread": False})
        _sqlite_hooks(engine, autocheckpoint)
        return engine
    if backend != "postgresql":
        raise InvalidInput(f"unsupported database {backend!r}: use sqlite:///file.db or postgresql://...")
    connect_args: dict[str, Any] = {"application_name": "wq_sql",
                                    **pooling.driver_connect_args(url.get_driver_name())}
    timeouts = None
    if statement_timeout is not None:
        timeouts = pooling.Timeouts(int(statement_timeout * 1000), startup_options)
        connect_args.update(timeouts.connect_args())
    opts: dict[str, Any] = {}
    if schema:
        if not _IDENT.match(schema):
            raise InvalidInput(f"schema must be a plain identifier (letters, digits, _), got {schema!r}")
        opts["schema_translate_map"] = {None: schema}
    engine = create_engine(url, pool_size=pool_size, max_overflow=0, pool_pre_ping=False,
                           execution_options=opts, connect_args=connect_args)
    if timeouts is not None:
        timeouts.install(engine)
    return engine


def _sqlite_hooks(engine: Engine, autocheckpoint: bool) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        # Let us issue BEGIN ourselves (pysqlite's implicit BEGIN is DEFERRED).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        if not autocheckpoint:
            cur.execute("PRAGMA wal_autocheckpoint=0")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # Read-only transactions ask for wq_read=True and do not take the write lock.
        if conn.get_execution_options().get("wq_read"):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")


@contextmanager
def driver_transaction(engine: Engine) -> Iterator[Any]:
    """A write transaction on a pooled connection, used through the driver itself (sqlite3 or
    psycopg2): the claim round's hot path, where SQLAlchemy's per-connection and per-statement
    machinery cost as much as SQLite's own work (``bench/claim_throughput.py``). SQLite: ``BEGIN
    IMMEDIATE`` first, as for every write transaction here; psycopg2 begins on the first
    statement. Commits on success; rolls back otherwise. Driver errors come out as SQLAlchemy's
    ``DBAPIError`` (``connection_invalidated`` set, and the connection dropped from the pool, when
    it is gone), as from ``Connection.execute``, so the callers' retry logic is the same."""
    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error
    try:
        fairy = engine.raw_connection()
    except driver_error as e:  # refused, server starting up, ...: as engine.connect() raises it
        gone = dialect.is_disconnect(e, None, None)
        raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e
    conn: Any = fairy.dbapi_connection
    begin = dialect_of(engine).begin_write
    tx = pooling.DriverTx.of(fairy, conn)  # Postgres: BEGIN and the timeouts in one round trip
    try:
        if begin:
            conn.execute(begin)
        tx.begin()
        yield conn
        tx.commit()
    except BaseException as e:
        gone = isinstance(e, driver_error) and dialect.is_disconnect(e, conn, None)
        if isinstance(e, DBAPIError):
            gone = gone or e.connection_invalidated
        if not gone:
            try:
                tx.rollback()
            except driver_error:
                gone = True
        if gone:
            fairy.invalidate(e if isinstance(e, Exception) else None)
        if isinstance(e, driver_error):
            raise DBAPIError.instance(None, None, e, driver_error, connection_invalidated=gone) from e
        raise
    finally:
        tx.close()
        fairy.close()
