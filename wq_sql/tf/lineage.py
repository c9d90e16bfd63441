"""The TensorFlow shim's training batches with lineage and the input wait
(:meth:`wq_sql.tf.WorkQueue.batches`), and their replay (:func:`replay_dataset`).

A record carries its item's id and its position in the item through the pipeline (two
``int64`` tensors beside it, made a chunk of an item's records at a time); the last stage takes
them off, numbers the batch (the rank's step) and turns them into ``wq_steps`` rows (one per
run of consecutive records of one item), in TensorFlow ops and variables (:class:`StepLog`);
every few dozen batches or every second one ``numpy_function`` call queues the rows on the core
queue, whose next write (a claim round, which acknowledges the items handed out before, or the
close) carries them in its transaction. Before pulling a batch the pipeline reads a clock
(``tf.timestamp``; a ``zip`` pulls its inputs in order); the time from that to the batch
arriving is the training loop's wait inside the iterator's ``get_next``, added to the rank's
input-wait total (see decision 0010)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import tensorflow as tf

from wq_sql.admin import replay_steps
from wq_sql.errors import InvalidInput
from wq_sql.store.engine import resolve_url
from wq_sql.store.lineage import Steps

if TYPE_CHECKING:
    from wq_sql.queue import WorkQueue as CoreQueue

Reader = Callable[[tf.Tensor], tf.data.Dataset]
_NO_END = 2**62  # a range's end that no item's record count reaches
CHUNK = 4096  # records of an item tagged at once (one call per chunk), then rebatched


class StepLog:
    """The batches a queue object's :meth:`~wq_sql.tf.WorkQueue.batches` datasets made: their
    step numbers (0, 1, ... over every pass and dataset of the object, from ``first_step``), the
    lineage rows queued with the core queue (``lineage``), and the input wait.

    Kept in TensorFlow variables by the pipeline's last stage (TensorFlow ops only: a Python
    call per batch from tf.data's threads waits for the interpreter's lock, which the training
    loop's thread holds), and handed to Python every ``FLUSH_BATCHES`` batches or ``FLUSH_SECONDS``
    (one ``numpy_function`` call), and at :meth:`drain` (the queue's close, a new run)."""

    FLUSH_BATCHES = 64
    FLUSH_SECONDS = 1.0

    def __init__(self, queue: CoreQueue, lineage: bool) -> None:
        self.queue, self.lineage = queue, lineage
        self._run: Optional[int] = None
        self._sent_wait = 0.0
        self._lock = threading.Lock()
        with tf.init_scope():  # eagerly, also when the first batches() call is inside a function
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="wq_sql_step")
            self.wait = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="wq_sql_input_wait")
            self.rows = tf.Variable(tf.zeros([0, 5], tf.int64), shape=tf.TensorShape([None, 5]),
                                    trainable=False, name="wq_sql_lineage_rows")
            self.flushed_at = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="wq_sql_flushed_at")

    def record(self, asked: tf.Tensor, ids: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
        """TensorFlow ops, in the pipeline's last stage: one batch reached the training loop,
        which asked for it at ``asked`` (``tf.timestamp``); ``ids``, ``positions``: its records'
        items and places in them. Returns the batch's step."""
        now = tf.timestamp()
        wait = self.wait.assign_add(now - asked)
        step = self.step.assign_add(1) - 1
        rows = self.rows
        if self.lineage:
            rows = self.rows.assign(tf.concat([self.rows, step_rows_tf(step, ids, positions)], 0))
        due = tf.logical_or(tf.equal((step + 1) % self.FLUSH_BATCHES, 0),
                            now - self.flushed_at >= self.FLUSH_SECONDS)

        def flush() -> tf.Tensor:
            sent = tf.numpy_function(self._take, [rows, wait], tf.int64, stateful=True, name="lineage")
            with tf.control_dependencies([sent]):
                return tf.group(self.rows.assign(tf.zeros([0, 5], tf.int64)), self.flushed_at.assign(now))

        done = tf.cond(due, flush, tf.no_op)
        with tf.control_dependencies([done]):
            return tf.identity(step)

    def _take(self, rows: np.ndarray, wait: np.float64) -> np.int64:
        """The rows and wait total the pipeline kept since the last call: to the core queue."""
        with self._lock:
            self.queue.add_input_wait(max(0.0, float(wait) - self._sent_wait))
            self._sent_wait = float(wait)
            if len(rows):
                if self._run is None:
                    self._run = self.queue.next_lineage_run()
                self.queue.queue_steps(Steps(self.queue.worker, self._run, [tuple(r) for r in rows.tolist()]))
        return np.int64(len(rows))

    def drain(self) -> None:
        """Hand what the variables hold to the core queue now (call it while no batch is being
        made: at the close, before a new run)."""
        rows = self.rows.numpy()
        self.rows.assign(tf.zeros([0, 5], tf.int64))
        self._take(rows, np.float64(self.wait.numpy()))

    def restart(self, first_step: int) -> None:
        """Number the next batch ``first_step``, in a new run (a restored model's steps)."""
        self.drain()
        with self._lock:
            self._run = None
        self.step.assign(first_step)


def step_rows_tf(step: tf.Tensor, ids: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
    """A batch's ``wq_steps`` rows, in batch order, one per run of consecutive records of one
    item, ``(step, part, item id, first record, last record)``: an ``int64`` tensor ``[rows, 5]``."""
    n = tf.size(ids, out_type=tf.int64)
    cut = tf.logical_or(tf.not_equal(ids[1:], ids[:-1]), tf.not_equal(positions[1:], positions[:-1] + 1))
    starts = tf.concat([tf.zeros([1], tf.int64), tf.where(cut)[:, 0] + 1], 0)
    ends = tf.concat([starts[1:], tf.reshape(n, [1])], 0) - 1
    parts = tf.range(tf.size(starts, out_type=tf.int64), dtype=tf.int64)
    return tf.stack([tf.fill(tf.shape(starts), step), parts, tf.gather(ids, starts),
                     tf.gather(positions, starts), tf.gather(positions, ends)], axis=1)


def _tags(chunk: Any, item_id: tf.Tensor, first: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The item ids and positions of the records of ``chunk`` (its first at position ``first``)."""
    n = tf.shape(tf.nest.flatten(chunk)[0], out_type=tf.int64)[0]
    return tf.fill([n], item_id), tf.range(first, first + n, dtype=tf.int64)


def _mapped(map_fn: Optional[Callable[..., Any]], record: Any) -> Any:
    """``map_fn`` called on a record as ``Dataset.map`` would call it (a tuple spread)."""
    if map_fn is None:
        return record
    return map_fn(*record) if isinstance(record, tuple) else map_fn(record)


def check_reader(read: Any, map_fn: Any) -> None:
    if not callable(read):
        raise InvalidInput(f"read must be a function work -> tf.data.Dataset of its records, e.g. "
                           f"tf.data.TextLineDataset, got {read!r}")
    if map_fn is not None and not callable(map_fn):
        raise InvalidInput(f"map_fn must be a function record -> features, or None, got {map_fn!r}")


def batches(items: tf.data.Dataset, log: StepLog, read: Reader, batch_size: int, *,
            map_fn: Optional[Callable[..., Any]], drop_remainder: bool, interleave: int,
            num_parallel_calls: Optional[int], prefetch: Optional[int]) -> tf.data.Dataset:
    """The training batches of ``items`` (a dataset of ``(work, item id)``): see
    :meth:`wq_sql.tf.WorkQueue.batches`."""
    check_reader(read, map_fn)
    for name, value, least in (("batch_size", batch_size, 1), ("interleave", interleave, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidInput(f"{name} must be a whole number >= {least}, got {value!r}")

    chunk = max(batch_size, CHUNK)

    @tf.autograph.experimental.do_not_convert
    def records(work: tf.Tensor, item_id: tf.Tensor) -> tf.data.Dataset:
        # The item's records a chunk at a time, beside its id and each chunk's first position:
        # datasets without functions of their own, so nothing is instantiated per item.
        ids = tf.data.Dataset.from_tensors(item_id).repeat()
        firsts = tf.data.Dataset.range(0, _NO_END, chunk)
        return tf.data.Dataset.zip((read(work).batch(chunk), ids, firsts))

    if interleave == 1:
        chunks = items.flat_map(records)
    else:
        chunks = items.interleave(records, cycle_length=interleave, num_parallel_calls=interleave,
                                  deterministic=True)
    # Tagged a chunk at a time: its records, their item ids, their positions in the item.
    chunks = chunks.map(lambda chunk, item_id, first: (chunk, *_tags(chunk, item_id, first)))
    if map_fn is None:
        made = chunks.rebatch(batch_size, drop_remainder=drop_remainder)
    else:
        parallel = {} if num_parallel_calls is None else {"num_parallel_calls": num_parallel_calls,
                                                          "deterministic": True}
        recs = chunks.unbatch().map(
            lambda record, item_id, position: (_mapped(map_fn, record), item_id, position), **parallel)
        made = recs.batch(batch_size, drop_remainder=drop_remainder)
    if prefetch:
        made = made.prefetch(prefetch)

    @tf.autograph.experimental.do_not_convert
    def now(_: tf.Tensor) -> tf.Tensor:
        return tf.timestamp()  # a TensorFlow op: no Python call per batch for the clock

    @tf.autograph.experimental.do_not_convert
    def handed(asked: tf.Tensor, batch: Any) -> Any:
        data, ids, positions = batch
        step = log.record(asked, ids, positions)
        with tf.control_dependencies([step]):
            return tf.nest.map_structure(tf.identity, data)

    # zip pulls the clock, then the batch: the time between is the loop's wait for the batch.
    clock = tf.data.Dataset.from_tensors(0).repeat().map(now)
    out = tf.data.Dataset.zip((clock, made)).map(handed)
    options = tf.data.Options()
    # Nothing between this stage and the training loop: a prefetch there would make the clock
    # read the pipeline's wait, not the loop's (and number batches the loop has not asked for).
    options.experimental_optimization.inject_prefetch = False
    # The step log's variables are state outside the iterator, like the take's (saving an
    # iterator of this pipeline would fail on them): the queue and its rows stand for it.
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return out.with_options(options)


def replay_dataset(name: str, *, worker: str, steps: range, read: Reader,
                   map_fn: Optional[Callable[..., Any]] = None, url: Any = None, run: Optional[int] = None,
                   schema: Optional[str] = None) -> tf.data.Dataset:
    """The batches that rank ``worker`` trained on at ``steps`` (a ``range`` of its step numbers,
    as ``wq-sql trace`` prints them), in step order, record for record, read again from the
    queue's lineage (the run used :meth:`wq_sql.tf.WorkQueue.batches` with ``lineage=True``)::

        replay = replay_dataset("train", url=url, worker="job-7/rank1", steps=range(41_220, 41_240),
                                read=tf.data.TextLineDataset, map_fn=parse)
        for batch in replay:             # the batches of steps 41,220 .. 41,239 of rank 1
            loss = model(batch)

    ``read`` and ``map_fn``: the run's (the reader must yield the same records for an item as
    in the run, in the same order). It claims nothing and writes nothing: the queue's state is
    untouched, so it may run beside the job. Each step is the rank's latest run that recorded
    it (``run``: that run). A step of the range with no lineage, an unknown worker or run, or a
    queue without lineage raises :class:`~wq_sql.InvalidInput` saying what was recorded; a
    reader that yields fewer records than a step trained fails the iteration with
    ``InvalidArgumentError`` naming the step."""
    check_reader(read, map_fn)
    per_step = replay_steps(name, worker=worker, steps=steps, run=run,
                            url=resolve_url(url).render_as_string(hide_password=False), schema=schema)
    works: list[str] = []
    firsts: list[int] = []
    counts: list[int] = []
    bounds = [0]
    sizes: list[int] = []
    for rows in per_step:
        for t in rows:
            works.append(t.handed)
            firsts.append(t.first_record)
            counts.append(t.last_record - t.first_record + 1)
        bounds.append(len(works))
        sizes.append(sum(counts[bounds[-2]:]))
    w, f, c = tf.constant(works, tf.string), tf.constant(firsts, tf.int64), tf.constant(counts, tf.int64)
    b, n = tf.constant(bounds, tf.int64), tf.constant(sizes, tf.int64)
    numbers = tf.constant(list(steps), tf.int64)
    most = max(sizes)

    @tf.autograph.experimental.do_not_convert
    def records(work: tf.Tensor, first: tf.Tensor, count: tf.Tensor) -> tf.data.Dataset:
        return read(work).skip(first).take(count)

    @tf.autograph.experimental.do_not_convert
    def step_batch(k: tf.Tensor) -> tf.data.Dataset:
        lo, hi = b[k], b[k + 1]
        recs = tf.data.Dataset.from_tensor_slices((w[lo:hi], f[lo:hi], c[lo:hi])).flat_map(records)
        if map_fn is not None:
            recs = recs.map(lambda *record: _mapped(map_fn, _one(record)))
        return recs.batch(most).map(lambda *batch: _checked(_one(batch), n[k], numbers[k]))

    return tf.data.Dataset.range(len(steps)).flat_map(step_batch)


def _one(spread: tuple[Any, ...]) -> Any:
    """What ``Dataset.map`` spread into arguments, as one element again."""
    return spread[0] if len(spread) == 1 else spread


def _checked(batch: Any, expected: tf.Tensor, step: tf.Tensor) -> Any:
    """``batch`` once its size is the step's recorded one (else the iteration fails, naming it)."""
    got = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
    check = tf.debugging.Assert(tf.equal(got, expected), [
        "replay of step", step, ": the reader yields", got, "record(s) where the step trained", expected,
        "(replay needs the same reader and unchanged data)"])
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(tf.identity, batch)
