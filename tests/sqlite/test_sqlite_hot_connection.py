"""SQLite's hot path connection (``engine.HotConnection``): the claim round's write transactions
run on one driver connection kept out of the pool, so the pool keeps its capacity; a second
thread that wants a write transaction meanwhile uses the pool; a failed transaction rolls back
and leaves the connection usable; close() and fork() leave no connection behind."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from wq_sql.store.db import Db
from wq_sql.store.engine import make_engine, resolve_url


@pytest.fixture
def db(tmp_path: Path) -> Any:
    url = resolve_url(f"sqlite:///{tmp_path / 'h.db'}")
    handle = Db(make_engine(url, pool_size=1), url, busy_timeout=5.0, label="hot")
    with handle.engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE t (x INTEGER)")
    yield handle
    handle.close()


def _insert(x: int) -> Any:
    def fn(conn: Any) -> Any:
        conn.execute("INSERT INTO t VALUES (?)", (x,))
        return conn
    return fn


def _rows(db: Db) -> list[int]:
    with db.engine.connect() as c:
        return [r[0] for r in c.exec_driver_sql("SELECT x FROM t ORDER BY x")]


def test_one_connection_out_of_the_pool(db: Db) -> None:
    first = db.driver_tx(_insert(1))
    second = db.driver_tx(_insert(2))
    assert first is second  # the same driver connection, round after round
    pool: Any = db.engine.pool
    assert pool.checkedout() == 0
    # The pool's one connection is still there for the others (heartbeat, reads).
    with db.engine.connect() as c:
        assert c.connection.dbapi_connection is not first
        assert pool.checkedout() == 1
    assert _rows(db) == [1, 2]


def test_a_second_writer_meanwhile_uses_the_pool(db: Db) -> None:
    inside, release = threading.Event(), threading.Event()
    seen: list[Any] = []

    def slow(conn: Any) -> None:
        conn.execute("INSERT INTO t VALUES (1)")
        inside.set()
        assert release.wait(30)
        seen.append(conn)

    t = threading.Thread(target=db.driver_tx, args=(slow,))
    t.start()
    assert inside.wait(30)
    # The first thread holds the hot connection and the write lock: the second gets a pooled
    # connection, waits for its turn, and commits after the first.
    second = threading.Thread(target=lambda: seen.append(db.driver_tx(_insert(2))))
    second.start()
    release.set()
    t.join(30)
    second.join(30)
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert _rows(db) == [1, 2]


def _read(conn: Any, prefix: str) -> tuple[Any, list[int]]:
    cur = conn.cursor()
    try:
        return conn, [r[0] for r in cur.execute(prefix + "SELECT x FROM t ORDER BY x").fetchall()]
    finally:
        cur.close()


def test_reads_use_it_when_free_and_the_pool_when_busy(db: Db) -> None:
    """``driver_read`` runs on the hot connection when no thread holds it (a worker needs no
    second connection for its looks), on a pooled one while a write transaction holds it."""
    hot = db.driver_tx(_insert(1))
    pool: Any = db.engine.pool
    before = pool.checkedin()
    conn, rows = db.driver_read(_read)
    assert conn is hot and rows == [1]
    assert pool.checkedin() == before  # no pooled connection was opened for it
    assert not hot.in_transaction

    inside, release = threading.Event(), threading.Event()

    def slow(c: Any) -> None:
        c.execute("INSERT INTO t VALUES (2)")
        inside.set()
        assert release.wait(30)

    t = threading.Thread(target=db.driver_tx, args=(slow,))
    t.start()
    try:
        assert inside.wait(30)
        conn, rows = db.driver_read(_read)
        assert conn is not hot and rows == [1]  # the writer's row is not committed yet
    finally:
        release.set()
        t.join(30)
    conn, rows = db.driver_read(_read)
    assert conn is hot and rows == [1, 2]


def test_a_failed_read_leaves_the_connection_usable(db: Db) -> None:
    hot = db.driver_tx(_insert(1))

    def bad(conn: Any, prefix: str) -> None:
        conn.execute("SELECT x FROM nowhere").fetchall()

    with pytest.raises(DBAPIError, match="nowhere"):
        db.driver_read(bad)
    assert db.driver_read(_read) == (hot, [1])


def test_a_failed_transaction_rolls_back_and_the_connection_stays(db: Db) -> None:
    conn = db.driver_tx(_insert(1))

    def bad(c: Any) -> None:
        c.execute("INSERT INTO t VALUES (2)")
        c.execute("INSERT INTO nowhere VALUES (3)")

    with pytest.raises(DBAPIError, match="nowhere"):
        db.driver_tx(bad)
    assert not conn.in_transaction
    assert db.driver_tx(_insert(4)) is conn
    assert _rows(db) == [1, 4]


def test_close_closes_it(db: Db) -> None:
    conn = db.driver_tx(_insert(1))
    db.close()
    with pytest.raises(sqlite3.ProgrammingError):
        conn.execute("SELECT 1")


def test_a_connection_from_another_process_is_closed_not_used(db: Db) -> None:
    """A fork Python did not announce (no at-fork hooks ran): the next transaction finds the
    connection was opened by another process id, closes it, and opens its own."""
    inherited = db.driver_tx(_insert(1))
    hot: Any = db._hot
    hot._pid = -1  # as if this process were the child of the one that opened it
    mine = db.driver_tx(_insert(2))
    assert mine is not inherited
    with pytest.raises(sqlite3.ProgrammingError):
        inherited.execute("SELECT 1")
    assert db.driver_tx(_insert(3)) is mine
    assert _rows(db) == [1, 2, 3]


_FORK = r"""
import os, sys
from wq_sql.store.db import Db
from wq_sql.store.engine import make_engine, resolve_url
url = resolve_url(sys.argv[1])
db = Db(make_engine(url), url, busy_timeout=5.0, label="fork")
db.driver_tx(lambda c: c.execute("CREATE TABLE t (who TEXT, conn INTEGER)"))
parent = db.driver_tx(lambda c: c)
pid = os.fork()
if pid == 0:  # the child inherits no connection: it opens its own
    db.in_child()
    child = db.driver_tx(lambda c: c)
    db.driver_tx(lambda c: c.execute("INSERT INTO t VALUES ('child', ?)", (int(child is parent),)))
    db.close()
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert status == 0, status
again = db.driver_tx(lambda c: c)
db.driver_tx(lambda c: c.execute("INSERT INTO t VALUES ('parent', ?)", (int(again is parent),)))
db.close()
print("ok")
"""


def test_fork_leaves_no_connection_to_the_child(tmp_path: Path) -> None:
    """fork() closes the hot connection first (as the pool's idle ones), so the child, which must
    not use the parent's SQLite connection, opens its own; the parent opens a new one too."""
    db = tmp_path / "f.db"
    out = subprocess.run([sys.executable, "-c", _FORK, f"sqlite:///{db}"], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok", out.stderr
    rows = dict(sqlite3.connect(db).execute("SELECT who, conn FROM t").fetchall())
    assert rows == {"child": 0, "parent": 0}
