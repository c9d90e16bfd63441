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
hands them to the pipeline ``k`` at a time (:meth:`wq_sql.WorkQueue.take_many`, unbatched inside
the dataset), because the Python call itself costs about as much as reading a small file. How
many are claimed ahead, ``k``, and what the first pull claims follow the core's one rule
(:mod:`wq_sql.worker.sizing`): claimed items the pipeline has not yet reached (buffered, plus
those of the hand-out being read beyond the first) stay within ``lease_ahead``; ``k`` is half of
it, at most ``HAND_OUT_MAX``; one refill at a time. Consumed: the items of one hand-out are done
when the next hand-out is taken, which tf.data does only after the pipeline pulled all of them,
so an item is never done before the pipeline reached it; after a crash, up to ``k - 1`` items
that were already read may be delivered again (never lost). By default (no ``lease_ahead``)
the core sizes ``lease_ahead`` from the pipeline's own time per item
(:class:`wq_sql.worker.sizing.Sizer`), so the items claimed ahead cover about 0.1 s of reading:
hundreds of small files per round trip, one item at a time when an item takes 0.1 s or more;
``k`` follows it. A fixed ``lease_ahead=n`` turns that off.

Checkpoint-consistent consumption (``WorkQueue(..., consumed="checkpoint")``): items handed to
the pipeline stay claimed until a model checkpoint covers them; :meth:`WorkQueue.checkpoint_manager`
(TF2), :meth:`CheckpointManager.keras_callback` (Keras) and :meth:`WorkQueue.checkpoint_listener`
(TF1 ``CheckpointSaverHook``) mark them done at each save, stamped with the step, and re-open on
restore what the restored checkpoint does not cover. With the ``tf.data`` iterator in the
checkpoint that is exactly once (but for hand-outs overlapping the iterator's serialization);
otherwise at least once, an item counting as trained once ``read_ahead`` more items were handed
out. The rules, the race with TensorFlow's threads and the bounds: ``docs/design.md``,
"Checkpoint-consistent consumption".

Synchronous training (``MultiWorkerMirroredStrategy``): workers take different numbers of items,
so their data ends unevenly, and a worker that stops stepping leaves the others waiting in a
collective. The queue uses the synchronous end by itself when the job looks synchronous
(:func:`synchronous_training`: a multi-worker strategy in scope, or ``$TF_CONFIG`` naming two or
more workers and no parameter server); ``synchronous=True``/``False`` overrides that. Iterate the
dataset through
``strategy.experimental_distribute_dataset(...)`` (or ``distribute_datasets_from_function``) in a
custom loop: TensorFlow's distributed iterator all-reduces at each step whether every worker
still has data, so all workers run the same number of steps (the last with partial or empty
batches) and end together (``tests/tf/test_tf_sync.py``). ``synchronous=True`` ends a worker's
data as soon as nothing is claimable and other workers hold the rest, instead of waiting for
those items (by default a worker waits, because a dead worker's items come back): a peer
blocked in a collective that waits for this worker would never finish them (a deadlock:
``docs/design.md``, "History"). The price: if a peer dies holding items, the job
(which a synchronous strategy cannot continue anyway) is restarted and they are taken then.
Keras 3's ``model.fit`` does not run under that strategy with two or more workers on any
dataset (keras-team/keras#20585; a ``ValueError`` converting ``PerReplica`` values with
TensorFlow 2.21), so it is not covered: use the custom loop. No other end-together mechanism is
provided.

Keras epochs: ``input_dataset(epochs="each")`` makes each iteration of the dataset one queue
epoch, so ``model.fit(ds, epochs=E)`` trains queue epoch ``k`` in Keras epoch ``k``, and a resumed
``fit`` starts at ``initial_epoch=wq.resume_epoch()``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import threading
import weakref
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from wq_sql.errors import InvalidInput, QueueEmpty, QueueExhausted
from wq_sql.queue import Progress, WorkItem
from wq_sql.queue import WorkQueue as _CoreQueue
from wq_sql.tf.checkpoint import CheckpointListener, CheckpointManager, checkpoint_step, need_checkpoint_mode
from wq_sql.tf.lineage import Reader, StepLog, replay_dataset
from wq_sql.tf.lineage import batches as _batches
from wq_sql.tf.readers import TableRecordReader, item_dataset, records_dataset
from wq_sql.worker.checkpoints import Ledger, Mark
from wq_sql.worker.sizing import HAND_OUT_MAX, first_claim, hand_out_size

__all__ = ["WorkQueue", "CheckpointManager", "CheckpointListener", "checkpoint_step", "synchronous_training",
           "TableRecordReader", "records_dataset", "item_dataset", "replay_dataset", "HAND_OUT_MAX"]

log = logging.getLogger("wq_sql")



class WorkQueue:
    """DeepRec's ``WorkQueue`` for TensorFlow programs, backed by a wq_sql job table.

    Takes the arguments of :class:`wq_sql.WorkQueue` (DeepRec's ``works, num_epochs, shuffle,
    seed, prefix, num_slices, name`` first, then wq_sql's keyword-only ``url=``, ``worker=``,
    ``lease_ahead=`` ...), plus ``consumed=`` (see the module docstring, checkpoint-consistent
    consumption) and ``synchronous=`` (see the module docstring, synchronous training)::

        from wq_sql.tf import WorkQueue
        wq = WorkQueue(["a.csv", "b.csv", "c.csv"], num_epochs=2, url="sqlite:///q.db")
        dataset = tf.data.TextLineDataset(wq.input_dataset())    # TF2, eager or tf.function
        keys, values = tf.compat.v1.TextLineReader().read_up_to(wq.input_producer(), 2)  # TF1

    The underlying core queue is :attr:`queue`. An item counts as consumed (DeepRec's
    semantics) once the next one is taken, or when the queue is closed (at exit, or by
    :meth:`close` / leaving a ``with`` block).
    """

    def __init__(self, *args: Any, consumed: str = "taken", synchronous: Optional[bool] = None,
                 lineage: bool = False, **kwargs: Any) -> None:
        if not isinstance(lineage, bool):
            raise ValueError(f"lineage must be True or False, got {lineage!r}")
        if consumed not in ("taken", "checkpoint"):
            raise ValueError(f"consumed must be 'taken' (DeepRec) or 'checkpoint', got {consumed!r}")
        if consumed == "checkpoint":
            if kwargs.get("auto_complete", False):
                raise ValueError("consumed='checkpoint' makes items done at checkpoints, not on the "
                                 "next take: leave auto_complete unset")
            kwargs["auto_complete"] = False
        self.consumed = consumed
        # None: chosen by the job's shape (synchronous_training()); the flag overrides it.
        self.synchronous = synchronous_training() if synchronous is None else bool(synchronous)
        # What checkpoints cover of this object's hand-outs (consumed='checkpoint'):
        # wq_sql.worker.checkpoints.
        self.ledger = Ledger()
        self.queue = _CoreQueue(*args, **kwargs)
        # The batches of batches(): their steps, lineage (lineage=True) and the loop's input wait
        # (made by the first batches() call).
        self.lineage = lineage
        self._steps: Optional[StepLog] = None
        self._stats_lock = threading.Lock()
        self._taken = 0
        self._last_epoch = 0
        self._cancel_generation = 0
        # Items per input_dataset call: half of lease_ahead (which follows the pipeline when sized
        # automatically), at most HAND_OUT_MAX; the largest so far bounds what the pipeline may
        # have read ahead.
        self._hand_out = self._per_call()
        self._later_seen = False  # the last hand-out met an item of a later epoch than its pass's
        # Whether the data of the last input_dataset() iteration ended (its last hand-out was
        # empty): the Keras callback's end-of-epoch save covers everything then.
        self.pass_ended = False

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
        """Acknowledge what was handed out, give back what was claimed ahead, and leave (with the
        lineage rows and input wait :meth:`batches` kept, in the same transaction)."""
        self._drain_steps()
        self.queue.close()

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self._drain_steps()
        self.queue.__exit__(exc_type, exc, tb)

    @property
    def steps(self) -> StepLog:
        """What :meth:`batches` datasets record: their steps, lineage and input wait."""
        if self._steps is None:
            self._steps = StepLog(self.queue, self.lineage)
            # Before wq_sql's own exit hook closes the core queue (atexit runs the last
            # registered first): what the variables hold rides on that close.
            atexit.register(_drain_at_exit, weakref.ref(self))
        return self._steps

    def _drain_steps(self) -> None:
        if self._steps is not None and not self.queue.closed:
            self._steps.drain()

    def __repr__(self) -> str:
        return f"wq_sql.tf.{self.queue!r}"

    # ------------------------------------------------------------------ taking, in Python

    def _take_item(self, cancel_generation: Optional[int] = None) -> WorkItem:
        """The next item; :class:`QueueExhausted` at the end. With ``cancel_generation``, a wait
        for other workers' items ends with :class:`_Cancelled` once :meth:`_cancel` was called."""
        return self._take_items(1, cancel_generation)[0]

    def _take_items(self, n: int, cancel_generation: Optional[int] = None,
                    claim: Optional[int] = None, limit: Optional[int] = None) -> list[WorkItem]:
        """Up to ``n`` items (see :meth:`wq_sql.WorkQueue.take_many`, also for ``claim``), as
        :meth:`_take_item`. ``limit``: only items of epochs up to it; the others taken go back to
        the queue at once (never handed out), and :attr:`_later_seen` says one was met."""
        call = self.ledger.start()
        items: list[WorkItem] = []
        later: list[WorkItem] = []
        try:
            items = self._take_items_now(n, cancel_generation, claim)
            if limit is not None:
                later = [i for i in items if i.epoch > limit]
                items = [i for i in items if i.epoch <= limit]
        finally:
            self.ledger.finish(call, items)
        for item in later:
            self.queue.release(item)
        self._later_seen = bool(later)
        with self._stats_lock:
            self._taken += len(items)
            if items:
                self._last_epoch = items[-1].epoch
        return items

    def _take_items_now(self, n: int, cancel_generation: Optional[int],
                        claim: Optional[int]) -> list[WorkItem]:
        if self.synchronous:
            # Never wait for items other workers hold: under a synchronous strategy they may be
            # blocked in a collective that waits for this worker, and would never finish them.
            try:
                return self.queue.take_many(n, timeout=0, claim=claim)
            except QueueEmpty:
                return self._end_of_data(n, claim)
        if self.consumed == "checkpoint":
            return self._take_until_checkpointed(n, cancel_generation, claim)
        if cancel_generation is None:
            return self.queue.take_many(n, claim=claim)
        try:
            return self.queue.take_many(n, claim=claim,
                                        stop=lambda: self._cancel_generation != cancel_generation)
        except QueueEmpty:
            raise _Cancelled() from None

    def _take_until_checkpointed(self, n: int, cancel_generation: Optional[int],
                                 claim: Optional[int]) -> list[WorkItem]:
        """With ``consumed='checkpoint'`` this worker's items stay claimed until a checkpoint covers
        them, so the core would wait for them forever at the end: the data ends for this worker
        once every item not done or failed is one it handed out itself. Between checks the
        core's take waits, woken at once by an item landing in its buffer."""
        pause = 0.02
        cancelled = None if cancel_generation is None else (
            lambda: self._cancel_generation != cancel_generation)
        while True:
            try:
                return self.queue.take_many(n, timeout=pause, claim=claim, stop=cancelled)
            except QueueEmpty:
                pass
            if cancelled is not None and cancelled():
                raise _Cancelled()
            if self.queue.progress().remaining <= self.ledger.held():
                self.ledger.ended = True
                return self._end_of_data(n, claim)
            pause = min(2 * pause, self.queue.poll_seconds)

    def _end_of_data(self, n: int, claim: Optional[int]) -> list[WorkItem]:
        """This worker's data ends without the queue being exhausted (the synchronous end,
        checkpoint mode's end). A refill thread kicked by the last hand-out may be about to claim
        an item into the buffer, where no pull would ever look: stop the refills first, then
        take what they left there; only an empty buffer ends the data."""
        self.queue.stop_refills()
        try:
            return self.queue.take_many(n, timeout=0, claim=claim)
        except QueueEmpty:
            p = self.queue.progress()
            raise QueueExhausted(self.name, p.done, p.failed, p.quarantined) from None

    def _take_bytes(self) -> bytes:
        """For ``tf.numpy_function``: ``StopIteration`` is how it raises OutOfRangeError."""
        try:
            return self._take_item().encode("utf-8")
        except QueueExhausted as e:
            raise StopIteration(str(e)) from None

    def _cancel(self) -> int:
        with self._stats_lock:
            self._cancel_generation += 1
            generation = self._cancel_generation
        self.queue.wake()  # a take() waiting for other workers' items sees the cancel now
        return generation

    def _next_many(self, passes: Optional[_Passes] = None, with_ids: bool = False) -> Any:
        """For ``input_dataset``: the next items (up to :meth:`_per_call`, what the buffer
        holds), or none at the end (of the queue, or with ``passes`` of the pass's epoch). After
        each hand-out, the core's refill thread tops the core's buffer up again, off the
        pipeline's path."""
        if passes is not None and passes.over:
            return _hand_out([], with_ids)
        try:
            # With an empty buffer (the first pull), claim one hand-out, so the pipeline starts
            # after a short round trip; the refill thread claims the rest while it reads those.
            k = self._per_call()
            self._hand_out = max(self._hand_out, k)
            items = self._take_items(k, claim=first_claim(k), limit=passes.limit() if passes else None)
        except QueueExhausted:
            items = []
        if passes is not None and (self._later_seen or not items):
            passes.over = True  # met the next epoch (or the end): this pass ends after these
        if not items:
            self.pass_ended = True
            return _hand_out([], with_ids)
        # The core's refill thread tops its buffer up again, off the pipeline's path, once at
        # least k places are free (one round trip claims several items).
        self.queue.refill_soon(self._per_call())
        return _hand_out(items, with_ids)

    def _per_call(self) -> int:
        """Items per ``input_dataset`` hand-out (``sizing.hand_out_size``): at most
        ``HAND_OUT_MAX``, which bounds what a crash may deliver again (``k - 1`` items already
        read) and what a checkpoint assumes read ahead (``default_read_ahead``)."""
        return hand_out_size(self.queue.lease_ahead)

    def _next_or_end(self, passes: Optional[_Passes] = None, with_ids: bool = False) -> Any:
        """:meth:`_next_many` for a map that ends on ``OutOfRangeError``: ``StopIteration`` (which
        ``tf.numpy_function`` raises as that error) instead of an empty hand-out."""
        works = self._next_many(passes, with_ids)
        if not len(works[0] if with_ids else works):
            raise StopIteration(f"queue {self.name!r} is exhausted")
        return works

    def resume_epoch(self) -> int:
        """The epoch that the next pass of ``input_dataset(epochs="each")`` hands out in a new
        process: the lowest epoch with items not yet done (after a checkpoint restore, the restored
        one's), or ``num_epochs`` once all are. Resuming Keras: ``model.fit(ds, epochs=E,
        initial_epoch=wq.resume_epoch())``."""
        first = self.queue.first_open_epoch()
        return self.num_epochs if first is None else first

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

    def input_dataset(self, epochs: str = "all") -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of scalar ``tf.string`` work items that ends with the queue
        (``epochs="all"``, DeepRec's: one pass over every epoch), or, with ``epochs="each"``,
        at the end of each epoch: each iteration of the dataset (each ``iter(ds)``, each Keras
        epoch of ``model.fit(ds, epochs=E)``) is a pass over the next epoch of the queue.
        A pass of epoch ``k`` hands out epoch ``k``'s items and any left over from earlier
        epochs, and ends when the next claimable item is of a later epoch (given back at once,
        never handed out) or the queue ends; the last epoch's pass hands out everything left. A
        process's first pass is the lowest epoch not yet finished (:meth:`resume_epoch`:
        after a restore, the restored checkpoint's), each later one the epoch after its
        predecessor's (or the lowest unfinished, if other workers finished that one meanwhile).
        Iterate one such dataset at a time per queue object.

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

        After the first pull, a background thread keeps claimed ahead what ``lease_ahead``
        leaves room for, and items reach the pipeline ``min(ceil(lease_ahead / 2), 64)`` per
        Python call, so that pulls do not wait for the database (see the module docstring)."""
        return self._items_dataset(epochs, with_ids=False)

    def _items_dataset(self, epochs: str, with_ids: bool) -> tf.data.Dataset:
        """:meth:`input_dataset`; ``with_ids``: each element is ``(work, item id)`` (lineage)."""
        if epochs not in ("all", "each"):
            raise ValueError(f"epochs must be 'all' (DeepRec: one pass over every epoch) or 'each' (each "
                             f"iteration of the dataset is one epoch of the queue), got {epochs!r}")
        passes = _Passes(self) if epochs == "each" else None
        take, take_or_end = self._take_functions(passes, with_ids)

        @tf.autograph.experimental.do_not_convert
        def not_end(works: Any, *_: Any) -> tf.Tensor:
            return tf.size(works) > 0

        def items() -> tf.data.Dataset:
            pulls = tf.data.Dataset.from_tensors(0).repeat()
            # The end as the take's OutOfRangeError where tf.data allows it (a map that ends
            # there): one function less to instantiate than with take_while's predicate, so less
            # CPU in the thread that makes each new iterator, and its first batch sooner.
            # Otherwise the public form: an empty hand-out, cut by take_while.
            ds = _ending_map(pulls, take_or_end)
            if ds is None:
                ds = pulls.map(take).take_while(not_end)
            return ds.unbatch()

        if passes is None:
            ds = items()
        else:
            # A stateful function that runs once per iterator, when it is first pulled: the pass
            # begins (its epoch is chosen) before its first take.
            @tf.autograph.experimental.do_not_convert
            def begin(_: tf.Tensor) -> tf.Tensor:
                epoch = tf.numpy_function(passes.begin, [], tf.int64, stateful=True, name="begin_pass")
                epoch.set_shape([])
                return epoch

            ds = tf.data.Dataset.from_tensors(0).map(begin).flat_map(lambda _: items())
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        if self.consumed == "checkpoint":
            # The take is a stateful numpy_function: without this, saving an iterator of this
            # pipeline fails ("PyFunc is stateful"). Its state, the queue, is made consistent
            # with the checkpoint by the checkpoint helpers (see checkpoint_manager()).
            options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
        return ds.with_options(options)

    def _take_functions(self, passes: Optional[_Passes], with_ids: bool = False) -> tuple[Any, Any]:
        """The dataset's take, as a map function: one returning an empty hand-out at the end, one
        raising ``OutOfRangeError`` there. ``with_ids``: each returns ``(works, item ids)``."""
        # A stateful numpy_function pulled by a sequential map, only when the pipeline asks
        # (tf.data does not parallelise stateful maps; a stateless map after it would be, and
        # would pull ahead). Each call hands out what the prefetched buffer holds, up to half of
        # lease_ahead, and unbatch() passes them on one by one: the Python call, which costs
        # about as much as reading a small file, is paid once per hand-out, not per item.
        def next_many() -> Any:
            return self._next_many(passes, with_ids)

        def next_or_end() -> Any:
            return self._next_or_end(passes, with_ids)

        def made(fn: Any) -> Any:
            @tf.autograph.experimental.do_not_convert
            def take(_: tf.Tensor) -> Any:
                if not with_ids:
                    works = tf.numpy_function(fn, [], tf.string, stateful=True, name="take")
                    works.set_shape([None])
                    return works
                works, ids = tf.numpy_function(fn, [], [tf.string, tf.int64], stateful=True, name="take")
                works.set_shape([None])
                ids.set_shape([None])
                return works, ids
            return take

        return made(next_many), made(next_or_end)

    def batches(self, read: Reader, batch_size: int, *, map_fn: Optional[Any] = None,
                drop_remainder: bool = False, epochs: str = "all", interleave: int = 1,
                num_parallel_calls: Optional[int] = tf.data.AUTOTUNE,
                prefetch: Optional[int] = tf.data.AUTOTUNE,
                first_step: Optional[int] = None) -> tf.data.Dataset:
        """Training batches of the records of the items this worker takes, for a training loop
        or ``model.fit``; with ``lineage=True`` each batch's records are recorded, and in every
        case the loop's wait for its batches::

            wq = WorkQueue(files, url=url, worker="job-7/rank0", lineage=True)
            ds = wq.batches(tf.data.TextLineDataset, 256, map_fn=parse)
            for batch in ds:                       # step 0, 1, 2, ... of this worker
                train_step(batch)

        - ``read``: work (scalar ``tf.string``) -> ``tf.data.Dataset`` of its records, e.g.
          ``tf.data.TextLineDataset``; read one item at a time in hand-out order, or
          ``interleave`` items at once (``Dataset.interleave``, deterministic).
        - ``map_fn``: record -> features, applied to each record (``num_parallel_calls``,
          order kept) before batching; ``batch_size``, ``drop_remainder``: ``Dataset.batch``'s;
          ``prefetch``: batches made ahead (``None``: none); ``epochs``: as for
          :meth:`input_dataset`.
        - **Steps**: the ``k``-th batch this object's ``batches`` datasets yield (0-based, over
          every pass) is step ``k``; ``first_step`` numbers the next batch (after restoring a
          checkpoint, its global step) and begins a new lineage run.
        - **Lineage** (``lineage=True``): per step, which items and which records of each
          (positions in what ``read`` yields) the batch held, as rows of ``wq_steps`` written in
          the transaction of this worker's next claim round, which acknowledges the items handed
          out before (or of its close): no round trip per step. ``wq-sql trace`` lists them;
          :func:`replay_dataset` feeds those batches again.
        - **Waiting on data**: the time the loop waits inside the iterator's ``get_next`` for
          each batch is added to this worker's total, sent with its heartbeat (the metric
          ``wq_sql_worker_input_wait_seconds_total``, the dashboard's "waiting on data").

        Give the dataset to the loop as it is: a ``prefetch`` (or another stage) after it would
        make the measured wait the pipeline's, and would number batches the loop has not asked
        for yet. A batch is numbered when the loop receives it; a batch received but not trained
        when the process dies is recorded all the same (the items of a hand-out count as
        consumed once the next one is taken, DeepRec's semantics)."""
        if not tf.executing_eagerly():
            raise InvalidInput("batches() is for TensorFlow 2 code (eager, a training loop or model.fit); "
                               "in a TF1 graph use input_dataset() or input_producer()")
        if first_step is not None:
            if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
                raise InvalidInput(f"first_step must be a whole number >= 0, got {first_step!r}")
            self.steps.restart(first_step)
        return _batches(self._items_dataset(epochs, with_ids=True), self.steps, read, batch_size,
                        map_fn=map_fn, drop_remainder=drop_remainder, interleave=interleave,
                        num_parallel_calls=num_parallel_calls, prefetch=prefetch)

    def records_dataset(self, columns: Optional[list[str]] = None) -> tf.data.Dataset:
        """The records of every sliced item this worker takes (``table:``, ``lines:`` or a
        registered source), item after item; see :func:`wq_sql.tf_readers.records_dataset`."""
        return records_dataset(self, columns)

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

    # ------------------------------------------------------------------ checkpoint-consistent consumption

    @property
    def default_read_ahead(self) -> int:
        """The read-ahead assumed when none is given and the pipeline's iterator is not in the
        checkpoint: ``DEFAULT_READ_AHEAD`` plus the items of the largest hand-out so far (with
        the automatic ``lease_ahead`` it grows as the hand-outs do; see the module docstring,
        "Checkpoint-consistent consumption")."""
        return DEFAULT_READ_AHEAD + self._hand_out

    def before_save(self) -> Mark:
        """Call right before saving a checkpoint; pass the result to :meth:`after_save`. The
        checkpoint helpers (:meth:`checkpoint_manager`, :meth:`checkpoint_listener`) do it."""
        need_checkpoint_mode(self)
        return self.ledger.mark()

    def after_save(self, step: int, before: Mark, read_ahead: int = 0, *, data_ended: bool = False,
                   after: Optional[Mark] = None) -> int:
        """The checkpoint at global ``step`` was saved: mark done what it covers. ``read_ahead=0``:
        the pipeline's iterator is in the checkpoint, which covers every item handed out before
        the save began; ``read_ahead=W``: it is not, and an item counts as trained only once W
        further items were handed out before the save began. ``data_ended``: the training loop
        saw the end of its data (this worker's items are all handed out and every record was
        consumed), so the save covers everything handed out before it, whatever ``read_ahead``.
        ``after``: the mark taken when the save ended, if earlier than now (the iterators'
        own serialization, seen by :class:`CheckpointManager`). Returns how many items were
        made done."""
        need_checkpoint_mode(self)
        after = after or self.ledger.mark()
        done, ambiguous = self.ledger.cover(self.queue, step, before, after, 0 if data_ended else read_ahead)
        if ambiguous:
            log.info("queue %r: %d item(s) were handed out while checkpoint %d was being saved; they "
                     "count as not covered (re-delivered if this checkpoint is restored)",
                     self.name, ambiguous, step)
        return done

    def restore(self, step: Optional[int]) -> int:
        """The model was restored from this worker's checkpoint at global ``step`` (``None``: the
        job starts without a checkpoint): re-open every item a later checkpoint had covered.
        Items still claimed come back through same-identity recovery. Call it before training,
        or let a helper do it. Returns how many items were re-opened."""
        need_checkpoint_mode(self)
        return self.queue.reopen_after(step)

    def checkpoint_manager(self, checkpoint: tf.train.Checkpoint, directory: str,
                           max_to_keep: Optional[int] = 5, *, read_ahead: Optional[int] = None,
                           **kwargs: Any) -> CheckpointManager:
        """A ``tf.train.CheckpointManager`` (same arguments) whose saves make the items they cover
        done, stamped with the checkpoint number, and whose restores re-open the rest (TF2)::

            wq = WorkQueue(files, consumed="checkpoint", worker="trainer-0", url=...)
            iterator = iter(tf.data.TextLineDataset(wq.input_dataset()).batch(32))
            ckpt = tf.train.Checkpoint(model=model, optimizer=opt, iterator=iterator)
            manager = wq.checkpoint_manager(ckpt, "ckpts")
            manager.restore_or_initialize()
            ... manager.save(checkpoint_number=step)

        ``read_ahead``: default 0 (exactly once) when a ``tf.data`` iterator is in ``checkpoint``,
        else :attr:`default_read_ahead` (at least once). See :class:`CheckpointManager`."""
        return CheckpointManager(self, checkpoint, directory, max_to_keep, read_ahead=read_ahead, **kwargs)

    def checkpoint_listener(self, read_ahead: Optional[int] = None) -> CheckpointListener:
        """A TF1 ``CheckpointSaverListener`` for ``CheckpointSaverHook(listeners=[...])`` (see
        :class:`CheckpointListener`)."""
        return CheckpointListener(self, read_ahead)

    def _summary_tags(self) -> list[str]:
        n = self.items_per_epoch
        return [f"{self.name}/fraction_of_{n}_full", f"{self.name}/done", f"{self.name}/epoch",
                f"{self.name}/taken_by_this_worker"]

    def _stats(self) -> list[float]:
        p = self.queue.progress()
        with self._stats_lock:
            taken, epoch = self._taken, self._last_epoch
        return [p.remaining / p.items_per_epoch, float(p.done), float(epoch), float(taken)]


DEFAULT_READ_AHEAD = 8
"""Items, plus one hand-out: enough when one item is read at a time and the buffers after the
reader (shuffle, batch, prefetch, Keras' own) hold fewer records than 7 items have."""


def _drain_at_exit(ref: weakref.ref[WorkQueue]) -> None:
    wq = ref()
    if wq is not None:
        wq._drain_steps()


def _hand_out(items: list[WorkItem], with_ids: bool) -> Any:
    """What the take's ``numpy_function`` returns: the works, and with ``with_ids`` their ids."""
    works = np.array([item.encode("utf-8") for item in items], dtype=object)
    if not with_ids:
        return works
    return works, np.array([item.item_id for item in items], dtype=np.int64)


def synchronous_training() -> bool:
    """Whether this process looks like one worker of synchronous data-parallel training, whose
    workers meet in collectives: a strategy in scope that spans several workers
    (``MultiWorkerMirroredStrategy`` and kin), or ``$TF_CONFIG`` describing a cluster of two or
    more ``worker``/``chief`` tasks and no ``ps`` task (a parameter-server job trains
    asynchronously: its workers never wait for each other, so waiting for a peer's items is
    safe there, and DeepRec's default)."""
    if tf.distribute.has_strategy():
        extended = tf.distribute.get_strategy().extended
        multi = getattr(extended, "_in_multi_worker_mode", None)  # TF's own test, private
        if callable(multi) and multi():
            return True
    try:
        cluster = json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster") or {}
    except (ValueError, AttributeError):
        return False
    if not isinstance(cluster, dict) or cluster.get("ps"):
        return False
    workers = sum(len(cluster.get(kind) or []) for kind in ("worker", "chief"))
    return workers >= 2


def _ending_map(ds: tf.data.Dataset, fn: Any) -> Optional[tf.data.Dataset]:
    """``ds.map(fn)`` that ends where ``fn`` raises ``OutOfRangeError`` (TF1's map), or None where
    this TensorFlow has no such map. TF2's public ``map`` turns that error into a failure, to keep
    the dataset's cardinality; the same dataset op with ``preserve_cardinality=False`` is a
    private class (``map_op._MapDataset``, TensorFlow 2.21 here), so it is used only if it exists
    and takes that keyword (``tests/tf/test_tf_prefetch.py`` checks that it is used)."""
    try:
        from tensorflow.python.data.ops.map_op import _MapDataset
    except ImportError:
        return None
    try:
        return _MapDataset(ds, fn, preserve_cardinality=False)
    except TypeError:
        return None


class _Passes:
    """``input_dataset(epochs="each")``: the pass of the dataset's current iteration."""

    def __init__(self, work_queue: WorkQueue) -> None:
        self.wq = work_queue
        self.epoch: Optional[int] = None  # the running (or last) pass's epoch
        self.over = False  # the pass met a later epoch's item, or the end: its next take ends it

    def begin(self) -> np.int64:
        """A new iterator's first pull: the pass's epoch (see ``WorkQueue.input_dataset``)."""
        first = self.wq.resume_epoch()
        self.epoch = first if self.epoch is None else max(self.epoch + 1, first)
        self.over = False
        self.wq.pass_ended = False
        return np.int64(self.epoch)

    def limit(self) -> Optional[int]:
        """The last epoch this pass hands out (None: the last epoch's pass, everything left)."""
        assert self.epoch is not None
        return None if self.epoch >= self.wq.num_epochs - 1 else self.epoch


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
