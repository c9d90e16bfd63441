"""SQLite's engine: where the file may live, the connection set-up (WAL, ``BEGIN IMMEDIATE``
for every write transaction, so that a transaction takes the single write lock up front instead
of failing halfway with ``database is locked``) and what its open errors mean."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Optional

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
