"""Waiting on data: the time a training loop waits in ``next()`` for its batch, as the DataLoader
measures it, reaches the rank's worker row (``wq_workers.input_wait``), the metrics and the
dashboard's figures, and agrees with the trainer's own measurement."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch_support import close_datasets, sql, write_files  # noqa: F401 - an autouse fixture

from wq_sql.monitor import snapshot
from wq_sql.store import statements
from wq_sql.store.dialects import dialect_of
from wq_sql.store.engine import make_engine, resolve_url
from wq_sql.torch import DataLoader, QueueDataset

READ_PAUSE = 0.02  # per record: the reader is the slow part
STEP = 0.01  # per batch: the "training step"


def slow_lines(path: str) -> list[str]:
    out = []
    with open(path) as f:
        for line in f.read().splitlines():
            time.sleep(READ_PAUSE)
            out.append(line)
    return out


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_wait_for_data_is_what_the_trainer_measured(db_url: str, tmp_path: Path,
                                                        num_workers: int) -> None:
    files, lines = write_files(tmp_path / "data", 12, 5)
    ds = QueueDataset(files, url=db_url, read=slow_lines, name="slow", worker="r", heartbeat_seconds=0.2)
    loader = DataLoader(ds, batch_size=5, num_workers=num_workers)
    waited, seen = 0.0, 0
    it = iter(loader)
    while True:
        asked = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            waited += time.perf_counter() - asked
            break
        waited += time.perf_counter() - asked
        seen += len(batch)
        time.sleep(STEP)
    assert seen == len(lines)
    assert waited > 0.5 * len(lines) * READ_PAUSE  # the reader did hold the loop up
    ds.close()  # the rank leaves: its final total is written

    (recorded,), = sql(db_url, "SELECT input_wait FROM wq_workers WHERE name = 'r'")
    assert recorded is not None and abs(recorded - waited) <= 0.1 * waited, (recorded, waited)
    print(f"waited {waited:.3f} s, recorded {recorded:.3f} s")
    # The loader side's identities (DataLoader worker processes) wait for nothing: not measured.
    others = sql(db_url, "SELECT name, input_wait FROM wq_workers WHERE name <> 'r'")
    assert all(w is None for _, w in others), others


def test_a_live_ranks_wait_is_a_share_of_its_running_time(db_url: str, tmp_path: Path) -> None:
    """While it runs, the rank's heartbeat sends its total; the snapshot the metrics and the
    dashboard read makes it a share of the rank's time from start to its last heartbeat."""
    files, _ = write_files(tmp_path / "data", 20, 5)
    ds = QueueDataset(files, url=db_url, read=slow_lines, name="live", worker="r", heartbeat_seconds=0.2)
    it = iter(DataLoader(ds, batch_size=5, num_workers=1))
    for _ in range(8):
        next(it)
    engine = make_engine(resolve_url(db_url))
    try:
        deadline = time.monotonic() + 30
        while True:  # the next heartbeat after those waits carries them
            view = snapshot.snapshot(engine, lambda c: snapshot.read_queue(
                c, dialect_of(c), statements.find_queue(c, "live")))
            rank = next(w for w in view.workers if w.name == "r")
            if rank.input_wait:
                break
            assert time.monotonic() < deadline, "no heartbeat carried the wait"
            next(it)
        share, most = snapshot.waiting_on_data(view.workers)
        assert rank.input_wait_share is not None and 0.0 < rank.input_wait_share <= 1.0
        assert share == pytest.approx(rank.input_wait_share) and most[0].name == "r"
    finally:
        engine.dispose()
        ds.close()
