"""A torchrun job restarted with another world size: 2 ranks (DataLoader ``num_workers=2`` each)
run, the whole job is SIGKILLed, and it restarts with 1 rank, the same ``TORCHELASTIC_RUN_ID``
and a higher ``TORCHELASTIC_RESTART_COUNT``. Rank 1's identities never come back; their items,
and all the others the old incarnation held, are claimable as soon as the new rank joins (not
after a heartbeat look or the lease), and every record is trained."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch_support import finish, free_port, read_log, sql, start_rank, write_files

from wq_sql import InvalidInput, WorkQueue


def when(value: Any) -> dt.datetime:
    """A timestamp read with plain SQL (SQLite gives its text)."""
    t = dt.datetime.fromisoformat(value) if isinstance(value, str) else value
    return t.replace(tzinfo=None)


def test_restarted_job_with_another_world_size_gets_the_old_items_at_once(db_url: str,
                                                                          tmp_path: Path) -> None:
    files, lines = write_files(tmp_path / "data", 120, 4)
    log = tmp_path / "log"
    # Heartbeats and leases far longer than the test: only the restart can bring the items back.
    job = {"url": db_url, "queue": "rerun", "files": files, "num_epochs": 1, "num_workers": 2,
           "batch_size": 4, "lease_ahead": 4, "log": str(log), "start_line": True,  # both ranks read
           "options": {"heartbeat_seconds": 60, "lease_seconds": 300}}
    port = free_port()
    ranks = [start_rank(job, r, 2, port, read_seconds=0.05, restart=0) for r in (0, 1)]
    deadline = time.monotonic() + 120
    while min(len(read_log(Path(f"{log}.rank{r}"))) for r in (0, 1)) < 5:
        assert time.monotonic() < deadline, "the ranks did not get going"
        assert all(p.poll() is None for p in ranks), "a rank ended early"
        time.sleep(0.05)
    for p in ranks:
        os.killpg(p.pid, signal.SIGKILL)
    for p in ranks:
        p.wait()
    time.sleep(0.1)
    held = sql(db_url, "SELECT item_id, worker FROM wq_audit WHERE queue = 'rerun' AND state = 'claimed'")
    assert {w.split("/")[1] for _, w in held} == {"rank0", "rank1"}, held
    before = [read_log(Path(f"{log}.rank{r}")) for r in (0, 1)]

    started = time.monotonic()
    new = start_rank({**job, "log": f"{log}.again"}, 0, 1, port, read_seconds=0.05, restart=1)
    ids = [i for i, _ in held]
    while sql(db_url, "SELECT count(*) FROM wq_items i JOIN wq_workers w ON w.id = i.worker_id "
                      "WHERE i.state = 'claimed' AND w.run_restart = 0 AND i.id IN ("
                      + ",".join(map(str, ids)) + ")")[0][0]:
        assert time.monotonic() - started < 60 and new.poll() is None, "the old items did not come back"
        time.sleep(0.02)
    back_after = time.monotonic() - started
    finish(new)

    # Every item the old incarnation held went back when the new rank joined: one 'expire' event
    # each, saying the run restarted, written with the new rank's registration.
    returned = sql(db_url, "SELECT item_id, detail, at FROM wq_history WHERE queue = 'rerun' "
                           "AND kind = 'expire'")
    assert sorted(i for i, _, _ in returned) == sorted(ids)
    why = "job run 'test' restarted (restart 1): its earlier processes are gone"
    assert {d for _, d, _ in returned} == {why}
    joined = sql(db_url, "SELECT w.started_at FROM wq_workers w JOIN wq_queues q ON q.id = w.queue_id "
                         "WHERE q.name = 'rerun' AND w.name = 'test/rank0'")[0][0]
    gaps = [abs((when(at) - when(joined)).total_seconds()) for _, _, at in returned]
    assert max(gaps) < 1.0, (joined, returned)
    assert back_after < 60  # well within one heartbeat (60 s) and the lease (300 s)
    # Rank 1's rows are closed; rank 0's are the new incarnation's.
    rows = sql(db_url, "SELECT w.name, w.run_restart, w.heartbeat_at IS NULL FROM wq_workers w "
                       "JOIN wq_queues q ON q.id = w.queue_id WHERE q.name = 'rerun' ORDER BY w.name")
    assert [(n, r, bool(c)) for n, r, c in rows] == [
        ("test/rank0", 1, True), ("test/rank0/loader0", 1, True), ("test/rank0/loader1", 1, True),
        ("test/rank1", 0, True), ("test/rank1/loader0", 0, True), ("test/rank1/loader1", 0, True)]

    trained: Counter[str] = Counter()
    for batches in [*before, read_log(Path(f"{log}.again.rank0"))]:
        for batch in batches:
            trained.update(r.split("@")[0] for r in batch["records"])
    assert set(trained) == set(lines)
    rows = sql(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = 'rerun' GROUP BY state")
    assert [tuple(r) for r in rows] == [("done", 120)]
    print(f"\nthe old incarnation's {len(ids)} items were claimable {back_after:.2f} s after the new rank "
          "started (its import of torch included)")


def test_run_is_checked(db_url: str) -> None:
    for bad in [("", 0), ("job", -1), ("job", True), "job", ("job", 1, 2)]:
        with pytest.raises(InvalidInput, match="run must be"):
            WorkQueue(["a"], url=db_url, run=bad)  # type: ignore[arg-type]
