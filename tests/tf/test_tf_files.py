"""Real files with real lines: every line read exactly once across worker processes, and items
claimed only as the pipeline pulls them (DeepRec issue #436: every file was taken before the
first training step)."""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Callable

import pytest
import tensorflow as tf
from tf_support import finish_worker, start_worker, states_of, write_text_files

from wq_sql.tf import WorkQueue


def test_text_lines_exactly_once_across_two_workers(db_url: str, tmp_path: Path) -> None:
    sizes = [17, 0, 40, 1, 23, 9, 31, 2, 12, 28, 5, 19]  # one empty file
    paths, lines = write_text_files(tmp_path / "data", sizes)
    (tmp_path / "barrier").mkdir()
    job = {"mode": "text_lines", "files": paths, "url": db_url, "barrier": str(tmp_path / "barrier"),
           "n_workers": 2, "pause": 0.03}
    procs = [start_worker({**job, "worker": f"worker:{i}"}) for i in range(2)]
    reports = [finish_worker(p) for p in procs]
    got = [line for r in reports for line in r["lines"]]
    duplicates = [line for line, n in collections.Counter(got).items() if n > 1]
    assert duplicates == []
    assert sorted(got) == sorted(lines)
    assert sum(r["taken"] for r in reports) == len(paths)
    assert all(r["taken"] > 0 for r in reports), [r["taken"] for r in reports]
    assert all(r["ended_again"] for r in reports)  # a new pass ends with OutOfRange at once


LINES_PER_FILE = 50
N_FILES = 20


def seed_pipeline(files: tf.data.Dataset) -> tf.data.Dataset:
    """DeepRec's documented pipeline, with buffers smaller than one file."""
    ds = tf.data.TextLineDataset(files)
    ds = ds.shuffle(buffer_size=30, seed=2021)
    ds = ds.prefetch(8)
    ds = ds.batch(4)
    return ds.prefetch(1)


def interleaved(files: tf.data.Dataset) -> tf.data.Dataset:
    return files.interleave(tf.data.TextLineDataset, cycle_length=4).batch(4).prefetch(1)


# The pipeline's own read-ahead, in files: the lines its buffers hold (shuffle 30 + prefetch 8
# + a batch being built and a prefetched one, 8; tf.data may inject one more prefetch), spread
# over the file being read and the next ones; or the interleave width.
SEED_READ_AHEAD = 1 + math.ceil((30 + 8 + 8 + 4) / LINES_PER_FILE)
INTERLEAVE_READ_AHEAD = 4


@pytest.mark.parametrize("pipeline, read_ahead", [(seed_pipeline, SEED_READ_AHEAD),
                                                  (interleaved, INTERLEAVE_READ_AHEAD)],
                         ids=["seed_pipeline", "interleave4"])
@pytest.mark.parametrize("lease_ahead", [1, 3])
def test_lease_ahead_is_bounded(tmp_path: Path, lease_ahead: int, read_ahead: int,
                                pipeline: Callable[[tf.data.Dataset], tf.data.Dataset]) -> None:
    url = f"sqlite:///{tmp_path / 'wq.db'}"
    paths, lines = write_text_files(tmp_path / "data", [LINES_PER_FILE] * N_FILES)
    wq = WorkQueue(paths, url=url, worker="w", lease_ahead=lease_ahead)
    ds = pipeline(wq.input_dataset())
    it = iter(ds)
    assert states_of(url, "work_queue", "w") == {}  # nothing before the first step
    got = next(it).numpy().tolist()
    held = states_of(url, "work_queue", "w")
    assert set(held) <= {"claimed", "done"}
    assert 1 <= sum(held.values()) <= lease_ahead + read_ahead, held
    got += [line for batch in it for line in batch.numpy().tolist()]
    assert sorted(x.decode() for x in got) == sorted(lines)
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": N_FILES}
