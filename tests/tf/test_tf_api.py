"""The shim's own contract: tensors and ops from take(), exhaustion as OutOfRangeError (never an
empty string), dataset options, summaries, TensorFlow's threads, and a Reader loop in a
MonitoredTrainingSession. Single process, SQLite."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf
from tf_support import ENV, write_text_files

import wq_sql
from wq_sql.tf import WorkQueue

v1 = tf.compat.v1
WORKS = ["to", "be", "or", "not", "to", "be"]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'wq.db'}"


@pytest.fixture
def graph() -> Iterator[tf.Graph]:
    with tf.Graph().as_default() as g:
        yield g


def test_import_wq_sql_does_not_import_tensorflow() -> None:
    code = "import sys, wq_sql; assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=60)


def test_same_constructor_as_the_core(url: str) -> None:
    wq = WorkQueue(WORKS, 2, False, 3, "p/", None, "q", url=url, worker="w", lease_ahead=2)
    assert isinstance(wq.queue, wq_sql.WorkQueue)
    assert (wq.name, wq.worker, wq.num_epochs, len(wq), wq.lease_ahead) == ("q", "w", 2, 6, 2)
    assert wq.take().numpy() == b"p/to"
    joined = WorkQueue.attach("q", url=url, worker="w2")
    assert joined.take().numpy() == b"p/or"  # "p/be" is leased ahead by the first worker
    with pytest.raises(wq_sql.QueueConfigMismatch):
        WorkQueue(WORKS, 3, name="q", url=url, worker="w3")
    # max_attempts reaches the core unchanged: not given joins, another value is refused.
    assert joined.queue.max_attempts == 3
    with pytest.raises(wq_sql.QueueConfigMismatch, match="max_attempts: stored 3, given 5"):
        WorkQueue(WORKS, 2, False, 3, "p/", None, "q", url=url, worker="w4", max_attempts=5)


def test_eager_take_is_a_scalar_string_then_out_of_range(url: str) -> None:
    wq = WorkQueue(WORKS, num_epochs=2, shuffle=False, url=url, worker="w")
    got = []
    for _ in range(12):
        t = wq.take()
        assert isinstance(t, tf.Tensor) and t.dtype == tf.string and t.shape == ()
        got.append(t.numpy().decode())
    assert got == WORKS * 2
    for _ in range(2):  # every later call too, never an empty string
        with pytest.raises(tf.errors.OutOfRangeError, match="exhausted"):
            wq.take()
    assert wq.taken == 12


def test_graph_take_is_an_op_that_takes_each_run(graph: tf.Graph, url: str) -> None:
    wq = WorkQueue(WORKS, shuffle=False, url=url, worker="w")
    take = wq.take()
    assert isinstance(take, tf.Tensor) and take.dtype == tf.string and take.shape == ()
    with v1.Session() as sess:
        assert [sess.run(take) for _ in WORKS] == [w.encode() for w in WORKS]
        for _ in range(2):
            with pytest.raises(tf.errors.OutOfRangeError):
                sess.run(take)


def test_take_inside_tf_function(url: str) -> None:
    wq = WorkQueue(WORKS, shuffle=False, url=url, worker="w")

    @tf.function
    def two() -> tf.Tensor:
        return tf.strings.join([wq.take(), wq.take()], separator="+")

    assert [two().numpy() for _ in range(3)] == [b"to+be", b"or+not", b"to+be"]
    with pytest.raises(tf.errors.OutOfRangeError):
        two()


def test_input_dataset_is_lazy_scalar_strings_with_auto_shard_off(url: str) -> None:
    wq = WorkQueue(WORKS, num_epochs=2, shuffle=False, url=url, worker="w")
    ds = wq.input_dataset()
    assert ds.element_spec == tf.TensorSpec((), tf.string)
    off = tf.data.experimental.AutoShardPolicy.OFF
    assert ds.options().experimental_distribute.auto_shard_policy == off
    # The option survives the pipelines built on top of it.
    assert tf.data.TextLineDataset(ds).batch(2).options().experimental_distribute.auto_shard_policy == off
    assert wq.progress().done == 0 and wq.taken == 0  # building a pipeline claims nothing
    # tf.data injects a prefetch after a pipeline's last synchronous step, which would take one
    # item ahead here; without it, each element pulled is exactly one item taken.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    it = iter(ds.with_options(options))
    assert wq.taken == 0
    assert next(it).numpy() == b"to"
    assert wq.taken == 1
    assert next(it).numpy() == b"be"
    assert wq.taken == 2
    assert [x.numpy().decode() for x in it] == (WORKS * 2)[2:]
    assert list(ds) == []  # a new pass over an exhausted queue is empty
    with pytest.raises(tf.errors.OutOfRangeError):
        iter(ds).get_next()


def test_concurrent_takers_get_every_item_once(url: str) -> None:
    works = [f"w{i}" for i in range(40)]
    wq = WorkQueue(works, num_epochs=2, url=url, worker="w", lease_ahead=3)
    # Four generators pulled by tf.data's own threads, plus two Python threads calling take().
    ds = tf.data.Dataset.range(4).interleave(lambda _: wq.input_dataset(), cycle_length=4,
                                             num_parallel_calls=4)
    from_threads: list[bytes] = []
    errors: list[BaseException] = []

    def taker() -> None:
        try:
            while True:
                from_threads.append(wq.take().numpy())
                time.sleep(0.001)
        except tf.errors.OutOfRangeError:
            pass
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=taker) for _ in range(2)]
    for t in threads:
        t.start()
    from_dataset = [x.numpy() for x in ds]
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    got = from_dataset + from_threads
    assert b"" not in got
    assert sorted(got) == sorted(w.encode() for w in works * 2)
    assert wq.taken == 80


def test_input_producer_needs_graph_mode(url: str) -> None:
    wq = WorkQueue(WORKS, url=url, worker="w")
    with pytest.raises(RuntimeError, match="graph mode"):
        wq.input_producer()
    assert wq.taken == 0


def test_input_producer_registers_a_queue_runner(graph: tf.Graph, url: str) -> None:
    wq = WorkQueue(WORKS, url=url, worker="w")
    proxy = wq.input_producer()
    runners = v1.get_collection(v1.GraphKeys.QUEUE_RUNNERS)
    assert len(runners) == 1 and runners[0].queue is proxy
    assert proxy.dtypes == [tf.string] and proxy.shapes == [tf.TensorShape([1])]
    assert wq.taken == 0  # nothing runs before a session starts the runner


def test_reader_in_monitored_session_reads_every_line_once(graph: tf.Graph, url: str,
                                                           tmp_path: Path) -> None:
    paths, lines = write_text_files(tmp_path / "data", [3, 0, 5, 1, 8])
    wq = WorkQueue(paths, num_epochs=2, url=url, worker="w")
    reader = v1.TextLineReader()
    _, values = reader.read_up_to(wq.input_producer(), num_records=2)
    records, steps = [], 0
    with v1.train.MonitoredTrainingSession() as sess:
        while not sess.should_stop():
            records.extend(v.decode() for v in sess.run(values))
            steps += 1
            assert steps < 100
    # The loop ended normally (OutOfRange swallowed by the session) after every line, twice.
    assert sorted(records) == sorted(lines * 2)
    assert wq.progress().done == len(paths) * 2


def test_closing_the_session_ends_a_take_waiting_for_other_workers(
        graph: tf.Graph, url: str) -> None:
    """The cancel wakes the waiting take (no time slice: ``WorkQueue.wake``)."""
    other = wq_sql.WorkQueue(["a", "b"], shuffle=False, url=url, worker="other")
    wq = WorkQueue(["a", "b"], shuffle=False, url=url, worker="w")
    assert other.take() == "a"
    dequeue = wq.input_producer().dequeue()
    with v1.Session() as sess:
        coord = v1.train.Coordinator()
        threads = v1.train.start_queue_runners(sess, coord=coord)
        assert sess.run(dequeue).tolist() == [b"b"]
        time.sleep(0.5)  # the runner now waits for "a", which the other worker holds
        started = time.monotonic()
        coord.request_stop()
        coord.join(threads, stop_grace_period_secs=10)  # raises if a thread is still running
        assert time.monotonic() - started < 5
    other.close()


def test_add_summary_in_a_graph(graph: tf.Graph, url: str) -> None:
    wq = WorkQueue(WORKS, num_epochs=3, shuffle=False, url=url, worker="w")
    take = wq.take()
    wq.add_summary()
    merged = v1.summary.merge_all()
    with v1.Session() as sess:
        for _ in range(8):
            sess.run(take)
        summary = v1.Summary.FromString(sess.run(merged))
    values = {v.tag: v.simple_value for v in summary.value}
    # 8 taken: 7 done (the 8th is done when the next is taken), 18 - 7 remaining over 6.
    assert values == pytest.approx({"work_queue/fraction_of_6_full": 11 / 6, "work_queue/done": 7.0,
                                    "work_queue/epoch": 1.0, "work_queue/taken_by_this_worker": 8.0})


def read_scalars(logdir: Path) -> dict[tuple[str, int], float]:
    out = {}
    for path in logdir.glob("events.out.tfevents.*"):
        for event in v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                out[(v.tag, event.step)] = float(tf.make_ndarray(v.tensor))
    return out


def test_add_summary_eager_and_in_tf_function(url: str, tmp_path: Path) -> None:
    wq = WorkQueue(WORKS, num_epochs=2, shuffle=False, url=url, worker="w", name="q")
    writer = tf.summary.create_file_writer(str(tmp_path / "logs"))
    with writer.as_default():
        wq.add_summary(step=0)  # before any take
        for _ in range(7):
            wq.take()
        wq.add_summary(step=7)

        @tf.function
        def record() -> None:
            wq.add_summary(step=tf.constant(9, tf.int64))

        wq.take()
        wq.take()
        record()
    writer.flush()
    got = read_scalars(tmp_path / "logs")
    assert got == pytest.approx({
        ("q/fraction_of_6_full", 0): 2.0, ("q/done", 0): 0.0, ("q/epoch", 0): 0.0,
        ("q/taken_by_this_worker", 0): 0.0,
        ("q/fraction_of_6_full", 7): 6 / 6, ("q/done", 7): 6.0, ("q/epoch", 7): 1.0,
        ("q/taken_by_this_worker", 7): 7.0,
        ("q/fraction_of_6_full", 9): 4 / 6, ("q/done", 9): 8.0, ("q/epoch", 9): 1.0,
        ("q/taken_by_this_worker", 9): 9.0,
    })
