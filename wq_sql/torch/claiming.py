"""The loader side of :mod:`wq_sql.torch`, and the protocol between the two sides (no torch
import here; the trainer side is :mod:`wq_sql.torch.acks`).

Two sides, usually in different processes:

- **Loader side** (a DataLoader worker process; the main process with ``num_workers=0`` and for
  :class:`~wq_sql.torch.QueueSampler`): a :class:`Loader` per process claims the items of each
  pass (:meth:`Loader.next_item`), notes when the last record of an item was handed to the
  DataLoader (:meth:`Loader.read_out`), and gives the notes of the items whose last record is in
  a batch to that batch (:meth:`Loader.drain`): their :data:`Keys` (``consumed="trained"``),
  or a list of :class:`Handed` (``consumed="checkpoint"``, whose trainer side adopts the items
  themselves). The loader never
  marks an item done, so its read-ahead (DataLoader prefetch, workers running ahead) never does.
- **Trainer side** (the main process): :class:`Acks` marks an item done once the training step of
  the batch that carried its last record is over, which is when the training loop asks for the
  next batch (:meth:`Acks.trained`), in one transaction per ``ACK_SECONDS`` of training and at the
  end of each pass (:meth:`Acks.flush`).

Until then an item stays claimed by the loader's worker identity, whose heartbeat renews it: the
loader keeps the items it handed out in its queue object's book and lets go of those the trainer
completed (:meth:`Loader.drain` looks every ``PRUNE_SECONDS``), and of the rest when its process
ends (``WorkQueue.hand_off``). A crash re-delivers what was not acknowledged: to the restarted
process of the same identity first, else once its worker is known to be gone or its lease ran out.

**Checkpoint-consistent consumption** (``consumed="checkpoint"``): the trainer side does not mark
trained items done but takes them over (``WorkQueue.adopt_handed``: still claimed, same token,
now held and renewed by the rank's own identity) into a :class:`~wq_sql.worker.checkpoints.Ledger`, the
core's book of what a checkpoint covers (the TF shim keeps the same). ``DataLoader.state_dict()``
takes a save point (:meth:`Acks.save_point`: every batch yielded so far counts as trained, as
torchdata's ``StatefulDataLoader`` state says); once the checkpoint holding that state is saved
(:meth:`Acks.saved`: the loop asks for the next batch, a new pass begins, ``checkpoint_saved()``,
or the process exits normally) its items become done, stamped with the loader's step
(``WorkQueue.cover``). ``load_state_dict`` gives back what the rank held uncovered and re-opens
what later checkpoints of the rank had covered (:meth:`Acks.restore`, ``WorkQueue.reopen_after``).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import socket
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Optional, Union

from sqlalchemy.engine import make_url

from wq_sql.errors import InvalidInput, QueueEmpty, QueueExhausted
from wq_sql.queue import WorkItem, WorkQueue, prepare_children
from wq_sql.worker.sizing import first_claim, hand_out_size

log = logging.getLogger("wq_sql")

PRUNE_SECONDS = 1.0  # the loader side looks this often which of its handed-out items are done
PRUNE_ITEMS = 64  # ... once it holds at least this many


@dataclass(frozen=True)
class QueueConfig:
    """What a process needs to open the queue on its own (picklable: no engine, no connection)."""

    name: str
    url: str
    schema: Optional[str] = None
    lease_ahead: Optional[int] = None  # None: sized by the core (sizing.Sizer)
    options: dict[str, Any] = field(default_factory=dict)  # lease_seconds=, heartbeat_seconds=, ...

    def open(self, worker: str, *, auto_complete: bool = False, inline: bool = False) -> WorkQueue:
        """``inline``: a loader's queue object, which claims in the caller's thread on SQLite
        (``claim_ahead=False`` unless the options say otherwise; see ``Loader``)."""
        options = self.options
        if inline and self.in_process():
            options = {"claim_ahead": False, **options}
        return WorkQueue.attach(self.name, url=self.url, schema=self.schema, worker=worker,
                                auto_complete=auto_complete, lease_ahead=self.lease_ahead, **options)

    def in_process(self) -> bool:
        """Whether a claim round is this process's own work (SQLite: the database is a library
        in it), not a wait for a server."""
        return make_url(self.url).get_backend_name() == "sqlite"

    def key(self) -> tuple[str, str, Optional[str]]:
        return (self.url, self.name, self.schema)

    def prepare_children(self) -> None:
        """Make the engine that forked DataLoader workers open the queue with, here, once
        (``wq_sql.queue.prepare_children``: no connection crosses the fork)."""
        prepare_children(self.url, schema=self.schema, busy_timeout=self.options.get("busy_timeout", 30.0))


def rank_name(worker: Optional[str] = None) -> str:
    """The worker identity of this rank's main process: ``worker`` if given, else built from
    ``$WQ_SQL_WORKER``, ``$TORCHELASTIC_RUN_ID`` (unless ``none``) and ``$RANK``, joined with ``/``:
    ``job-7/rank1``, ``rank1``; else ``host:pid`` (not stable across restarts). DataLoader workers
    append ``/loader<k>``, the sampler ``/sampler``."""
    if worker is not None:
        return worker
    parts = []
    job = os.environ.get("WQ_SQL_WORKER") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job and job != "none":
        parts.append(job)
    rank = os.environ.get("RANK")
    if rank:
        parts.append(f"rank{rank}")
    return "/".join(parts) if parts else f"{socket.gethostname()}:{os.getpid()}"


def torch_run() -> Optional[tuple[str, int]]:
    """This process's job run, for ``WorkQueue(run=...)``: ``($TORCHELASTIC_RUN_ID,
    $TORCHELASTIC_RESTART_COUNT)`` under torchrun (the restart count is 0 at first and grows each
    time torchrun restarts every rank), else None. Workers of a later restart return the items of
    the earlier restarts' workers at once, whatever their ranks (RANK is not stable across
    restarts, and the world size may change)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    if not run_id or run_id == "none" or not restart.isdigit():
        return None
    return (run_id, int(restart))


