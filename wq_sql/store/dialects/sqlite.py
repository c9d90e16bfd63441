"""SQLite's engine: where the file may live, the connection set-up (WAL, ``BEGIN IMMEDIATE``
for every write transaction, so that a transaction takes the single write lock up front instead
of failing halfway with ``database is locked``) and what its open errors mean."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

try:
    import fcntl
except ImportError:  # Windows: no writers' queue
    fcntl = None  # type: ignore[assignment]

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL

from wq_sql.errors import DatabaseUnavailable, InvalidInput, UnsafeDatabase

DEFAULT_FILE = "wq_sql.db"
NETWORK_FILESYSTEMS = {
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smbfs", "smb3", "fuse.sshfs", "ceph", "fuse.cephfs",
    "glusterfs", "fuse.glusterfs", "9p", "afs", "beegfs", "fuse.s3fs", "fuse.gcsfuse",
}
MIN_VERSION = (3, 35, 0)  # RETURNING
MOUNTS = "/proc/mounts"  # where the filesystem of a folder is looked up
log = logging.getLogger("wq_sql")


def check_url(url: URL, shown: str) -> None:
    """``sqlite://jobs.db``: SQLAlchemy reads jobs.db as a host and opens an in-memory database."""
    if url.host:
        path = "/".join(p for p in (url.host, url.database) if p)
        raise InvalidInput(
            f"{shown!r} names {url.host!r} as a host, and SQLite has none: a slash is probably "
            f"missing. Use sqlite:///{path} (relative to the working directory) or "
            f"sqlite:////abs/path/{Path(path).name} (an absolute path: four slashes)")


def mount_fstype(path: Path) -> Optional[str]:
    """The filesystem type of the mount that holds ``path`` (None: unknown)."""
    try:
        mounts = Path(MOUNTS).read_text().splitlines()
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


def _missing_folder(path: Path) -> str:
    return f"the folder of the SQLite file {str(path)!r} does not exist; create it first"


def check_path(url: URL) -> None:
    """Refuse what SQLite cannot do safely: old versions, in-memory databases, WAL on network
    filesystems (``WQ_SQL_ALLOW_NETWORK_FS=1`` overrides)."""
    if sqlite3.sqlite_version_info < MIN_VERSION:
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
    fstype = mount_fstype(path.parent)
    if fstype in NETWORK_FILESYSTEMS and not os.environ.get("WQ_SQL_ALLOW_NETWORK_FS"):
        raise UnsafeDatabase(
            f"{str(path)!r} is on a {fstype} filesystem, where SQLite's WAL locking is unsafe and the "
            "queue could hand out an item twice. Put the file on a local disk, or use PostgreSQL "
            "(WQ_SQL_URL=postgresql://...) for workers on several machines.")


def make_engine(url: URL, *, schema: Optional[str], busy_timeout: float, pool_size: int,
                autocheckpoint: bool, lock_slice: Optional[float]) -> Engine:
    """See ``engine.make_engine``."""
    if schema:
        raise InvalidInput("schema= is for PostgreSQL; SQLite has one schema per file")
    check_path(url)
    wait = lock_slice or busy_timeout
    engine = create_engine(url, pool_size=pool_size, max_overflow=0,
                           connect_args={"timeout": wait, "check_same_thread": False})

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
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("wq_read") else "BEGIN IMMEDIATE")

    return engine


def open_error(url: URL, detail: str, given: str) -> Optional[str]:
    """The one-line message of a file SQLite cannot open, is not a database or is read-only;
    None for other errors."""
    low = detail.lower()
    path = Path(url.database or "").expanduser().resolve()
    if "unable to open" in low:
        if path.is_dir():
            return (f"the SQLite path {str(path)!r} is a folder; name a file in it, e.g. "
                    f"sqlite:///{path / DEFAULT_FILE}")
        if not path.parent.is_dir():
            return _missing_folder(path)
        return (f"cannot open the SQLite database {str(path)!r} ({detail}); check the path in "
                f"{given} and the permissions of the file and its folder")
    if "not a database" in low:
        return (f"{str(path)!r} is not a SQLite database ({detail}); check the path in {given}, or "
                "name a new file for wq_sql to create")
    if "readonly" in low or "read-only" in low:
        return (f"the SQLite database {str(path)!r} is read-only ({detail}) and wq_sql writes to it; "
                f"make the file and its folder writable (SQLite keeps {path.name}-wal and "
                f"{path.name}-shm beside it)")
    return None


