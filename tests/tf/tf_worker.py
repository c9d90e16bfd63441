"""One worker process of the multi-worker tests: ``python tf_worker.py '<job as JSON>'``.

Prints one JSON line: what this worker read, and whether its pipeline ended with OutOfRange.
Workers wait for each other at a file barrier before reading, so that they really overlap.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def barrier(directory: str, me: str, n: int, timeout: float = 120, stage: str = "ready") -> None:
    Path(directory, f"{stage}-{me}").touch()
    deadline = time.monotonic() + timeout
    while len(list(Path(directory).glob(f"{stage}-*"))) < n:
        if time.monotonic() > deadline:
            raise SystemExit("barrier timed out")
        time.sleep(0.05)


def multi_worker_dataset(job: dict[str, Any]) -> dict[str, Any]:
    """DeepRec's test_multi_worker_dataset, one worker: TF1 graph, MonitoredTrainingSession."""
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    v1 = tf.compat.v1
    result, out_of_range = [], 0
    with tf.Graph().as_default():
        work_queue = WorkQueue(job["works"], num_epochs=job["num_epochs"], shuffle=True,
                               name="global_queue", url=job["url"], worker=job["worker"])
        dataset = work_queue.input_dataset()
        iterator = v1.data.make_initializable_iterator(dataset)
        v1.add_to_collection(v1.GraphKeys.TABLE_INITIALIZERS, iterator.initializer)
        data = iterator.get_next()
        barrier(job["barrier"], job["worker"], job["n_workers"])
        with v1.train.MonitoredTrainingSession(is_chief=job["worker"] == "worker:0") as sess:
            while True:
                try:
                    result.append(sess.run(data).decode())
                except tf.errors.OutOfRangeError:
                    out_of_range += 1
                    break
                time.sleep(job["pause"])
            try:
                sess.run(data)
            except tf.errors.OutOfRangeError:
                out_of_range += 1
    return {"result": result, "out_of_range": out_of_range}


def text_lines(job: dict[str, Any]) -> dict[str, Any]:
    """TF2 eager: every line of TextLineDataset(wq.input_dataset()), in batches."""
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    work_queue = WorkQueue(job["files"], num_epochs=1, shuffle=True, name="text_files",
                           url=job["url"], worker=job["worker"])
    dataset = tf.data.TextLineDataset(work_queue.input_dataset()).batch(5).prefetch(1)
    barrier(job["barrier"], job["worker"], job["n_workers"])
    lines: list[str] = []
    # Both workers also meet after their first batch (or at an end without one): a worker whose
    # first steps run late on a busy machine (TF's first iteration) still finds the items the
    # other's first hand-outs left, so the check that both take a share cannot fail by timing.
    met = False
    for batch in dataset:
        lines.extend(x.decode("utf-8") for x in batch.numpy().tolist())
        if not met:
            barrier(job["barrier"], job["worker"], job["n_workers"], stage="first")
            met = True
        time.sleep(job["pause"])
    if not met:
        barrier(job["barrier"], job["worker"], job["n_workers"], stage="first")
    iterator = iter(dataset)
    try:
        iterator.get_next()
        ended = False
    except tf.errors.OutOfRangeError:
        ended = True
    work_queue.close()
    return {"lines": lines, "ended_again": ended, "taken": work_queue.taken}


def mirrored(job: dict[str, Any]) -> dict[str, Any]:
    """One worker of a MultiWorkerMirroredStrategy custom training loop over a shared queue: items
    of 1 to 3 elements, so workers end with uneven data; each step all-reduces the number of
    elements every worker fed it."""
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"localhost:{p}" for p in job["ports"]]},
        "task": {"type": "worker", "index": job["index"]}})
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # No synchronous= flag: the queue sees the multi-worker job in $TF_CONFIG and ends its data
    # the synchronous way by itself (wq_sql.tf.synchronous_training).
    work_queue = WorkQueue(job["works"], name="mirrored", url=job["url"], worker=f"worker:{job['index']}")
    assert work_queue.synchronous

    def elements(work: tf.Tensor) -> tf.data.Dataset:
        n = tf.strings.to_number(tf.strings.substr(work, 1, 9), tf.int64) % 3 + 1
        return tf.data.Dataset.range(n)

    dataset = work_queue.input_dataset().flat_map(elements).batch(2 * len(job["ports"]))
    dist = strategy.experimental_distribute_dataset(dataset)

    @tf.function
    def step(batch: tf.Tensor) -> Any:
        def count(x: tf.Tensor) -> tf.Tensor:
            n = tf.cast(tf.size(x), tf.float32)
            return tf.distribute.get_replica_context().all_reduce("sum", n)
        return strategy.run(count, (batch,))

    steps, elements_seen, local = 0, 0.0, 0
    for batch in dist:  # the distributed iterator agrees on the end across workers
        local += int(tf.size(strategy.experimental_local_results(batch)[0]))
        elements_seen += float(strategy.experimental_local_results(step(batch))[0])
        steps += 1
        time.sleep(job["pause"] if job["index"] == 0 else 0)
    taken = work_queue.taken
    work_queue.close()
    return {"steps": steps, "all_reduced": elements_seen, "local": local, "taken": taken}


def tiny(job: dict[str, Any]) -> dict[str, Any]:
    """The simplest TF pipeline, as issue 13 ran it: six words, three shuffled epochs, every item
    printed as the pipeline yields it."""
    import tensorflow as tf  # noqa: F401  (TensorFlow before the barrier: both start together)

    from wq_sql.tf import WorkQueue

    barrier(job["barrier"], job["worker"], job["n_workers"])
    wq = WorkQueue([b"fast", b"fox", b"jumps", b"over", b"lazy", b"dog"], num_epochs=3, shuffle=True,
                   name=job["name"], url=job["url"], worker=job["worker"])
    got = []
    for x in wq.input_dataset():
        got.append(x.numpy().decode())
        print(got[-1], flush=True)
    wq.close()
    return {"got": got}


def lineage(job: dict[str, Any]) -> dict[str, Any]:
    """TF2 eager custom loop over ``wq.batches(TextLineDataset, ...)`` with lineage on: every
    batch the loop receives, logged as its step's records, and the loop's own wait in ``next``."""
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    wq = WorkQueue(job["files"], num_epochs=job["num_epochs"], name=job["queue"], url=job["url"],
                   worker=job["worker"], lineage=True)
    ds = wq.batches(tf.data.TextLineDataset, job["batch_size"], interleave=job.get("interleave", 1))
    barrier(job["barrier"], job["worker"], job["n_workers"])
    steps: list[list[str]] = []
    it = iter(ds)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            break
        steps.append([x.decode("utf-8") for x in batch.numpy().tolist()])
        time.sleep(job["pause"])
    wq.close()
    return {"steps": steps}


if __name__ == "__main__":
    # A worker still running after this long is hung: its Python stacks go to stderr, which the
    # test's failure message shows.
    faulthandler.dump_traceback_later(float(os.environ.get("WQ_SQL_TEST_HANG_DUMP", "100")), exit=False)
    job = json.loads(sys.argv[1])
    modes = {"multi_worker_dataset": multi_worker_dataset, "text_lines": text_lines, "mirrored": mirrored,
             "tiny": tiny, "lineage": lineage}
    report = modes[job["mode"]](job)
    print(json.dumps(report))
