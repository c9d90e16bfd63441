"""Checkpoint-consistent consumption for TensorFlow: a ``tf.train.CheckpointManager`` (TF2) and a
``CheckpointSaverListener`` (TF1) whose saves make the items they cover done, stamped with the
checkpoint's step, and whose restores re-open what later checkpoints had covered. The book of
what a save covers is the framework-free :class:`wq_sql.worker.checkpoints.Ledger`; ``wq_sql.tf``
explains the semantics ("Checkpoint-consistent consumption") and re-exports these names.

The helpers see their queue through :class:`CheckpointedQueue`, the few public names of
:class:`wq_sql.tf.WorkQueue` they use, so this module does not import the one that uses it."""

from __future__ import annotations

import copy
import re
from typing import Any, Optional, Protocol

import tensorflow as tf

from wq_sql.worker.checkpoints import Ledger, Mark

__all__ = ["CheckpointManager", "CheckpointListener", "checkpoint_step"]


class CheckpointedQueue(Protocol):
    """What the checkpoint helpers use of a :class:`wq_sql.tf.WorkQueue`."""

    consumed: str
    ledger: Ledger

    @property
    def default_read_ahead(self) -> int: ...

    def before_save(self) -> Mark: ...

    def after_save(self, step: int, before: Mark, read_ahead: int = 0, *,
                   data_ended: bool = False, after: Optional[Mark] = None) -> int: ...

    def restore(self, step: Optional[int]) -> int: ...

    @property
    def pass_ended(self) -> bool: ...


def need_checkpoint_mode(work_queue: CheckpointedQueue) -> None:
    """Raise unless ``work_queue`` was made with ``consumed='checkpoint'``."""
    if work_queue.consumed != "checkpoint":
        raise ValueError("checkpoint-consistent consumption needs WorkQueue(..., consumed='checkpoint')")


