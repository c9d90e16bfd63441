"""Engines: URL resolution, engine creation (one per URL and options, kept for forked children),
and the one-line errors of a database that cannot be reached or opened (``open_error``). What
differs between SQLite and Postgres (connection set-up, file checks, what an error means) is
asked of ``wq_sql.store.dialects``; driver-level connections are ``wq_sql.store.driver``'s.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError

from wq_sql.errors import DatabaseUnavailable, InvalidInput
from wq_sql.store.dialects import dialect_of
from wq_sql.store.dialects.postgresql import multihost_as_query
from wq_sql.store.dialects.sqlite import DEFAULT_FILE as DEFAULT_SQLITE_FILE
from wq_sql.store.redact import mask_secrets, safe_url

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
    to be that commit waits for the whole copy); the engine's owner checkpoints from a
    background thread instead (``WorkQueue``'s heartbeat thread, every second).

    SQLite, ``lock_slice``: a statement waits at most this long for the write lock (SQLite's busy
    handler sleeps 1, 2, 5 ms ... then 100 ms at a time, so under a saturated lock a waiter that
    reached 100 ms naps can starve while fresher waiters take turns); the caller
    retries every few ms up to ``busy_timeout`` (``WorkQueue._retrying``). Default: the busy
    handler waits up to ``busy_timeout`` itself.

    Postgres, ``statement_timeout`` (seconds; None: none): also the idle-in-transaction timeout,
    both set at the start of each transaction (``SET LOCAL``), which works directly and through
    PgBouncer in transaction mode (:mod:`wq_sql.store.dialects.postgresql`).
    ``startup_options=True``: as libpq
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
    A DataLoader worker otherwise makes its engine and initialises the dialect on its first
    connection, every pass unless its workers are persistent. No connection crosses the fork:
    the kept engine's pool is empty."""
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


