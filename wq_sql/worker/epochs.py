"""Who makes a queue's next epoch, and when: the worker that claims an epoch's first item, in a
background thread, a chunk of rows per transaction (the rows themselves: ``statements.advance_epoch``).
One :class:`EpochMaker` per queue object; it knows how many epochs are complete (``created``)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from sqlalchemy import Connection

from wq_sql.plan import SHUFFLE_SLICE, epoch_order
from wq_sql.store import statements
from wq_sql.store.db import Db

log = logging.getLogger("wq_sql")

# The background maker pauses this many times its chunk's time (at least MAKER_PAUSE_MIN
# seconds) after each chunk: it holds SQLite's write lock at most a tenth of the time.
MAKER_PAUSE, MAKER_PAUSE_MIN = 9.0, 0.01
# Between two slices of its shuffle (plan.epoch_order's breathe), the background maker waits up
# to SHUFFLE_WAIT seconds while a write transaction of its process is in flight, then sleeps
# SHUFFLE_BREATHE seconds: the worker's other threads get the GIL after every slice, not only
# at Python's switch interval, and no transaction of its process holds SQLite's writers' queue
# while it waits for the GIL.
SHUFFLE_WAIT, SHUFFLE_BREATHE = 0.05, 50e-6


@dataclass(frozen=True)
class Order:
    """What an epoch's permutation depends on (``plan.epoch_order``)."""

    qid: int
    items_per_epoch: int
    shuffle: bool
    seed: int
    weighted: bool = False  # drawn from sources inside its one transaction: no order here