# ---------------------------------------------------------------- the writers' queue

FAIR_ENV = "WQ_SQL_SQLITE_FAIR"  # "0": no writers' queue, SQLite's busy handler alone (for A/B runs)
TURNS_SUFFIX = "-wqturns"  # the lock file beside the database: <name>-wqturns
_MUTEX = 0  # byte 0 of the lock file guards the ticket counter, stored in its first 8 bytes
_FIRST = 1  # ticket t waits and holds its turn on byte _FIRST + t (a lock range, not file content)
_FLOCK = struct.Struct("hhqqi")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD)
_warned: set[str] = set()
_held = threading.local()  # the lock files whose turn this thread holds (nested transactions)
_NESTED = -1  # WriterQueue.enter(): no turn taken (held already, or no lock file)


class WriterQueue:
    """A first-come, first-served queue of the write transactions of every process on this host,
    in front of ``BEGIN IMMEDIATE``: :meth:`turn` returns when every write transaction that asked
    before it has ended, so SQLite's single write lock is free when it is taken (SQLite's busy
    handler is unfair: a waiter sleeps with backoff, up to 100 ms, and newcomers barge past it,
    so under a saturated lock a few writes wait far longer than the others).

    A ticket lock on open-file-description (OFD) byte-range locks of ``<db>-wqturns``: under the
    lock on byte 0, a writer reads the ticket counter t from the file, locks byte ``1 + t`` (its
    turn) and writes t + 1; then it waits, woken by the kernel, until every byte below is free
    (every turn before its own has ended, or its writer died), the byte ``t`` of the writer just
    ahead last. Ending the turn unlocks what its descriptor holds. The kernel drops the locks of a
    process that dies, killed or not, so a dead writer never holds the others; and OFD locks
    belong to an open file, not to a process, so every wait uses a descriptor of its own and the
    threads of one process queue like processes. Read-only transactions never ask for a turn."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key = str(path)
        self._pid = os.getpid()
        self._idle: list[int] = []  # descriptors of the lock file, holding no lock
        self._mu = threading.Lock()
        self._closed = False
        self._off = False  # the lock file cannot be used: no turns

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold this writer's turn: enter before ``BEGIN IMMEDIATE``, leave after ``COMMIT`` or
        ``ROLLBACK``. A thread that holds the turn already (a transaction inside another) gets
        it again at once: waiting would wait for itself."""
        fd = self.enter()
        try:
            yield
        finally:
            self.leave(fd)

    def enter(self) -> int:
        """:meth:`turn` without a context manager (the hot path's transaction is a plain
        ``try``): wait for this writer's turn; returns what :meth:`leave` takes."""
        held: set[str] = _held.__dict__.setdefault("files", set())
        key = self._key
        if key in held:
            return _NESTED
        fd = self._descriptor()
        if fd is not None:
            try:
                _take_turn(fd)
            except OSError as e:  # e.g. ENOLCK, EINVAL (no OFD locks): go on without a turn
                os.close(fd)  # closing drops every lock it holds
                self._give_up(e)
                fd = None
            except BaseException:
                os.close(fd)
                raise
        if fd is None:  # no lock file: SQLite's busy handler alone
            return _NESTED
        held.add(key)
        return fd

    def leave(self, fd: int) -> None:
        """End the turn :meth:`enter` returned ``fd`` for."""
        if fd == _NESTED:
            return
        _held.files.discard(self._key)
        self._give_back(fd)

    def _descriptor(self) -> Optional[int]:
        with self._mu:
            if self._off:
                return None
            if self._pid != os.getpid():  # a fork: the inherited descriptors share the parent's
                for fd in self._idle:      # open files (closing them here leaves the parent's)
                    os.close(fd)
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:  # a read-only folder, ...
            self._give_up(e)
            return None

    def _give_up(self, e: OSError) -> None:
        """One WARNING per lock file and process; from now on this queue hands out no turns."""
        with self._mu:
            self._off = True
            if str(self.path) in _warned:
                return
            _warned.add(str(self.path))
        log.warning("SQLite writers of %s wait in SQLite's busy handler, where a few waits can last "
                    "hundreds of ms under a saturated write lock: the lock file %s that queues them "
                    "in order cannot be used (%s); make its folder writable",
                    self.path.with_name(self.path.name[:-len(TURNS_SUFFIX)]), self.path, e.strerror or e)

    def _give_back(self, fd: int) -> None:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLOCK_ALL)  # the whole file: this writer's byte
        except OSError:
            os.close(fd)
            return
        with self._mu:
            if self._pid == os.getpid() and not self._closed:
                self._idle.append(fd)
                return
        os.close(fd)

    def close(self) -> None:
        """Close the idle descriptors (a turn in progress closes its own when it ends)."""
        with self._mu:
            self._closed = True
            idle, self._idle = (self._idle, []) if self._pid == os.getpid() else ([], [])
        for fd in idle:
            os.close(fd)


