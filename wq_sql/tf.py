"""DeepRec's ``WorkQueue`` API on TensorFlow: the same queue as :class:`wq_sql.WorkQueue`, handed
out as ``tf.string`` tensors, a ``tf.data.Dataset`` or a TF1 ``FIFOQueue`` for Reader ops.

Changing DeepRec's import line is enough::

    # from tensorflow.python.ops.work_queue import WorkQueue
    from wq_sql.tf import WorkQueue

    work_queue = WorkQueue([path1, path2, path3, path4])
    dataset = tf.data.TextLineDataset(work_queue.input_dataset())

Only this module imports TensorFlow (``pip install 'wq_sql[tf]'``); ``import wq_sql`` does not.

Every TensorFlow entry point ends up in :meth:`wq_sql.WorkQueue.take`, called from TensorFlow's
own threads (``tf.data`` workers, ``QueueRunner`` threads); the core serialises them with its lock.

Items are claimed only when the pipeline pulls them (DeepRec issue #436: every file was taken
before the first step). A worker holds at most ``lease_ahead`` claimed-but-not-handed-out items,
plus what its own pipeline pulls ahead: ``TextLineDataset(wq.input_dataset())`` reads one file at
a time; a shuffle or prefetch buffer of ``B`` lines spans about ``B / lines_per_file + 1`` files;
``interleave(cycle_length=k)`` keeps ``k`` files open, and its parallel form (or
``num_parallel_reads=k``) also opens about ``2 * k`` more ahead; tf.data adds a one-element
prefetch after a pipeline's last synchronous step (``inject_prefetch``).

Throughput: ``input_dataset`` keeps the core's buffer topped up from a background thread
(:meth:`wq_sql.WorkQueue.prefetch`, one per queue object, started by the first pull), so that a
``tf.data`` pull finds items already claimed instead of waiting for a database round trip, and it
hands them to the pipeline ``k = ceil(lease_ahead / 2)`` at a time
(:meth:`wq_sql.WorkQueue.take_many`, unbatched inside the dataset), because the Python call
itself costs about as much as reading a small file. The thread claims once ``k`` places are
free, so one round trip claims about ``k`` items. Bounds: claimed items the pipeline has not yet
reached (buffered, plus those of the last hand-out beyond the first) stay at most
``lease_ahead``; one refill at a time. Consumed: the items of one hand-out are done when the
next hand-out is taken, which tf.data does only after the pipeline pulled all of them, so an
item is never done before the pipeline reached it; after a crash, up to ``k - 1`` items that
were already read may be delivered again (never lost). With ``lease_ahead=1`` (the default)
nothing changes but the overlap: one item per call and per round trip. For many small files use
a larger ``lease_ahead`` (``bench/tf_textline.py``; numbers in ``BENCHMARKS.md``).

Synchronous training (``MultiWorkerMirroredStrategy``): workers take different numbers of items,
so their data ends unevenly, and a worker that stops stepping leaves the others waiting in a
collective. Iterate the dataset through ``strategy.experimental_distribute_dataset(...)`` (or
``distribute_datasets_from_function``) in a custom loop: TensorFlow's distributed iterator
all-reduces at each step whether every worker still has data, so all workers run the same
number of steps (the last with partial or empty batches) and end together
(``tests/tf/test_tf_sync.py``). Keras 3's ``model.fit`` did not run under that strategy with two
workers in the tested TensorFlow 2.21 even on a plain ``tf.data.Dataset`` (a ``ValueError``
converting ``PerReplica`` values), so it is not covered. No other end-together mechanism is
provided.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import weakref
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from wq_sql.errors import QueueEmpty, QueueExhausted, WorkerConflict, WqSqlError
from wq_sql.queue import Progress, WorkItem
from wq_sql.queue import WorkQueue as _CoreQueue

__all__ = ["WorkQueue"]

log = logging.getLogger("wq_sql")

# How long one wait of a graph-mode take() lasts before it checks whether its QueueRunner was
# cancelled (the session is closing). Only reached while other workers hold every remaining item.
_WAIT_SLICE_SECONDS = 5.0


class WorkQueue:
    """DeepRec's ``WorkQueue`` for TensorFlow programs, backed by a wq_sql job table.

    Takes exactly the arguments of :class:`wq_sql.WorkQueue` (DeepRec's ``works, num_epochs,
    shuffle, seed, prefix, num_slices, name`` first, then wq_sql's keyword-only ``url=``,
    ``worker=``, ``lease_ahead=`` ...)::

        from wq_sql.tf import WorkQueue
        wq = WorkQueue(["a.csv", "b.csv", "c.csv"], num_epochs=2, url="sqlite:///q.db")
        dataset = tf.data.TextLineDataset(wq.input_dataset())    # TF2, eager or tf.function
        keys, values = tf.compat.v1.TextLineReader().read_up_to(wq.input_producer(), 2)  # TF1

    The underlying core queue is :attr:`queue`. An item counts as consumed (DeepRec's
    semantics) once the next one is taken, or when the queue is closed (at exit, or by
    :meth:`close` / leaving a ``with`` block).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.queue = _CoreQueue(*args, **kwargs)
        self._stats_lock = threading.Lock()
        self._taken = 0
        self._last_epoch = 0
        self._cancel_generation = 0
        self._prefetcher: Optional[_Prefetcher] = None
        self._hand_out = max(1, (self.queue.lease_ahead + 1) // 2)  # items per input_dataset call

    @classmethod
    def attach(cls, name: str = "work_queue", **kwargs: Any) -> WorkQueue:
        """Join an existing queue without repeating its works (see :meth:`wq_sql.WorkQueue.attach`)."""
        return cls(None, name=name, **kwargs)

    # ------------------------------------------------------------------ the core, forwarded

    @property
    def name(self) -> str:
        return self.queue.name

    @property
    def worker(self) -> str:
        return self.queue.worker

    @property
    def num_epochs(self) -> int:
        return self.queue.num_epochs

    @property
    def items_per_epoch(self) -> int:
        return self.queue.items_per_epoch

    @property
    def lease_ahead(self) -> int:
        return self.queue.lease_ahead

    def __len__(self) -> int:
        """Items in one epoch (DeepRec's capacity)."""
        return self.queue.items_per_epoch

    @property
    def taken(self) -> int:
        """How many items this object has handed to TensorFlow."""
        return self._taken

    def progress(self) -> Progress:
        return self.queue.progress()

    def close(self) -> None:
        """Acknowledge what was handed out, give back what was claimed ahead, and leave."""
        self._stop_prefetching()
        self.queue.close()

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._stop_prefetching()
        self.queue.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"wq_sql.tf.{self.queue!r}"

    # ------------------------------------------------------------------ taking, in Python

    def _take_item(self, cancel_generation: Optional[int] = None) -> WorkItem:
        """The next item; :class:`QueueExhausted` at the end. With ``cancel_generation``, a wait
        for other workers' items ends with :class:`_Cancelled` once :meth:`_cancel` was called."""
        return self._take_items(1, cancel_generation)[0]

    def _take_items(self, n: int, cancel_generation: Optional[int] = None) -> list[WorkItem]:
        """Up to ``n`` items (see :meth:`wq_sql.WorkQueue.take_many`), as :meth:`_take_item`."""
        while True:
            try:
                items = self.queue.take_many(
                    n, timeout=None if cancel_generation is None else _WAIT_SLICE_SECONDS)
            except QueueEmpty:
                if cancel_generation is not None and self._cancel_generation != cancel_generation:
                    raise _Cancelled() from None
                continue
            with self._stats_lock:
                self._taken += len(items)
                self._last_epoch = items[-1].epoch
            return items

    def _take_bytes(self) -> bytes:
        """For ``tf.numpy_function``: ``StopIteration`` is how it raises OutOfRangeError."""
        try:
            return self._take_item().encode("utf-8")
        except QueueExhausted as e:
            raise StopIteration(str(e)) from None

    def _cancel(self) -> int:
        with self._stats_lock:
            self._cancel_generation += 1
            return self._cancel_generation

    def _next_many(self) -> np.ndarray:
        """For ``input_dataset``: the next items (up to half of ``lease_ahead``, what the buffer
        holds), or none at the end. After each hand-out, the prefetch thread tops the core's
        buffer up again, off the pipeline's path."""
        try:
            items = self._take_items(self._hand_out)
        except QueueExhausted:
            return np.array([], dtype=object)
        self._kick_prefetcher()
        return np.array([item.encode("utf-8") for item in items], dtype=object)

    def _kick_prefetcher(self) -> None:
        p = self._prefetcher
        if p is None or not p.alive():
            with self._stats_lock:
                p = self._prefetcher
                if p is None or not p.alive():
                    p = self._prefetcher = _Prefetcher(self.queue)
        p.kick()

    def _stop_prefetching(self) -> None:
        p = self._prefetcher
        if p is not None:
            p.stop()

    # ------------------------------------------------------------------ DeepRec's API

    def take(self) -> tf.Tensor:
        """The next work item as a scalar ``tf.string``; ``tf.errors.OutOfRangeError`` once the
        queue is exhausted.

        Eagerly, takes an item now and returns it. In a graph (TF1, or inside ``tf.function``),
        returns an op that takes one item each time it runs."""
        if tf.executing_eagerly():
            try:
                return tf.constant(self._take_item().encode("utf-8"), dtype=tf.string)
            except QueueExhausted as e:
                raise tf.errors.OutOfRangeError(None, None, str(e)) from None
        with tf.name_scope(_scope_name(self.name)):
            work = tf.numpy_function(self._take_bytes, [], tf.string, stateful=True, name="take")
        work.set_shape([])
        return work

    def input_dataset(self) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of scalar ``tf.string`` work items that ends with the queue.

        Items are taken as the pipeline pulls them (``TextLineDataset(wq.input_dataset())``
        takes the next file when it has read the previous one; see the module docstring for
        what pipelines pull ahead). Iterating the dataset again continues where the queue is.
        Auto-sharding is off: under a distribution strategy every worker takes from the shared
        queue instead of dropping the others' share. The takes run Python in this process:
        build the dataset in each worker's own process (between-graph training,
        ``MirroredStrategy``); it cannot be shipped to Python-less remote workers
        (``ParameterServerStrategy``'s ``dataset_fn`` runs on them). Under
        ``MultiWorkerMirroredStrategy``, iterate it through the strategy's distributed iterator
        so that workers with uneven data end together (see the module docstring).

        After the first pull, a background thread keeps up to ``lease_ahead`` items claimed
        ahead, and items reach the pipeline ``ceil(lease_ahead / 2)`` per Python call, so that
        pulls do not wait for the database (see the module docstring)."""
        # A stateful numpy_function pulled by a sequential map, only when the pipeline asks
        # (tf.data does not parallelise stateful maps; a stateless map after it would be, and
        # would pull ahead). Each call hands out what the prefetched buffer holds, up to half of
        # lease_ahead, and unbatch() passes them on one by one: the Python call, which costs
        # about as much as reading a small file, is paid once per hand-out, not per item.
        @tf.autograph.experimental.do_not_convert
        def take(_: tf.Tensor) -> tf.Tensor:
            works = tf.numpy_function(self._next_many, [], tf.string, stateful=True, name="take")
            works.set_shape([None])
            return works

        @tf.autograph.experimental.do_not_convert
        def not_end(works: tf.Tensor) -> tf.Tensor:
            return tf.size(works) > 0

        ds = tf.data.Dataset.from_tensors(0).repeat().map(take).take_while(not_end).unbatch()
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        return ds.with_options(options)

    def input_producer(self) -> tf.queue.FIFOQueue:
        """A local ``FIFOQueue`` of work items for TF1 Reader ops, fed by a ``QueueRunner`` added to
        the graph's ``QUEUE_RUNNERS`` collection (``MonitoredTrainingSession`` and
        ``tf.compat.v1.train.start_queue_runners`` start it).

        Each element has shape ``[1]``, as in DeepRec. When the queue is exhausted the local queue
        is closed, so ``reader.read_up_to(...)`` raises ``OutOfRangeError`` after the last record
        and a ``MonitoredTrainingSession`` loop ends normally. Graph mode only (TF1 readers do
        not run eagerly): use :meth:`input_dataset` in TF2 code."""
        if tf.executing_eagerly():
            raise RuntimeError(
                "input_producer() feeds TF1 Reader ops, which need graph mode "
                "(tf.compat.v1.disable_eager_execution() or `with tf.Graph().as_default():`); "
                "in eager code use tf.data.TextLineDataset(work_queue.input_dataset())")
        with tf.name_scope(_scope_name(self.name)):
            work = tf.numpy_function(self._take_for_runner, [], tf.string, stateful=True, name="take")
            proxy = tf.queue.FIFOQueue(capacity=1, dtypes=[tf.string], shapes=[tf.TensorShape([1])],
                                       name="proxy")
            enqueue = proxy.enqueue(tf.reshape(work, [1]))
            # Cancelling also ends a take() that waits for other workers' last items, so that
            # closing the session does not wait for them.
            cancel = tf.group(proxy.close(cancel_pending_enqueues=True),
                              tf.py_function(self._cancel, [], tf.int64, name="cancel_take"))
            with _deprecation_silenced():  # QueueRunner is DeepRec's API; the warning is noise
                runner = tf.compat.v1.train.QueueRunner(proxy, [enqueue], close_op=proxy.close(),
                                                        cancel_op=cancel)
                tf.compat.v1.train.add_queue_runner(runner)
        return proxy

    def _take_for_runner(self) -> bytes:
        generation = self._cancel_generation
        try:
            return self._take_item(cancel_generation=generation).encode("utf-8")
        except (QueueExhausted, _Cancelled) as e:
            raise StopIteration(str(e)) from None

    def add_summary(self, step: Optional[int] = None) -> None:
        """Queue statistics for TensorBoard, as scalars:

        - ``<name>/fraction_of_<capacity>_full``: items not yet done or failed, over one epoch's
          count (DeepRec's scalar; starts at ``num_epochs``);
        - ``<name>/done``: items done, all workers;
        - ``<name>/epoch``: the epoch of the item this worker took last;
        - ``<name>/taken_by_this_worker``: items this worker took.

        In a TF1 graph the summaries go to the ``SUMMARIES`` collection (``MonitoredTrainingSession``
        with ``summary_dir`` and ``tf.compat.v1.summary.merge_all()`` pick them up); inside a
        ``tf.function`` they are recorded each time the function runs. Eagerly, they are written
        now to the default writer (``tf.summary.create_file_writer(...).as_default()``) at
        ``step`` (default: ``tf.summary.experimental.get_step()``, else :attr:`taken`): call it
        whenever you want a point, e.g. every N steps."""
        tags = self._summary_tags()
        if tf.executing_eagerly():
            if step is None:
                step = tf.summary.experimental.get_step()
            if step is None:
                step = self._taken
            for tag, value in zip(tags, self._stats()):
                _write_scalar(tag, value, step)
            return
        with tf.name_scope(_scope_name(self.name)):
            values = tf.py_function(self._stats, [], [tf.float32] * len(tags), name="stats")
        for value in values:
            value.set_shape([])
        if not tf.compat.v1.executing_eagerly_outside_functions():  # a TF1 graph
            for tag, value in zip(tags, values):
                tf.compat.v1.summary.scalar(tag, value)
            return
        if step is None and tf.summary.experimental.get_step() is None:
            step = tf.cast(values[-1], tf.int64)
        for tag, value in zip(tags, values):
            _write_scalar(tag, value, step)

    def _summary_tags(self) -> list[str]:
        n = self.items_per_epoch
        return [f"{self.name}/fraction_of_{n}_full", f"{self.name}/done", f"{self.name}/epoch",
                f"{self.name}/taken_by_this_worker"]

    def _stats(self) -> list[float]:
        p = self.queue.progress()
        with self._stats_lock:
            taken, epoch = self._taken, self._last_epoch
        return [p.remaining / p.items_per_epoch, float(p.done), float(epoch), float(taken)]


class _Prefetcher:
    """A daemon thread that keeps the core queue's buffer of claimed items topped up
    (:meth:`wq_sql.WorkQueue.prefetch`) after each take by ``input_dataset``, so that the
    ``tf.data`` pull pops a buffered item instead of waiting for a database round trip. It
    claims once at least half of ``lease_ahead`` places are free, so one round trip claims
    several items; the core keeps claimed-but-not-handed-out items at most ``lease_ahead``.
    Started by the first pull (a pipeline that is only built claims nothing)."""

    def __init__(self, queue: _CoreQueue) -> None:
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._pid = os.getpid()
        min_claim = max(1, (queue.lease_ahead + 1) // 2)
        self._thread = threading.Thread(
            target=_prefetch_loop, args=(weakref.ref(queue), self._wake, self._stopped, min_claim),
            name=f"wq_sql-prefetch-{queue.name}", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._pid == os.getpid() and not self._stopped.is_set()

    def kick(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._pid == os.getpid() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


def _prefetch_loop(ref: weakref.ref[_CoreQueue], wake: threading.Event, stopped: threading.Event,
                   min_claim: int) -> None:
    try:
        while not stopped.is_set():
            if not wake.wait(timeout=1.0):
                if ref() is None:  # the queue object is gone: so is the need to prefetch
                    return
                continue
            wake.clear()
            queue = ref()
            if queue is None or stopped.is_set():
                return
            try:
                while queue.prefetch(min_claim) and not stopped.is_set():
                    pass
            except WorkerConflict:
                return  # superseded: take() says so to the pipeline
            except WqSqlError as e:
                if type(e) is WqSqlError:  # closed
                    return
                log.debug("prefetch of queue %r failed, take() will retry: %s", queue.name, e)
            except Exception as e:  # a database error: the pipeline's own take() retries and reports it
                log.debug("prefetch of queue %r failed, take() will retry: %s", queue.name, e)
            finally:
                del queue
    finally:
        stopped.set()


class _Cancelled(Exception):
    """A graph-mode take() gave up waiting because its QueueRunner was cancelled."""

    def __str__(self) -> str:
        return "the session is closing"


def _write_scalar(tag: str, value: Any, step: Any) -> None:
    """``tf.summary.scalar`` without it: that one lives in TensorBoard, which TensorFlow no longer
    installs. The metadata is what TensorBoard's scalars plugin looks for."""
    metadata = tf.compat.v1.SummaryMetadata()
    metadata.plugin_data.plugin_name = "scalars"
    tf.summary.write(tag, tf.cast(value, tf.float32), step=step, metadata=metadata)


def _deprecation_silenced() -> contextlib.AbstractContextManager[Any]:
    try:
        from tensorflow.python.util import deprecation
    except ImportError:  # a private module; losing it only brings the warning back
        return contextlib.nullcontext()
    return deprecation.silence()


def _scope_name(name: str) -> str:
    """A valid TF name scope for a queue name (queue names may hold any character)."""
    scope = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return scope if re.match(r"[A-Za-z0-9.]", scope) else "wq" + scope
