"""A torchrun job restarted with another world size: 2 ranks (DataLoader ``num_workers=2`` each)
run, the whole job is SIGKILLed, and it restarts with 1 rank, the same ``TORCHELASTIC_RUN_ID``
and a higher ``TORCHELASTIC_RESTART_COUNT``. Rank 1's identities never come back; their items,
and all the others the old incarnation held, are claimable as soon as the new rank joins (not
after a heartbeat look or the lease), and every record is trained; in checkpoint mode, once
against the old ranks' last checkpoints."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch_support import HERE, finish, free_port, kill_ranks_when, read_log, sql, start_rank, write_files

from wq_sql import InvalidInput, WorkQueue

TRAINER = HERE / "torch_ckpt_trainer.py"


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
    kill_ranks_when(ranks, lambda: min(len(read_log(Path(f"{log}.rank{r}"))) for r in (0, 1)) >= 5,
                    "going")
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


def test_checkpoint_mode_job_restarted_with_one_rank_less_trains_each_record_once(db_url: str,
                                                                                 tmp_path: Path) -> None:
    """``consumed="checkpoint"``: 2 ranks (DataLoader ``num_workers=2`` each) save their loader
    state every 5 steps, train 2 steps past the save at step 10 and are SIGKILLed; the job
    restarts with 1 rank (same ``TORCHELASTIC_RUN_ID``, restart 1), which resumes from rank 0's
    checkpoint and restores rank 1's state with it (``departed=``). Against each old rank's last
    checkpoint every record is trained once: what a
    checkpoint covered is never trained again, what it did not (trained after it, read ahead,
    rank 1's whole share) is trained by the new rank; twice only the first records of an item
    that straddled a save (at most one per DataLoader worker and rank)."""
    files, lines = write_files(tmp_path / "data", 60, 6)
    log, ckpt = tmp_path / "log", tmp_path / "ckpt.pt"
    job = {"url": db_url, "queue": "resize", "files": files, "num_epochs": 1, "num_workers": 2,
           "batch_size": 4, "every": 5, "hold_at": 12, "step_seconds": 0.02, "log": str(log),
           "ckpt": str(ckpt), "per_rank": True,
           # Heartbeats and leases far longer than the test: only the restart brings items back.
           "options": {"heartbeat_seconds": 60, "lease_seconds": 300, "max_attempts": 100}}
    port = free_port()
    ranks = [start_rank(job, r, 2, port, restart=0, script=TRAINER) for r in (0, 1)]
    kill_ranks_when(ranks, lambda: all(any("holding" in e for e in read_log(Path(f"{log}.rank{r}")))
                                       for r in (0, 1)), "to step 12")
    covered = {Path(w).name for (w,) in sql(db_url, "SELECT work FROM wq_audit WHERE queue = 'resize' "
                                                     "AND state = 'done'")}
    held_by_rank1 = [i for i, w in sql(db_url, "SELECT item_id, worker FROM wq_audit WHERE queue = 'resize' "
                                               "AND state = 'claimed'") if w.startswith("test/rank1")]
    old = [read_log(Path(f"{log}.rank{r}")) for r in (0, 1)]
    # What each old rank's last checkpoint (step 10) covered: the items whose every record was
    # in its batches up to step 10, and nothing else.
    upto10 = [[r for e in entries if e.get("step", 99) <= 10 for r in e["records"]] for entries in old]
    assert covered == set().union(*(whole(records) for records in upto10))
    assert held_by_rank1, "rank 1 held nothing at the kill"

    started = time.monotonic()
    # The new rank restores rank 0's state and, for the rank that does not come back, rank 1's.
    finish(start_rank({**job, "hold_at": None, "departed": [f"{ckpt}.rank1"]}, 0, 1, port, restart=1,
                      script=TRAINER), timeout=120)
    took = time.monotonic() - started
    runs = [e for e in read_log(Path(f"{log}.rank0")) if "restored" in e]
    assert [r["restored"] for r in runs] == [0, 10]
    entries = read_log(Path(f"{log}.rank0"))
    again = [r for e in entries[entries.index(runs[1]):] if "records" in e for r in e["records"]]
    assert not {item(r) for r in again} & covered, "an item a checkpoint covered was trained again"

    # Each old rank's batches up to its last checkpoint, then the new rank's: every record; twice
    # only records of items that straddled step 10 (their first records before it).
    timeline = Counter(upto10[0] + upto10[1] + again)
    assert set(timeline) == {f"{line}@e0" for line in lines}, "records lost for the model"
    twice = {item(r) for r, n in timeline.items() if n > 1}
    assert len(twice) <= 2 * 2, twice
    # SQL: every item done once, each by a checkpoint; rank 1's items went back when the new rank
    # joined (one 'expire' event each, saying the run restarted), not after the 300 s lease.
    assert [tuple(r) for r in sql(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = 'resize' "
                                          "GROUP BY state")] == [("done", 60)]
    assert sql(db_url, "SELECT count(*) FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                       "WHERE q.name = 'resize' AND i.ckpt_step IS NULL") == [(0,)]
    assert sql(db_url, "SELECT epoch, seq FROM wq_history WHERE queue = 'resize' AND kind = 'done' "
                       "GROUP BY epoch, seq HAVING count(*) <> 1") == []
    why = "job run 'test' restarted (restart 1): its earlier processes are gone"
    expired = {i for i, d in sql(db_url, "SELECT item_id, detail FROM wq_history WHERE queue = 'resize' "
                                         "AND kind = 'expire'") if d == why}
    assert set(held_by_rank1) <= expired
    assert took < 60
    print(f"\n{len(covered)} items covered by the old ranks' checkpoints, {len(held_by_rank1)} held by "
          f"rank 1 at the kill; the new rank trained {len(again)} records in {took:.1f} s; "
          f"{len(twice)} items straddled a save")


def item(record: str) -> str:
    """``f0012-003@e0`` -> ``part-0012.txt``."""
    return f"part-{record[1:5]}.txt"


def whole(records: list[str]) -> set[str]:
    """The files every record (6 per file) of which is in ``records``."""
    per_file = Counter(item(r) for r in set(records))
    return {name for name, n in per_file.items() if n == 6}
