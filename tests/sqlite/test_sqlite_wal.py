"""SQLite specifics of a worker's engine: claims never checkpoint the WAL (the heartbeat thread
does, every second), and a worker waiting for a busy write lock retries every few ms instead
of sleeping in SQLite's 100 ms naps, yet still gives up with DatabaseBusy after busy_timeout."""

from __future__ import annotations

import sqlite3
import struct
import threading
import time
from pathlib import Path

import pytest

from wq_sql import DatabaseBusy, WorkQueue
from wq_sql.worker import heartbeat


def _wal_frames(db: Path) -> int:
    """The number of frames in the WAL, from the WAL index (the -shm file's header, mxFrame at
    byte 16, native order). It drops only when a writer starts the WAL over, which SQLite does
    only after a checkpoint copied every frame into the database file."""
    frames, = struct.unpack_from("=I", Path(f"{db}-shm").read_bytes(), 16)
    return int(frames)


def test_claims_do_not_checkpoint_the_heartbeat_does(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "q.db"
    # The heartbeat thread wakes (and checkpoints) only at its beat, 5 s after the start, so the
    # claims below run with no checkpoint beside them however slow the machine is.
    monkeypatch.setattr(heartbeat, "CHECKPOINT_SECONDS", 3600.0)
    # No refill thread: every commit is the test's own, so the WAL's size is the test's to bound.
    with WorkQueue([f"w{i}" for i in range(3000)], url=f"sqlite:///{db}", lease_ahead=8,
                   heartbeat_seconds=5, claim_ahead=False) as wq:
        with wq.engine.connect() as c:
            assert c.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == 0
        own = sqlite3.connect(db)
        own.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # the creation's pages
        own.close()
        before = db.stat().st_mtime_ns
        started = time.monotonic()
        for _ in range(2500):  # ~7,000 WAL pages' worth of commits: SQLite would checkpoint
            wq.take()
        assert time.monotonic() - started < 4, "too slow to finish before the heartbeat's beat"
        assert db.stat().st_mtime_ns == before, "a claim's commit copied the WAL into the file"
        wal = Path(f"{db}-wal").stat().st_size
        assert wal > 1000 * 4096
        frames = _wal_frames(db)
        deadline = time.monotonic() + 15
        # The heartbeat's checkpoint copies every frame, then its renewal (a write) starts the
        # WAL over: waiting for the file's mtime alone raced a checkpoint still copying.
        while _wal_frames(db) >= frames and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _wal_frames(db) < frames, "the heartbeat thread never checkpointed"
        assert db.stat().st_mtime_ns != before
        # The WAL was started over: the next writers reuse it from the start, it does not grow.
        for _ in range(200):
            wq.take()
        assert Path(f"{db}-wal").stat().st_size <= wal


def test_a_held_write_lock_ends_in_database_busy(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    url = f"sqlite:///{db}"
    wq = WorkQueue(["a", "b", "c"], url=url, busy_timeout=1.0, heartbeat_seconds=5)
    hog = sqlite3.connect(db, isolation_level=None)
    hog.execute("BEGIN IMMEDIATE")
    try:
        t = time.monotonic()
        with pytest.raises(DatabaseBusy, match="busy_timeout"):
            wq.take()
        assert 0.9 < time.monotonic() - t < 5
    finally:
        hog.execute("ROLLBACK")
        hog.close()
    assert wq.take() in {"a", "b", "c"}  # and it works again once the lock is free
    wq.close()


def test_a_lock_held_briefly_is_waited_for(tmp_path: Path) -> None:
    """Longer than one lock slice (50 ms), shorter than busy_timeout: take() returns once the lock
    is free, it does not fail. (How fair the retries are under a saturated lock is measured by
    bench/scale.py rollover, not here.)"""
    db = tmp_path / "q.db"
    wq = WorkQueue(["a", "b"], url=f"sqlite:///{db}", heartbeat_seconds=5)
    hog = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    hog.execute("BEGIN IMMEDIATE")

    release = threading.Timer(0.4, lambda: hog.execute("ROLLBACK"))
    release.start()
    t = time.monotonic()
    assert wq.take() in {"a", "b"}
    waited = time.monotonic() - t
    release.join()
    hog.close()
    assert 0.35 < waited < 1.0, waited
    wq.close()