Keys = tuple[int, ...]
@dataclass(frozen=True)
class Handed:
    """An item whose last record went into a batch: who claimed it (``holder``, a
    ``WorkQueue.worker_id``) and which hand-out it is (the ``WorkItem``, picklable)."""

    holder: int
    item: WorkItem

    def __reduce__(self) -> Any:
        # Positional, not a dataclass's default state dict: every batch carries its items from
        # the worker process to the trainer.
        return (Handed, (self.holder, self.item))


Notes = Union[Keys, list[Handed]]  # what one batch carries to the trainer (Loader.drain)
Lineage = tuple[int, ...]
"""Lineage of one batch (``Loader.take_lineage``): ``(item id, first record, last record, ...)``
flat, in the order the batch holds them."""


class Loader:
    """The loader side in one process (see the module docstring): one queue worker identity,
    opened at its first pass and kept until the process ends (persistent DataLoader workers and the
    main process run many passes on it), one pass at a time, in one thread.

    A pass (:meth:`start`) hands out the items of epochs up to ``epoch_limit`` (``None``: any) and
    ends for this loader as soon as nothing of it is claimable: it never waits for items other
    workers hold (they are being read or trained; a crashed worker's come back to its restarted
    process first, or to a later pass). Items of a later epoch that it claimed, and an item a
    pass abandoned halfway, are kept for the next pass, which hands them out first (still claimed
    and renewed meanwhile); leaving the process gives them back (:meth:`close`)."""

    def __init__(self, config: QueueConfig, worker: str, complete_read: bool = False,
                 keys: bool = False, lineage: bool = False) -> None:
        self.queue = config.open(worker, auto_complete=complete_read, inline=not complete_read)
        # Claim rounds in a background thread (the refill thread, kicked after each hand-out) only
        # where a round waits for a server (Postgres), which the reading then overlaps. On SQLite
        # a round is CPU work of this process: another thread only moves it, at the price of two
        # rounds for one (half a round inline, the rest in the background) and the thread's
        # switches; a DataLoader worker reading files is CPU-bound, so inline it makes about half
        # the rounds for less CPU.
        # (consumed="taken" is left as it was: one item claimed per take, the core's claim-ahead.)
        self.ahead = not complete_read and not config.in_process()
        self.inline = not complete_read and config.in_process()
        # consumed="taken": DeepRec's rule, an item is done when the next one is taken; one item
        # per take then, and a later epoch's item goes straight back to the queue.
        self.complete_read = complete_read
        self.keys = keys  # drain() gives Keys (consumed="trained"), else Handed
        self.pid = os.getpid()
        self.epoch_limit: Optional[int] = None
        self.ended = True  # the pass ran out of items (False while it runs, and if abandoned)
        self.delivered = 0  # items of this pass whose every record was handed out
        self.beyond: Optional[int] = None  # the epoch of a later item the pass met, if any
        self.closed = False
        self._ready: deque[WorkItem] = deque()  # taken from the queue object, not yet read
        self._carry: list[WorkItem] = []  # taken, of an epoch after this pass's: the next pass's
        self._current: Optional[WorkItem] = None  # being read
        self._pending: list[WorkItem] = []  # every record handed to the DataLoader, not yet in a batch
        self._handed: list[WorkItem] = []  # in a batch, maybe not yet acknowledged by the trainer
        self._last_seq: dict[int, int] = {}  # highest seq taken per epoch: bounds the claim size
        # Lineage: the items whose records went to the DataLoader and are not all in a batch yet,
        # in the order they were read, each [item id, records in batches, records (None: being
        # read, count unknown)] (see take_lineage).
        self.lineage = lineage
        self._segments: deque[list[Any]] = deque()
        self._pruned = time.monotonic()
        _at_exit()
        _open.add(self)

    def start(self, epoch_limit: Optional[int]) -> None:
        """Begin a pass. What the previous one left comes first: the items whose batches the
        trainer did not finish (the pass was abandoned: they are still claimed by this loader,
        unacknowledged), an item it was reading, and the later epoch's items it took. Records it
        handed out that never went into a batch were dropped by the DataLoader (``drop_last``) if
        it ended normally: those items are done; if it was abandoned, they are read again."""
        if self._handed:
            # The trainer side acknowledges every finished step before the next pass begins
            # (wq_sql.torch.DataLoader flushes when a pass ends or is left).
            unfinished = self.queue.still_held(self._handed)
            kept = {id(i) for i in unfinished}
            self.queue.hand_off([i for i in self._handed if id(i) not in kept])
            self._handed = []
            self._carry[:0] = unfinished
        self._ready.extendleft(reversed(self._carry))
        self._carry = []
        if self._pending:
            if self.ended:
                for item in self._pending:
                    self.queue.complete(item)
            else:
                self._ready.extendleft(reversed(self._pending))
            self._pending = []
        if self._current is not None:
            self._ready.appendleft(self._current)
            self._current = None
        self.epoch_limit = epoch_limit
        self.ended = False
        self.delivered = 0
        self.beyond = None
        self._segments.clear()  # records not in a batch were dropped (drop_last) or are read again

    def next_item(self) -> Optional[WorkItem]:
        """The next item of this pass, or ``None`` at its end."""
        while True:
            while self._ready:
                item = self._ready.popleft()
                if self.epoch_limit is not None and item.epoch > self.epoch_limit:
                    self._later(item)
                    continue
                self._current = item
                return item
            if self.ended or self.beyond is not None:
                self.ended = True
                return None
            q = self.queue
            try:
                # With an empty buffer, claim one hand-out's worth; the refill thread claims the
                # rest while these are read, and tops the buffer up after each hand-out. Inline
                # (no refill thread), a whole round (the claim-ahead rule: wq_sql.worker.sizing).
                claim = (self._claim_size() if self.inline
                         else min(first_claim(self._chunk), self._claim_size()))
                got = q.take_many(self._chunk, timeout=0, claim=claim)
            except (QueueEmpty, QueueExhausted):
                got = self._last_take()
                if not got:
                    self.ended = True
                    return None
            if self.ahead:
                q.refill_soon(self._chunk)
            for item in got:
                self._last_seq[item.epoch] = max(item.seq, self._last_seq.get(item.epoch, -1))
            self._ready.extend(got)

    @property
    def _chunk(self) -> int:
        """Items per take: a hand-out of the claim-ahead rule (``sizing.hand_out_size``: half a
        round of the size in force, which the core may resize), so that the refill thread claims
        the other half while these are read (inline, the other half waits in the buffer: two
        hand-outs per round let the automatic size grow twice as fast); one with
        consumed='taken'."""
        return 1 if self.complete_read else hand_out_size(self.queue.lease_ahead)

    def _last_take(self) -> list[WorkItem]:
        """Nothing was claimable: stop the refill thread, then take what a refill in flight
        claimed meanwhile (never leave an item in a buffer nobody looks at). Only from
        the buffer: another claim round (with the end-of-queue reads and the expiry sweep that
        follow an empty one) would cost each worker a few milliseconds at each pass end."""
        q = self.queue
        q.stop_refills()
        if not q.buffered:
            return []
        try:
            return q.take_many(self._chunk, timeout=0, claim=1)
        except (QueueEmpty, QueueExhausted):
            return []

    def _later(self, item: WorkItem) -> None:
        """An item of a later epoch than this pass's: the next pass's (or, consumed='taken',
        the queue's again: its next take would mark it done)."""
        self.beyond = item.epoch if self.beyond is None else min(self.beyond, item.epoch)
        if self.complete_read:
            self.queue.release(item)
        else:
            self._carry.append(item)

    def _claim_size(self) -> int:
        """Near the end of the pass's last epoch, claim no more than that epoch can still have
        pending after the highest seq this loader took, so that few items of the next epoch wait
        in this loader for its next pass (claims go in (epoch, seq) order)."""
        q = self.queue
        if self.epoch_limit is None or self.epoch_limit not in self._last_seq:
            return q.lease_ahead
        return max(1, min(q.lease_ahead, q.items_per_epoch - 1 - self._last_seq[self.epoch_limit]))

    def begin(self, item: WorkItem, records: Optional[int]) -> None:
        """Lineage: the records of ``item`` go to the DataLoader next (``records``: how many, if
        known now; else :meth:`read_out` says)."""
        self._segments.append([item.item_id, 0, records])

    def read_out(self, item: WorkItem, records: Optional[int] = None) -> None:
        """Every record of ``item`` was handed to the DataLoader (call it before yielding the last
        one, so that the batch that holds it carries the item); ``records``: how many, for
        lineage, if :meth:`begin` did not know."""
        if records is not None and self._segments and self._segments[-1][2] is None:
            self._segments[-1][2] = records
        self._current = None
        self.delivered += 1
        if not self.complete_read:
            self._pending.append(item)

    def empty(self, item: WorkItem) -> None:
        """``item`` has no record: nothing for the trainer to wait for, so it is done now."""
        if self._segments and self._segments[-1][0] == item.item_id and self._segments[-1][2] is None:
            self._segments.pop()
        self._current = None
        self.delivered += 1
        if not self.complete_read:
            self.queue.complete(item)

    def failed(self, item: WorkItem, error: BaseException) -> None:
        """Reading ``item`` raised: an attempt is counted (``failed`` after ``max_attempts``)."""
        self._current = None
        try:
            self.queue.fail(item, f"{type(error).__name__}: {error}")
        except Exception as e:  # the database is away too: the lease brings it back
            log.warning("queue %r: could not record the failure of %r: %s", self.queue.name, item, e)

    def drain(self) -> Notes:
        """The items whose last record is in the batch being made: it carries them to the trainer,
        as :data:`Keys` if the loader was made with ``keys=True``, else as :class:`Handed`."""
        if not self._pending:
            return () if self.keys else []
        out, self._pending = self._pending, []
        self._handed.extend(out)
        now = time.monotonic()
        if len(self._handed) >= PRUNE_ITEMS and now - self._pruned >= PRUNE_SECONDS:
            self._pruned = now
            held = self.queue.still_held(self._handed)
            kept = {id(i) for i in held}
            self.queue.hand_off([i for i in self._handed if id(i) not in kept])
            self._handed = held
        holder = self.queue.worker_id
        if self.keys:
            return (holder, *chain.from_iterable((i.item_id, i.token) for i in out))
        return [Handed(holder, i) for i in out]

    def take_lineage(self, n: int) -> Lineage:
        """Lineage: the batch being made holds the next ``n`` records handed to the DataLoader
        (it takes them in order, from this process's stream): which items and record ranges."""
        out: list[int] = []
        segments = self._segments
        while n > 0 and segments:
            seg = segments[0]
            item_id, done, total = seg
            k = n if total is None else min(n, total - done)  # the last segment may be being read
            out += (item_id, done, done + k - 1)
            seg[1] = done + k
            n -= k
            if total is not None and seg[1] >= total:
                segments.popleft()
        if n > 0:
            raise RuntimeError(f"wq_sql lineage: a batch holds {n} record(s) more than this loader handed "
                               "to the DataLoader; lineage needs the dataset's records batched as they are "
                               "yielded (no sampler, no dataset wrapper that drops or adds records)")
        return tuple(out)

    def close(self) -> None:
        """The process is leaving (or the dataset is closed): the items in batches stay claimed
        for the trainer's acknowledgements; records handed out but never put in a batch were
        dropped by the DataLoader (``drop_last``) if the pass ended normally (done), else they go
        back to the queue with everything claimed but not delivered (no attempt counted)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        q = self.queue
        try:
            q.hand_off(self._handed)
            if self.ended and not self.complete_read:
                for item in self._pending:
                    q.complete(item)
            q.close()
        except Exception as e:  # the database is away: leases and same-identity recovery cover it
            log.warning("queue %r: worker %r could not leave cleanly: %s", q.name, q.worker, e)


_open: weakref.WeakSet[Loader] = weakref.WeakSet()
_exit_hooked: set[int] = set()


def _finish_open() -> None:
    """At exit, leave the queue (see :meth:`Loader.close`)."""
    for loader in list(_open):
        loader.close()


def _at_exit() -> None:
    """Once per process: end open passes at exit. A DataLoader worker leaves through
    ``os._exit`` after multiprocessing's own exit hooks (``Finalize``), which run no ``atexit``
    handler; the main process runs ``atexit`` (this one before wq_sql's own, which would give
    back the items whose batches the trainer may still acknowledge)."""
    pid = os.getpid()
    if pid in _exit_hooked:
        return
    _exit_hooked.add(pid)
    multiprocessing.util.Finalize(None, _finish_open, exitpriority=10)
    atexit.register(_finish_open)


def check_epochs(epochs: str) -> str:
    if epochs not in ("each", "all"):
        raise InvalidInput(f"epochs must be 'each' (a pass per epoch) or 'all' (DeepRec: one pass over "
                           f"every epoch), got {epochs!r}")
    return epochs


def check_consumed(consumed: str) -> str:
    if consumed not in ("trained", "checkpoint", "taken"):
        raise InvalidInput(f"consumed must be 'trained' (done when the training step that used its last "
                           f"record is over; needs wq_sql.torch.DataLoader), 'checkpoint' (done when a "
                           f"checkpoint holding the loader's state_dict() covers it; needs "
                           f"wq_sql.torch.DataLoader) or 'taken' (DeepRec: done when the loader takes the "
                           f"next item), got {consumed!r}")
    return consumed
