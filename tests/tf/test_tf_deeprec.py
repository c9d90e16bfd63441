"""DeepRec's ``work_queue_test.py``, ported to ``wq_sql.tf``.

The single-process cases run in TF1 graph mode as DeepRec's did (``input_producer`` and a
``QueueRunner``, or an initializable iterator); ``test_multi_worker_dataset`` runs two real
worker processes on one queue, on SQLite and on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf
from tf_support import finish_worker, start_worker

from wq_sql.tf import WorkQueue

v1 = tf.compat.v1
WORKS = [b"to", b"be", b"or", b"not", b"to", b"be"]


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'wq.db'}"


@pytest.fixture
def graph() -> Iterator[tf.Graph]:
    with tf.Graph().as_default() as g:
        yield g


def run_producer(work_queue: WorkQueue, n: int) -> tuple[list[bytes], bool]:
    """DeepRec's pattern: ``dequeue_many(n)`` from ``input_producer()``, then one ``dequeue``
    that must raise OutOfRange. Returns the items and whether it did."""
    local_queue = work_queue.input_producer()
    dequeue = local_queue.dequeue()
    dequeue_many = local_queue.dequeue_many(n)
    with v1.Session() as sess:
        v1.global_variables_initializer().run()
        v1.local_variables_initializer().run()
        threads = v1.train.start_queue_runners(sess)
        local_works = sess.run(dequeue_many).tolist()
        try:
            sess.run(dequeue)
            out_of_range = False
        except tf.errors.OutOfRangeError:
            out_of_range = True
        for thread in threads:
            thread.join(timeout=30)
            assert not thread.is_alive()
    assert [len(w) for w in local_works] == [1] * n  # DeepRec's elements have shape [1]
    return [item for work in local_works for item in work], out_of_range


def test_simple(graph: tf.Graph, sqlite_url: str) -> None:
    num_epochs = 3
    work_queue = WorkQueue(WORKS, num_epochs=num_epochs, shuffle=False, url=sqlite_url, worker="w")
    got, out_of_range = run_producer(work_queue, len(WORKS) * num_epochs)
    assert got == WORKS * num_epochs
    assert out_of_range


def test_shuffle(graph: tf.Graph, sqlite_url: str) -> None:
    num_epochs = 3
    work_queue = WorkQueue(WORKS, num_epochs=num_epochs, shuffle=True, seed=5, url=sqlite_url,
                           worker="w")
    got, out_of_range = run_producer(work_queue, len(WORKS) * num_epochs)
    assert sorted(got) == sorted(WORKS * num_epochs)
    for e in range(num_epochs):  # each epoch is a permutation of the works
        assert sorted(got[e * len(WORKS):(e + 1) * len(WORKS)]) == sorted(WORKS)
    assert got != WORKS * num_epochs
    assert out_of_range


def test_slices(graph: tf.Graph, sqlite_url: str) -> None:
    # Paths cannot be counted, so num_slices leaves them whole (DeepRec: "num_slices is invalid
    # when reading files").
    works = [b"hdfs://path/to/my/file", b"hdfs://prj/tables/tbl1", b"hdfs://prj/tables/tbl1/pt=12",
             b"hdfs://prj/tables/tbl1/pt=12/pt1=abc"]
    work_queue = WorkQueue(works, num_epochs=1, shuffle=False, num_slices=5, url=sqlite_url,
                           worker="w")
    got, out_of_range = run_producer(work_queue, len(works))
    assert got == works
    assert out_of_range


def test_simple_dataset(graph: tf.Graph, sqlite_url: str) -> None:
    num_epochs = 3
    work_queue = WorkQueue(WORKS, num_epochs=num_epochs, shuffle=False, url=sqlite_url, worker="w")
    dataset = work_queue.input_dataset()
    iterator = v1.data.make_initializable_iterator(dataset)
    data = iterator.get_next()
    with v1.Session() as sess:
        sess.run(iterator.initializer)
        local_works = [sess.run(data) for _ in range(len(WORKS) * num_epochs)]
        assert local_works == WORKS * num_epochs
        with pytest.raises(tf.errors.OutOfRangeError):
            sess.run(data)
        sess.run(iterator.initializer)  # a new pass over an exhausted queue ends at once
        with pytest.raises(tf.errors.OutOfRangeError):
            sess.run(data)


def test_multi_worker_dataset(db_url: str, tmp_path: Path) -> None:
    works = ["fast", "fox", "jumps", "over", "lazy", "dog"]
    num_epochs = 3
    job = {"mode": "multi_worker_dataset", "works": works, "num_epochs": num_epochs, "url": db_url,
           "barrier": str(tmp_path), "n_workers": 2, "pause": 0.05}
    procs = [start_worker({**job, "worker": f"worker:{i}"}) for i in range(2)]
    reports = [finish_worker(p) for p in procs]
    result = [w for r in reports for w in r["result"]]
    assert sorted(result) == sorted(works * num_epochs)
    # Both worked (the barrier and the pause make them overlap), and both ended with
    # OutOfRange, and again on the next run.
    assert all(r["result"] for r in reports), [len(r["result"]) for r in reports]
    assert [r["out_of_range"] for r in reports] == [2, 2]
