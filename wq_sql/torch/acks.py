"""The trainer side of :mod:`wq_sql.torch` (the main process): :class:`Acks` marks an item done
once the training step of the batch that carried its last record is over, which is when the
training loop asks for the next batch, in one transaction per ``ACK_SECONDS`` of training and at
the end of each pass; with ``consumed="checkpoint"`` it takes the trained items over into a
:class:`~wq_sql.worker.checkpoints.Ledger` instead, made done by the checkpoint that covers them.
:func:`main_queue` is the rank's own queue object. The loader side is :mod:`wq_sql.torch.claiming`;
the protocol between the two is described there."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Optional

from wq_sql.queue import WorkQueue
from wq_sql.store.lineage import Steps
from wq_sql.torch.claiming import Lineage, Notes, QueueConfig
from wq_sql.worker.checkpoints import Ledger, Mark

log = logging.getLogger("wq_sql")

ACK_SECONDS = 0.2  # the trainer side sends its acknowledgements at most this often (and at pass ends)
ACK_ITEMS = 4096  # ... or when this many are waiting (items, and lineage rows)
"""The items whose last record went into one batch, as ``consumed="trained"`` sends them to the
trainer: who claimed them (a ``WorkQueue.worker_id``) then each one's ``(id, token)``, flat:
``(holder, id, token, id, token, ...)``, ``()`` for none. All the acknowledgement needs, and the
cheapest to pickle: a batch's ``Handed`` objects (two per item, with the work string twice)
cost more to pickle and to load, every batch."""
StepNote = tuple[int, Lineage]  # a training step's number and its batch's lineage


class Acks:
    """The trainer side (see the module docstring): one per DataLoader, in the main process.
    ``checkpoint``: trained items are held until a checkpoint covers them, not marked done."""

    def __init__(self, queue: WorkQueue, checkpoint: bool = False) -> None:
        self.queue = queue
        # One ledger per trainer-side queue object: what the rank identity holds, whichever of
        # this process's DataLoaders trained it (a restore gives all of it back).
        self.ledger: Optional[Ledger] = _ledgers.setdefault(queue, Ledger()) if checkpoint else None
        self.current: Notes = ()  # the batch yielded last: its training step is not over
        self.current_steps: Optional[StepNote] = None  # and its lineage, with lineage on
        self.saving: Optional[tuple[int, Mark]] = None  # a save point whose checkpoint is being saved
        # Trained, not yet sent: Keys per batch (consumed="trained", grouped by the sender, off
        # the training loop's thread), else Handed per item; and how many items that is.
        self._due: list[Any] = []
        self._due_n = 0
        # Lineage of the batches trained, not yet sent, and the run its rows go under (the rank's
        # next one, asked for at the first send; a restore starts a new one).
        self._steps_due: list[StepNote] = []
        self._run: Optional[int] = None
        self._sent = time.monotonic()
        self.acknowledged = 0
        # consumed="trained": a pass's periodic acknowledgements, sent by one background thread
        # in order (see _send_soon); made at the first, in the process that uses it.
        self._sender: Optional[ThreadPoolExecutor] = None
        self._sending: deque[Future[None]] = deque()
        if checkpoint:
            _at_exit_saved()

    def yielded(self, handed: Notes, steps: Optional[StepNote] = None) -> None:
        """A new batch is handed to the training loop: the step of the one before is over.
        ``steps``: the new batch's step and lineage, with lineage on."""
        last, self.current = self.current, handed
        last_steps, self.current_steps = self.current_steps, steps
        self.trained(last, last_steps)

    def trained(self, handed: Notes, steps: Optional[StepNote] = None) -> None:
        """The training step of the batch that carried these items is over. Checkpoint mode
        takes them over only at save points and pass ends (or ``ACK_ITEMS`` at a time): until
        then the loaders that read them hold and renew them, and a crash returns them the same.
        ``steps``: that step's lineage, sent with the acknowledgements."""
        if steps is not None:
            self._steps_due.append(steps)
            self._due_n += len(steps[1]) // 3
        if handed:
            if isinstance(handed, tuple):
                self._due.append(handed)
                self._due_n += len(handed) // 2
            else:
                self._due.extend(handed)
                self._due_n += len(handed)
        while self._sending and self._sending[0].done():
            self._sending.popleft().result()  # a background acknowledgement's error, if any
        if (self._due or self._steps_due) and (self._due_n >= ACK_ITEMS
                          or (self.ledger is None and time.monotonic() - self._sent >= ACK_SECONDS)):
            if self.ledger is None:
                self._send_soon()
            else:
                self.flush()

    def _send_soon(self) -> None:
        """consumed="trained", during a pass: the acknowledgement's transaction runs in a
        background thread, one at a time and in order, so that the training loop does not wait
        for its commit (on Postgres a WAL flush, a wait for the disk). :meth:`flush` (a pass's
        end or break) waits for them; an error is raised by the next call here or there."""
        self._sent = time.monotonic()
        due, self._due, self._due_n = self._due, [], 0
        steps, self._steps_due = self._steps_due, []
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wq_sql-acks")
        self._sending.append(self._sender.submit(self._send, due, steps))

    def flush(self) -> None:
        """Mark done now what the trainer consumed (checkpoint mode: hold it, for the ledger),
        once the acknowledgements sent in the background are done."""
        while self._sending:
            self._sending.popleft().result()
        self._sent = time.monotonic()
        if not self._due and not self._steps_due:
            return
        due, self._due, self._due_n = self._due, [], 0
        steps, self._steps_due = self._steps_due, []
        self._send(due, steps)

    def _lineage(self, notes: list[StepNote]) -> Optional[Steps]:
        """The rows of ``notes`` (a step's lineage each) under this rank's run."""
        if not notes:
            return None
        if self._run is None:
            self._run = self.queue.next_lineage_run()
        rows = [(step, k // 3, flat[k], flat[k + 1], flat[k + 2])
                for step, flat in notes for k in range(0, len(flat), 3)]
        return Steps(self.queue.worker, self._run, rows)

    def _send(self, due: list[Any], notes: list[StepNote]) -> None:
        """``due``: what :meth:`trained` gathered, Keys per batch or Handed per item; ``notes``:
        the lineage of the steps trained, written in the same transaction."""
        steps = self._lineage(notes)
        by_holder: dict[int, list[Any]] = defaultdict(list)
        n = 0
        for note in due:
            if isinstance(note, tuple):
                keys = by_holder[note[0]]
                keys.extend(zip(note[1::2], note[2::2]))
                n += len(note) // 2
            else:
                by_holder[note.holder].append(note.item)
                n += 1
        if self.ledger is None:
            self.acknowledged += n - len(self.queue.complete_handed(by_holder, steps))
        else:
            lost = self.queue.adopt_handed(by_holder, steps)
            gone = {id(i) for i in lost}
            self.ledger.finish(self.ledger.start(), [h.item for h in due if id(h.item) not in gone])
            self.acknowledged += n - len(lost)

    def save_point(self, step: int) -> tuple[list[int], int]:
        """``state_dict()`` at ``step``: every batch yielded so far is trained; what it carried is
        covered once :meth:`saved` says the checkpoint holding the state was saved. Returns the
        ids of the items the save covers (the state keeps them: see :meth:`restore`) and the
        queue's event mark at the save (``WorkQueue.reopen_after``'s ``since``)."""
        assert self.ledger is not None
        self.yielded(())
        self.flush()
        mark = self.ledger.mark()
        self.saving = (step, mark)
        _save_points.add(self)  # held until saved, even if the DataLoader is dropped first
        return sorted(i.item_id for i in self.ledger.covered(mark, mark, 0)[0]), self.queue.event_mark()

    def saved(self) -> int:
        """The checkpoint of the last save point was saved: its items are done. Returns how many."""
        if self.saving is None or self.ledger is None:
            return 0
        (step, mark), self.saving = self.saving, None
        _save_points.discard(self)
        done, _ = self.ledger.cover(self.queue, step, mark, mark, 0)
        return done

    def restore(self, step: Optional[int], saved: Sequence[int], *, writer: Optional[str] = None,
                departed: Sequence[Restored] = (), since: Optional[int] = None,
                staying: Optional[Collection[str]] = None) -> int:
        """The model was restored from the checkpoint at ``step``, whose state says it covers the
        items ``saved`` (ids): those of them this rank still holds (the process crashed before it
        learnt the checkpoint was saved, or this one restores it) become done now; the rest it
        holds (trained since, or recovered from a crashed predecessor) go back to the queue, and
        so do the items its later checkpoints had covered. ``writer``: the identity that saved
        the state, if another (a new job run): its later checkpoints are forgotten too, and the
        items the state lists that it still holds (or that went back to the queue when it was
        found dead) become done. ``departed``: the states of ranks that did not come back,
        restored with this one, each the same way; ``since``/``staying``: see
        ``WorkQueue.reopen_after``. Returns how many items went back."""
        assert self.ledger is not None
        self.saving = None
        _save_points.discard(self)
        self.yielded(())
        self.flush()
        self._run = None  # the restored model's steps are numbered again: a new run of lineage
        me = self.queue.worker
        other = writer if writer is not None and writer != me else None
        n = self.queue.reopen_after(step, writer=other, departed=[(d.worker, d.step) for d in departed],
                                    since=since, staying=staying)
        mark = self.ledger.mark()
        held, _ = self.ledger.covered(mark, mark, 0)
        self.ledger.forget(held)
        while self.queue.buffered:  # recovered from a crashed predecessor of this identity
            held += self.queue.take_many(self.queue.buffered, timeout=0)
        covers = set(saved)
        if step is not None and any(i.item_id in covers for i in held):
            self.queue.cover([i for i in held if i.item_id in covers], step)
        for item in held:
            if item.item_id not in covers or step is None:
                self.queue.release(item)
                n += 1
        # Another identity's state (a new run id; the departed ranks'): what it lists that its
        # process held when it was killed becomes done; the rest it and its DataLoader workers
        # held goes back now (no pass waits for items other workers hold).
        others = [(d.worker, d.step, d.items) for d in departed]
        if other is not None:
            others.append((other, step, list(covers)))
        for name, at, listed in others:
            if name == me:
                continue
            if at is not None:
                self.queue.cover_listed(name, list(listed), at)
            n += self.queue.return_lost(lineage=name)
        return n


class Restored(NamedTuple):
    """A loader state another rank saved, restored with this rank's: its identity, its step and
    the items its checkpoint covers."""

    worker: str
    step: Optional[int]
    items: Sequence[int]


_ledgers: weakref.WeakKeyDictionary[WorkQueue, Ledger] = weakref.WeakKeyDictionary()
_save_points: set[Acks] = set()  # those with a save point whose checkpoint is being saved
_saved_hooked: set[int] = set()


def _saved_at_exit() -> None:
    """A normal exit after ``state_dict()``: the checkpoint it went into was saved (an
    unhandled exception, which may have interrupted the save, leaves ``sys.last_value``)."""
    if getattr(sys, "last_value", None) is not None:
        return
    for acks in list(_save_points):
        try:
            acks.saved()
        except Exception as e:  # the database is away: the items stay held, then go back
            log.warning("queue %r: could not mark the last checkpoint's items done: %s", acks.queue.name, e)


def _at_exit_saved() -> None:
    """Once per process, after wq_sql's own exit hook was registered (so it runs before the
    queue objects close and give back what they hold)."""
    if os.getpid() not in _saved_hooked:
        _saved_hooked.add(os.getpid())
        atexit.register(_saved_at_exit)


def give_back_recovered(queue: WorkQueue) -> int:
    """Release what ``queue`` (a rank's trainer side, which never takes items) took back at start
    from a crashed predecessor of its identity: trained, not covered by a checkpoint."""
    n = 0
    while queue.buffered:
        for item in queue.take_many(queue.buffered, timeout=0):
            queue.release(item)
            n += 1
    return n


_mains: dict[tuple[int, tuple[str, str, Optional[str]], str], WorkQueue] = {}


def main_queue(config: QueueConfig, worker: str, create: Optional[dict[str, Any]] = None) -> WorkQueue:
    """This process's queue object for the trainer side, under ``worker`` (one per process, queue
    and identity: two objects of one identity in one process would conflict). ``create``: the
    arguments that create the queue if it does not exist yet (works, num_epochs, ...)."""
    key = (os.getpid(), config.key(), worker)
    q = _mains.get(key)
    if q is not None:
        return q
    if create is None:
        q = config.open(worker)
    else:
        q = WorkQueue(name=config.name, url=config.url, schema=config.schema, worker=worker,
                      auto_complete=False, lease_ahead=config.lease_ahead, **create, **config.options)
    _mains[key] = q
    return q


def close_main_queue(config: QueueConfig, worker: str) -> None:
    q = _mains.pop((os.getpid(), config.key(), worker), None)
    if q is not None:
        # A state taken, not known saved, when its dataset is closed: the exit hook leaves it
        # alone (a restore of that state covers what it lists).
        for acks in [a for a in _save_points if a.queue is q]:
            _save_points.discard(acks)
        q.close()


