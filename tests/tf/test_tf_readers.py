"""TensorFlow readers of sliced works: ``records_dataset`` (TF2) and ``TableRecordReader``
(TF1, DeepRec's table example), on SQLite and Postgres."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import tensorflow as tf

from wq_sql import InvalidInput
from wq_sql.tf import TableRecordReader, WorkQueue

v1 = tf.compat.v1


def make_events(url: str, n: int) -> list[tuple[int, str, float]]:
    rows = [(i, f"user {i} née", i / 4) for i in range(n)]
    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("CREATE TABLE events (id INTEGER PRIMARY KEY, name TEXT, score DOUBLE PRECISION)"))
        c.execute(sa.text("INSERT INTO events VALUES (:i, :n, :s)"),
                  [{"i": i, "n": name, "s": s} for i, name, s in rows])
    engine.dispose()
    return rows


def test_records_dataset_of_a_text_file_reads_every_line_once(db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    lines = [f"line {i} {'x' * (i % 50)}" for i in range(5000)]
    path.write_text("\n".join(lines))
    with WorkQueue([f"lines:{path}"], num_slices=16, url=db_url, lease_ahead=4) as wq:
        got = [x.decode() for x in wq.records_dataset().batch(256).unbatch().as_numpy_iterator()]
        assert wq.progress().done == 16
    assert sorted(got) == sorted(lines)


def test_records_dataset_of_a_table_has_typed_columns(db_url: str) -> None:
    rows = make_events(db_url, 3000)
    with WorkQueue(["table:events"], num_slices=9, url=db_url) as wq:
        ds = wq.records_dataset(columns=["id", "name", "score"])
        assert [s.dtype for s in ds.element_spec] == [tf.int64, tf.string, tf.float64]
        got = [(int(i), n.decode(), float(s)) for i, n, s in ds.as_numpy_iterator()]
    assert sorted(got) == rows


def test_records_dataset_refuses_plain_works(db_url: str, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a\n")
    with WorkQueue([str(tmp_path / "a.txt")], url=db_url) as wq:
        with pytest.raises(InvalidInput, match="TextLineDataset"):
            wq.records_dataset()


@pytest.fixture
def graph() -> Iterator[tf.Graph]:
    with tf.Graph().as_default() as g:
        yield g


def test_table_record_reader_in_a_monitored_session(db_url: str, graph: tf.Graph) -> None:
    rows = make_events(db_url, 500)
    work_queue = WorkQueue(["table:events"], shuffle=True, num_slices=7, url=db_url)
    reader = TableRecordReader(selected_cols="id,name")
    keys, values = reader.read_up_to(work_queue.input_producer(), num_records=2)
    got, got_keys = [], []
    with v1.train.MonitoredTrainingSession() as sess:
        while not sess.should_stop():
            k, v = sess.run([keys, values])
            assert len(v) <= 2
            got.extend(v.tolist())
            got_keys.extend(k.tolist())
    assert sorted(got) == sorted(f"{i},{n}".encode() for i, n, _ in rows)
    assert len(set(got_keys)) == len(got_keys) and all(b"?start=" in k for k in got_keys)
    work_queue.close()


def test_a_sqlite_table_read_by_two_queues_objects_of_one_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'wq.db'}"
    with sqlite3.connect(tmp_path / "wq.db") as db:
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        db.executemany("INSERT INTO t VALUES (?, ?)", [(i, str(i)) for i in range(100)])
    a = WorkQueue(["table:t"], num_slices=10, url=url, worker="a")
    b = WorkQueue(["table:t"], num_slices=10, url=url, worker="b")
    both = a.records_dataset().concatenate(b.records_dataset())
    assert sorted(int(i) for i, _ in both.as_numpy_iterator()) == list(range(100))
    a.close()
    b.close()
