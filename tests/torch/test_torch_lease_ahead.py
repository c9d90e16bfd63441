"""The lease-ahead bound of a loader: the items it holds claimed that it has not reached yet
(the core's buffer plus the rest of the hand-out it reads from) stay within ``lease_ahead``.
Sampled after every record of a slow DataLoader (in the main process, so the records reach the
loop as they are read), on every backend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import pytest
from lease_bound import Unreached  # noqa: E402
from torch_support import close_datasets, write_files  # noqa: F401 - an autouse fixture

from wq_sql.torch import DataLoader, QueueDataset  # noqa: E402

FILES, LINES = 48, 3


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


@pytest.mark.parametrize("lease_ahead", [4, 16, None])
@pytest.mark.parametrize("consumed", ["trained", "checkpoint"])
def test_claimed_not_reached_stays_within_lease_ahead(db_url: str, tmp_path: Path, lease_ahead: Optional[int],
                                                       consumed: str, sizes: list[int]) -> None:
    paths, _ = write_files(tmp_path / "data", FILES, LINES)
    ds = QueueDataset(paths, url=db_url, read=read_lines, worker="r", lease_ahead=lease_ahead,
                      consumed=consumed)
    probe = Unreached(db_url, "work_queue", "r/loader0")
    records = 0
    try:
        for batch in DataLoader(ds, batch_size=1, num_workers=0):
            file = paths[int(batch[0].split("-")[0][1:])]
            time.sleep(0.002)
            held = probe.sample([file])
            assert held <= max(sizes), (probe.most, max(sizes), records)  # sizes read after the sample
            records += 1
    finally:
        probe.close()
    assert records == FILES * LINES
