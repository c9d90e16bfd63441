"""The TensorFlow examples run as users run them (a subprocess each), on SQLite by default and on
PostgreSQL through ``$WQ_SQL_URL``; their printed output is checked, so they cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from example_support import assert_left_nothing, tables_in, user_url
from tf_support import ENV, ROOT


def run_example(name: str, tmp_path: Path, backend: str = "sqlite", db_url: str = "",
                timeout: float = 180) -> list[str]:
    """Run an example: on its default SQLite file, or with ``$WQ_SQL_URL`` naming the test's
    Postgres database, where it must leave no queue and no table behind."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in ENV.items() if k != "WQ_SQL_URL"} | {"TMPDIR": str(tmp)}
    if backend == "postgresql":
        env["WQ_SQL_URL"] = user_url(db_url)
        tables = tables_in(db_url)
    p = subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=cwd)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout}\n{p.stderr[-5000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-5000:]
    assert not list(cwd.iterdir()), "examples keep their files in a temp dir"
    if backend == "postgresql":
        assert_left_nothing(db_url, tables)
    else:
        assert list(tmp.rglob("*.db")), "the example's default: a SQLite file in a temp dir"
    return p.stdout.splitlines()


def test_tf_dataset(backend: str, db_url: str, tmp_path: Path) -> None:
    assert run_example("tf_dataset.py", tmp_path, backend, db_url) == [
        "batches: 13",
        "lines: 100",
        "every line exactly once: True",
        "items done: 4 of 4",
    ]


def test_tf_reader(backend: str, db_url: str, tmp_path: Path) -> None:
    assert run_example("tf_reader.py", tmp_path, backend, db_url) == [
        "records: 18",
        "every line exactly once: True",
        "summaries: work_queue/done, work_queue/epoch, work_queue/fraction_of_3_full, "
        "work_queue/taken_by_this_worker",
    ]


def test_tf_table_reader(backend: str, db_url: str, tmp_path: Path) -> None:
    assert run_example("tf_table_reader.py", tmp_path, backend, db_url) == [
        "items per epoch: 10",
        "records: 1000",
        "every row exactly once: True",
    ]


def test_tf_keras_fit(backend: str, db_url: str, tmp_path: Path) -> None:
    assert run_example("tf_keras_fit.py", tmp_path, backend, db_url) == [
        "Keras epoch 0: 6 items",
        "Keras epoch 1: 6 items",
        "steps: 24",
        "items done: 12 of 12",
        "loss went down: True",
        "accuracy on new points above 0.9: True",
    ]


def test_tf_checkpoint_resume(backend: str, db_url: str, tmp_path: Path) -> None:
    out = run_example("tf_checkpoint_resume.py", tmp_path, backend, db_url)
    assert out[:3] == [
        "first run: killed by SIGKILL at step 13: True",
        "second run: restored ckpt-10",
        "records: 120, every record trained at least once: True",
    ], out
    # Exactly once but for hand-outs that overlapped the save (counted by wq_sql, usually none).
    assert out[3].startswith("records trained more than once: ") and out[3].endswith(": True"), out
    exact = out[3].startswith("records trained more than once: 0,")
    assert out[4] == f"every record trained exactly once: {exact}", out
    assert out[5:] == ["items done: 12 of 12"], out


# DeepRec's documented examples (docs/docs_en/WorkQueue.md), import line excluded.
DEEPREC_DATASET = """
work_queue = WorkQueue([filename, filename1,filename2,filename3])
f_data = work_queue.input_dataset()
dataset = tf.data.TextLineDataset(f_data)
dataset = dataset.shuffle(buffer_size=20000, seed=2021) # fix seed for reproducing
dataset = dataset.repeat(num_epochs)
dataset = dataset.prefetch(batch_size)
dataset = dataset.batch(batch_size)
dataset = dataset.prefetch(1)
"""
DEEPREC_READER = """
work_queue = WorkQueue([path1, path2, path3], shuffle=True)
work_queue.add_summary()
reader = tf.TextLineReader()
keys, values = reader.read_up_to(work_queue.input_producer(), num_records=2)
with tf.train.MonitoredTrainingSession() as sess:
"""


def code_lines(text: str) -> list[str]:
    """Lines without comments and whitespace."""
    out = ["".join(line.split("#")[0].split()) for line in text.splitlines()]
    return [line for line in out if line]


@pytest.mark.parametrize("name, deeprec", [("tf_dataset.py", DEEPREC_DATASET),
                                           ("tf_reader.py", DEEPREC_READER)])
def test_examples_are_deeprecs_but_for_the_import(name: str, deeprec: str) -> None:
    text = (ROOT / "examples" / name).read_text()
    assert "# from tensorflow.python.ops.work_queue import WorkQueue\nfrom wq_sql.tf import WorkQueue" in text
    ours, theirs = code_lines(text), code_lines(deeprec)
    start = ours.index(theirs[0])
    assert ours[start:start + len(theirs)] == theirs


def test_tf_multi_worker(backend: str, db_url: str, tmp_path: Path) -> None:
    """Three worker processes on one queue."""
    out = run_example("tf_multi_worker.py", tmp_path, backend, db_url, timeout=300)
    workers = [line.split() for line in out[:3]]
    assert [w[0] for w in workers] == ["worker:0", "worker:1", "worker:2"]
    assert sum(int(w[2]) for w in workers) == 48  # 24 files x 2 epochs, each file to one worker
    assert out[3:] == ["files: 24 x 2 epochs, lines read: 612",
                       "every line exactly once per epoch: True",
                       "every item done exactly once (wq_history): True"]