class CheckpointManager:
    """``tf.train.CheckpointManager`` for a queue with ``consumed='checkpoint'`` (made by
    :meth:`WorkQueue.checkpoint_manager`). :meth:`save` marks done what the new checkpoint
    covers, stamped with its number (pass ``checkpoint_number=`` the global step);
    :meth:`restore` / :meth:`restore_or_initialize` restore it and re-open the items later
    checkpoints had covered. ``manager`` is the wrapped ``tf.train.CheckpointManager``.

    ``read_ahead=0`` (the default when ``checkpoint`` holds a ``tf.data`` iterator): exactly once
    relative to the restored checkpoint. ``read_ahead=W`` (the default otherwise is
    ``wq.default_read_ahead``, read at each save: it grows with the hand-outs): at least once,
    duplicates bounded by the records of ``W`` items."""

    def __init__(self, work_queue: CheckpointedQueue, checkpoint: tf.train.Checkpoint, directory: str,
                 max_to_keep: Optional[int] = 5, *, read_ahead: Optional[int] = None, **kwargs: Any) -> None:
        need_checkpoint_mode(work_queue)
        if read_ahead is None and _holds_iterator(checkpoint):
            read_ahead = 0
        self.work_queue = work_queue
        self.checkpoint = checkpoint
        self._read_ahead = _check_read_ahead(read_ahead)
        self.manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep, **kwargs)
        if read_ahead == 0:
            _bracket_iterators(checkpoint, work_queue.ledger)

    @property
    def read_ahead(self) -> int:
        """The read-ahead the next save assumes (the queue's default, as of now, unless given)."""
        return self.work_queue.default_read_ahead if self._read_ahead is None else self._read_ahead

    @property
    def latest_checkpoint(self) -> Optional[str]:
        return self.manager.latest_checkpoint

    @property
    def checkpoints(self) -> list[str]:
        return list(self.manager.checkpoints)

    def save(self, checkpoint_number: Optional[int] = None, *, data_ended: bool = False,
             **kwargs: Any) -> str:
        """Save (``tf.train.CheckpointManager.save``) and mark the covered items done.
        ``data_ended=True`` when the training loop has consumed all of its data (see
        :meth:`WorkQueue.after_save`): the last save then covers every item.

        The queue is told once the checkpoint's files are written and before the manager
        records it as the latest (a write callback, ``CheckpointOptions``' own, that runs ahead
        of the manager's): a process killed before the record leaves the previous checkpoint the
        latest, whose restore re-opens what this save covered; killed after it, the restored
        checkpoint's items are done. Never a latest checkpoint whose trained items the queue
        would hand out again."""
        ledger = self.work_queue.ledger
        before = self.work_queue.before_save()
        read_ahead = self.read_ahead
        told: list[str] = []

        def tell(path: str) -> None:
            # The iterators' own serialization, when it was seen, brackets the hand-outs more
            # tightly than the whole save (which also writes files).
            marks, ledger.serialized = ledger.serialized, None
            tight, after = before, None
            if marks:
                tight = Mark(min(m.calls for m in marks[0::2]), min(m.items for m in marks[0::2]))
                after = marks[-1]
            self.work_queue.after_save(checkpoint_step(path), tight, read_ahead, data_ended=data_ended,
                                       after=after)
            told.append(path)

        options = _telling(kwargs.pop("options", None), tell)
        ledger.serialized = []
        try:
            if options is None:  # a TensorFlow without write callbacks: tell after the save
                path = self.manager.save(checkpoint_number, **kwargs)
            else:
                path = self.manager.save(checkpoint_number, options=options, **kwargs)
            if not told:
                tell(path)
        finally:
            ledger.serialized = None
        return path

    def restore(self, path: Optional[str]) -> Any:
        """Restore ``checkpoint`` from ``path`` (``None``: start without one) and re-open the
        items that checkpoint does not cover. Returns the restore status (or ``None``)."""
        status = self.checkpoint.restore(path) if path else None
        self.work_queue.restore(checkpoint_step(path) if path else None)
        return status

    def restore_or_initialize(self) -> Optional[str]:
        """Restore the latest checkpoint, if any; returns its path."""
        path = self.manager.latest_checkpoint
        self.restore(path)
        return path

    def keras_callback(self, every_steps: int, step: Any = None) -> Any:
        """A Keras callback that saves every ``every_steps`` training batches and at the end of
        ``fit``, numbered with ``step`` (a variable; default ``model.optimizer.iterations``).
        The save at the end covers every item when ``fit`` ended because the queue ran out for
        this worker (not stopped early by a callback); with ``input_dataset(epochs="each")``
        it also saves at the end of each Keras epoch, which then covers every item of its pass."""
        import keras

        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be a positive int, got {every_steps!r}")
        manager = self

        class QueueCheckpoint(keras.callbacks.Callback):
            last: Optional[int] = None

            def _step(self) -> int:
                var = step if step is not None else self.model.optimizer.iterations
                return int(keras.ops.convert_to_numpy(var))

            last_ended = False

            def _save(self, data_ended: bool = False) -> None:
                now = self._step()
                if now != self.last or (data_ended and not self.last_ended):
                    manager.save(checkpoint_number=now, data_ended=data_ended)
                    self.last, self.last_ended = now, data_ended

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                if self._step() % every_steps == 0:
                    self._save()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                # The epoch ended because its data did (input_dataset(epochs="each"): one queue
                # epoch per Keras epoch): every record handed out was trained.
                if manager.work_queue.pass_ended and not self.model.stop_training:
                    self._save(data_ended=True)

            def on_train_end(self, logs: Any = None) -> None:
                self._save(data_ended=manager.work_queue.ledger.ended and not self.model.stop_training)

        return QueueCheckpoint()


