"""The lease-ahead bound of ``input_dataset()``, as the README states it: claimed items that the
pipeline has not reached yet (the core's buffer plus the rest of the hand-out being read) stay
within ``lease_ahead``, TensorFlow's own one-element read-ahead aside (DeepRec issue #436: every
file was claimed before the first step). Sampled after every line a slow pipeline reads, on every
backend, for a fixed and for the automatic size."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import pytest
import tensorflow as tf
from lease_bound import Unreached  # noqa: E402
from tf_support import write_text_files

from wq_sql.tf import WorkQueue  # noqa: E402

FILES, LINES = 48, 3
TF_READ_AHEAD = 1  # the prefetch tf.data injects after a pipeline's last synchronous step


@pytest.mark.parametrize("lease_ahead", [4, 16, None])
def test_claimed_not_reached_stays_within_lease_ahead(db_url: str, tmp_path: Path, sizes: list[int],
                                                       lease_ahead: Optional[int]) -> None:
    paths, _ = write_text_files(tmp_path / "data", [LINES] * FILES)
    wq = WorkQueue(paths, shuffle=False, url=db_url, worker="w", lease_ahead=lease_ahead)
    probe = Unreached(db_url, "work_queue", "w")
    bound = 0
    lines = 0
    try:
        for line in tf.data.TextLineDataset(wq.input_dataset()):
            file = paths[int(line.numpy().decode().split()[1])]
            time.sleep(0.002)
            held = probe.sample([file])
            bound = max(sizes)  # read after the sample: every size in force before it
            assert held <= bound + TF_READ_AHEAD, (probe.most, bound, lines)
            lines += 1
    finally:
        probe.close()
        wq.close()
    assert lines == FILES * LINES
    if lease_ahead:
        assert bound == lease_ahead