def _request(kind: int, start: int, length: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0) + bytes(8)


if fcntl is not None and hasattr(fcntl, "F_OFD_SETLKW"):
    _MUTEX_LOCK = _request(fcntl.F_WRLCK, _MUTEX, 1)
    _MUTEX_UNLOCK = _request(fcntl.F_UNLCK, _MUTEX, 1)
    _UNLOCK_ALL = _request(fcntl.F_UNLCK, 0, 0)


def _lock(fd: int, kind: int, start: int, length: int, wait: bool = False) -> None:
    """An OFD lock (``kind``: F_RDLCK, F_WRLCK or F_UNLCK) on ``length`` bytes from ``start``
    (0: to the end of the file and beyond); ``wait``: block until it is granted."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                _request(kind, start, length))


def _try_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """:func:`_lock` without waiting: False if another descriptor holds a conflicting lock."""
    try:
        _lock(fd, kind, start, length)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _take_turn(fd: int) -> None:
    # The mutex's lock and unlock are the same two requests every time: packed once.
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _MUTEX_LOCK)
    try:
        raw = os.pread(fd, 8, 0)
        ticket = int.from_bytes(raw, "little") if len(raw) == 8 else 0
        # Nobody holds this byte unless the file was reset under live writers: then wait for them.
        _lock(fd, fcntl.F_WRLCK, _FIRST + ticket, 1, wait=True)
        os.pwrite(fd, (ticket + 1).to_bytes(8, "little"), 0)
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _MUTEX_UNLOCK)
    # Read locks wait for the write locks of the turns without conflicting with other waiters;
    # they stay until this turn ends (no writer locks those bytes again). First the writer two
    # ahead, then every one before it (at once, unless one died while waiting: its byte was free
    # before its turn came), then the one just ahead: so the moment that one's turn ends, this
    # one's begins, with no further call (each call lets the process's other threads take the
    # GIL, which a busy one, e.g. the epoch maker's shuffle, keeps for up to Python's switch
    # interval).
    if ticket and _try_lock(fd, fcntl.F_RDLCK, _FIRST, ticket):
        return  # nobody ahead (no wait: one call)
    if ticket >= 2:
        _lock(fd, fcntl.F_RDLCK, _FIRST + ticket - 2, 1, wait=True)
    if ticket >= 3:
        _lock(fd, fcntl.F_RDLCK, _FIRST, ticket - 2, wait=True)
    if ticket >= 1:
        _lock(fd, fcntl.F_RDLCK, _FIRST + ticket - 1, 1, wait=True)


def writer_queue(url: URL) -> Optional[WriterQueue]:
    """The writers' queue of the SQLite file ``url`` names; None for an in-memory database, a
    file on a network filesystem (a lock of a dead host lingers there), a platform without OFD
    locks or ``WQ_SQL_SQLITE_FAIR=0``. The lock file is made at the first write transaction; if
    it cannot be (a read-only folder), one WARNING, and the writers wait in SQLite's busy
    handler, as before."""
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:") or os.environ.get(FAIR_ENV, "1") == "0":
        return None
    if fcntl is None or not hasattr(fcntl, "F_OFD_SETLKW"):  # Linux >= 3.15 only
        return None
    path = Path(db).expanduser().resolve()
    if mount_fstype(path.parent) in NETWORK_FILESYSTEMS:
        return None
    return WriterQueue(path.with_name(path.name + TURNS_SUFFIX))