class CheckpointListener(tf.compat.v1.train.CheckpointSaverListener):
    """TF1: makes a ``CheckpointSaverHook``'s saves mark done what they cover, stamped with the
    global step (made by :meth:`WorkQueue.checkpoint_listener`)::

        saver_hook = tf.compat.v1.train.CheckpointSaverHook(
            ckpt_dir, save_steps=100, listeners=[wq.checkpoint_listener()])
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=ckpt_dir, save_checkpoint_secs=None, chief_only_hooks=[saver_hook]) as sess:

    The hook saves once right after the session is created (restored or initialised): that
    first save tells the listener the step the model starts from, and it re-opens the items
    later checkpoints had covered (:meth:`WorkQueue.restore`). ``read_ahead`` as in
    :meth:`WorkQueue.after_save`; 0 only if the pipeline's iterator is saved in the checkpoint
    (``tf.data.experimental.make_saveable_from_iterator``)."""

    def __init__(self, work_queue: CheckpointedQueue, read_ahead: Optional[int] = None) -> None:
        need_checkpoint_mode(work_queue)
        self.work_queue = work_queue
        self._read_ahead = _check_read_ahead(read_ahead)
        self._restored = False
        self._before: Optional[Mark] = None
        self._last: Optional[tuple[int, Mark]] = None

    @property
    def read_ahead(self) -> int:
        """The read-ahead the next save assumes (the queue's default, as of now, unless given)."""
        return self.work_queue.default_read_ahead if self._read_ahead is None else self._read_ahead

    def before_save(self, session: Any, global_step_value: Any) -> None:
        if not self._restored:
            self.work_queue.restore(int(global_step_value))
            self._restored = True
        self._before = self.work_queue.before_save()

    def after_save(self, session: Any, global_step_value: Any) -> None:
        assert self._before is not None
        self.work_queue.after_save(int(global_step_value), self._before, self.read_ahead)
        self._last = (int(global_step_value), self._before)
        self._before = None

    def end(self, session: Any, global_step_value: Any) -> None:
        # The hook saved once more as the session closed; if the queue ran out for this worker
        # (the loop ended on OutOfRange), that checkpoint has seen every record.
        if self.work_queue.ledger.ended and self._last is not None:
            step, before = self._last
            self.work_queue.after_save(step, before, data_ended=True)


def _telling(options: Any, tell: Any) -> Any:
    """``options`` (a ``tf.train.CheckpointOptions`` or None) with ``tell`` as its first write
    callback, which ``tf.train.CheckpointManager.save`` runs before its own (the one that records
    the new checkpoint as the latest); None where this TensorFlow has no write callbacks."""
    options = copy.copy(options) if options is not None else tf.train.CheckpointOptions()
    if not hasattr(options, "experimental_write_callbacks"):
        return None
    options.experimental_write_callbacks = [tell, *(options.experimental_write_callbacks or [])]
    return options


def checkpoint_step(path: str) -> int:
    """The number a checkpoint's path ends with (``ckpt-120`` -> 120): the step it is stamped with."""
    m = re.search(r"-(\d+)$", path)
    if m is None:
        raise ValueError(f"checkpoint path {path!r} does not end with -<number>; save with a "
                         "tf.train.CheckpointManager or a Saver with global_step")
    return int(m.group(1))


def _bracket_iterators(checkpoint: Any, ledger: Ledger) -> None:
    """Mark the hand-out counters right before and after each ``tf.data`` iterator in
    ``checkpoint`` serializes its state, so that only hand-outs starting inside that short
    window are ambiguous, not those during the whole save. Wraps the iterator's
    ``_serialize_to_tensors`` (TensorFlow's checkpoint hook, private); if a TensorFlow version
    stops calling it, the whole save is the window again: more ambiguous hand-outs, never wrong."""
    try:
        objects = tf.train.TrackableView(checkpoint).descendants()
    except Exception:
        return
    for obj in objects:
        original = getattr(obj, "_serialize_to_tensors", None)
        if not isinstance(obj, tf.data.Iterator) or original is None or getattr(original, "_wq_sql", False):
            continue

        def serialize(original: Any = original) -> Any:
            marks = ledger.serialized
            if marks is not None:
                marks.append(ledger.mark())
            try:
                return original()
            finally:
                if marks is not None:
                    marks.append(ledger.mark())

        serialize._wq_sql = True  # type: ignore[attr-defined]
        obj._serialize_to_tensors = serialize


def _holds_iterator(checkpoint: Any) -> bool:
    """Whether a ``tf.data`` iterator is among the objects ``checkpoint`` saves."""
    try:
        objects = tf.train.TrackableView(checkpoint).descendants()
        return any(isinstance(obj, tf.data.Iterator) for obj in objects)
    except Exception:  # not a trackable object graph: assume no iterator (at least once)
        return False


def _check_read_ahead(read_ahead: Optional[int]) -> Optional[int]:
    """``read_ahead``: None (the queue's default at each save) or an int >= 0."""
    if read_ahead is not None and (isinstance(read_ahead, bool) or not isinstance(read_ahead, int)
                                   or read_ahead < 0):
        raise ValueError(f"read_ahead must be an int >= 0, got {read_ahead!r}")
    return read_ahead