class EpochMaker:
    """Makes the epochs of one queue: after a claim (:meth:`after_claim`), in a background
    thread, or from ``take()`` when nothing is pending (:meth:`make`). ``created`` is the number
    of complete epochs as last seen; ``num_epochs()`` the queue's current count (it may grow);
    ``made()`` is called after each chunk, so a take waiting for rows claims them at once."""

    def __init__(self, db: Db, order: Order, created: int, num_epochs: Callable[[], int],
                 made: Callable[[], None], label: str) -> None:
        self.db, self.order, self.created = db, order, created
        self.chunk = db.dialect.epoch_chunk
        self._num_epochs, self._made, self._label = num_epochs, made, label
        self._thread: Optional[threading.Thread] = None
        # (epoch, its order) being made here; the order None: drawn in advance_epoch (weighted)
        self._making: Optional[tuple[int, Optional[Sequence[int]]]] = None
        self._up_to = -1  # the background maker makes epochs up to this one
        self._leaving = threading.Event()  # the queue is closing: stop between chunks

    def after_claim(self, got: Sequence[statements.Claimed]) -> None:
        """The worker that claims the first item (``seq`` 0) of epoch ``e`` makes epoch ``e + 1``,
        in a background thread, so that no ``take()`` waits for it: exactly one worker per epoch
        (unless that item is claimed again after a lease expired), and one permutation computed,
        not one per worker (a million-work permutation is most of a second of Python)."""
        firsts = [g.epoch for g in got if g.seq == 0]
        if firsts:
            self.soon(max(firsts) + 1)

    def soon(self, epoch: int) -> None:
        """Make epochs up to ``epoch`` in a background thread (one per queue object). If it
        fails or stops, ``take()`` makes what is missing once nothing else is pending."""
        if epoch >= self._num_epochs():
            return
        self._up_to = max(self._up_to, epoch)
        t = self._thread
        if t is not None and t.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name=f"wq_sql-next-epoch-{self._label}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """The queue is closing: the background maker stops after its chunk in flight commits."""
        t = self._thread
        if t is not None:
            self._leaving.set()
            t.join(timeout=timeout)

    def forget_thread(self) -> None:
        """After ``fork()``: the parent's thread does not exist in the child."""
        self._thread = None

    def _run(self) -> None:
        try:
            self.make(background=True)
        except Exception as e:  # take() makes the epoch itself when it needs it
            log.warning("queue %r: making the next epoch in the background failed (%s: %s); take() "
                        "will make it when it needs it", self._label, type(e).__name__, str(e)[:200])

    def make(self, *, background: bool = False) -> bool:
        """Make the next epoch, ``epoch_chunk`` rows per transaction (``statements.advance_epoch``), so
        that no claim waits long for SQLite's write lock or behind Postgres' WAL. True if rows
        were made or the count of complete epochs changed.

        In the background (:meth:`soon`): every epoch up to ``_up_to``, pausing after each chunk
        for nine times its time (``MAKER_PAUSE``) so that other workers' claims get the lock
        between chunks. It waits while an earlier epoch is being made by another worker, and
        leaves an epoch that another worker started to that worker. From ``take()`` with nothing
        pending: one chunk of the next epoch, whoever started it (its maker may have died), then
        the rest in the background."""
        db, o = self.db, self.order
        qid = o.qid
        made_rows = False
        while self.created < self._num_epochs() and not self._leaving.is_set():
            have = self.created
            if background and have > self._up_to:
                return made_rows
            making = self._making  # one read: the background maker may reset it meanwhile
            if making is None or making[0] != have:
                # Not ours yet: look before computing the order (O(n) Python). Once it is ours,
                # statements.advance_epoch's own checks suffice (None: made meanwhile, or locked).
                created, made = db.tx(functools.partial(_epoch_state, qid=qid, epoch=have), read=True)
                if created != have:
                    self.created = created
                    if not background:
                        return True
                    continue
                if background and made > 0:
                    if have == self._up_to:
                        return made_rows  # another worker is making it
                    self._leaving.wait(0.05)  # an earlier epoch is being made: wait for it
                    continue
                # An epoch of one shuffle slice is under a millisecond of Python: no pauses (a pause
                # waits up to SHUFFLE_WAIT, time in which a small epoch's workers drained the
                # current epoch and a take(timeout=0) found the next one not made yet).
                breathe = self._breathe if background and o.items_per_epoch > SHUFFLE_SLICE else None
                try:
                    # A weighted epoch is drawn inside advance_epoch's transaction: no order here.
                    order: Optional[Sequence[int]] = None if o.weighted else epoch_order(
                        o.items_per_epoch, have, o.shuffle, o.seed, breathe=breathe)
                except _Leaving:
                    return made_rows
                self._making = (have, order)
            else:
                order = making[1]
            t = time.monotonic()
            new = db.tx(functools.partial(statements.advance_epoch, qid=qid, have=have, chunk=self.chunk,
                                          order=order))
            if new is None:  # another worker holds the queue row (Postgres) or completed the epoch
                created = db.tx(lambda c: statements.epochs_created(c, qid), read=True)
                changed = created != self.created
                self.created = created
                if not background or not changed:
                    return made_rows or changed
                continue
            made_rows = True
            self._made()  # a take() of this process waiting for rows claims them now
            if new > have:
                self.created = new
                self._making = None
                if not background:
                    return True
                continue
            if not background:
                self.soon(have)
                return True
            self._leaving.wait(max(MAKER_PAUSE_MIN, MAKER_PAUSE * (time.monotonic() - t)))
        return made_rows

    def _breathe(self) -> None:
        """Between two slices of the background shuffle: see ``SHUFFLE_WAIT``."""
        if self._leaving.is_set():
            raise _Leaving
        self.db.wait_writes(SHUFFLE_WAIT)
        time.sleep(SHUFFLE_BREATHE)


class _Leaving(Exception):
    """The queue is closing: the background shuffle stops."""


def _epoch_state(conn: Connection, qid: int, epoch: int) -> tuple[int, int]:
    """(complete epochs, rows of ``epoch`` made so far)."""
    return statements.epochs_created(conn, qid), statements.rows_made(conn, qid, epoch)
