"""The public facade: ``WorkQueue`` composes the parts below it (``docs/design.md`` draws the
map): the database handle (``store.db.Db``) and the hot path's port (``store.hot.HotPath``),
the hand-out loop (``worker.dispenser.Dispenser``, with the book of claimed items, the epoch
maker and the refill thread), how deliveries end (``worker.outcomes.Outcomes``) and the
heartbeat (``worker.heartbeat.Heartbeat``). It holds no SQL text of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from wq_sql.errors import InvalidInput, QueueExhausted
from wq_sql.plan import (
    Part,
    Work,
    check_count,
    check_name,
    check_num_epochs,
    check_options,
    queue_spec,
)
from wq_sql.sources import read_slice
from wq_sql.store import lineage as lineage_store
from wq_sql.store import statements
from wq_sql.store.db import LOCK_SLICE, Db
from wq_sql.store.engine import keep_for_children, resolve_url, worker_engine
from wq_sql.store.hot import HotPath
from wq_sql.store.lineage import Steps
from wq_sql.store.migrate import ensure_schema
from wq_sql.store.redact import safe_url
from wq_sql.worker import process
from wq_sql.worker.book import Book, WorkItem
from wq_sql.worker.dispenser import Dispenser, Extent, Rules
from wq_sql.worker.epochs import EpochMaker, Order
from wq_sql.worker.heartbeat import Heartbeat, Terms, register, return_lost
from wq_sql.worker.identity import check_worker_name, default_worker_name
from wq_sql.worker.joining import open_queue
from wq_sql.worker.outcomes import Handout, Outcomes
from wq_sql.worker.process import weak_method
from wq_sql.worker.sizing import AUTO_MAX

__all__ = ["Progress", "WorkItem", "WorkQueue", "handed_out_by", "prepare_children"]

log = logging.getLogger("wq_sql")
@dataclass(frozen=True)
class Progress:
    """Counts for one queue; ``pending`` includes items of epochs not yet created."""

    total: int
    done: int
    failed: int
    epochs_created: int
    num_epochs: int
    items_per_epoch: int
    quarantined: int = 0  # items of works in quarantine: finished, never delivered again

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.failed - self.quarantined


def _engine_options(schema: Optional[str], busy_timeout: float) -> dict[str, Any]:
    """``make_engine``'s arguments for a queue object's own engine."""
    return dict(schema=schema, busy_timeout=float(busy_timeout), pool_size=3, autocheckpoint=False,
                lock_slice=LOCK_SLICE)


def prepare_children(url: Optional[str | URL] = None, *, schema: Optional[str] = None,
                     busy_timeout: float = 30.0) -> None:
    """In a process that will fork worker processes which each open a queue object on ``url``
    (``wq_sql.torch``'s DataLoader workers): make their engine once, here, with its dialect
    initialised and no connection (``engine.keep_for_children``); each forked child's first
    queue object takes it instead of making its own. Pass the ``schema`` and ``busy_timeout``
    the children pass to ``WorkQueue``; other values just make the children build their own."""
    keep_for_children(resolve_url(url), **_engine_options(schema, busy_timeout))


class WorkQueue:
    """A global queue of work items in a SQL table that many worker processes claim from.

    Every worker constructs the same ``WorkQueue(...)``; whichever comes first creates the queue,
    the rest join it. Fast workers take more items, slow ones fewer::

        from wq_sql import WorkQueue, QueueExhausted
        with WorkQueue(["a.txt", "b.txt", "c.txt"], num_epochs=2, url="sqlite:///q.db") as wq:
            for path in wq:          # each item is done when the next is taken
                train_on(path)

    Arguments before ``*`` are DeepRec's: ``works`` (a non-empty list of str or UTF-8 bytes, each
    stripped; or a dict of named sources, each such a list, with ``weights=``; ``None`` only
    through :meth:`attach`), ``num_epochs``, ``shuffle``, ``seed``
    (``None``: a random one when creating, the stored one when joining), ``prefix`` (prepended to
    each work when it is handed out; may differ between workers), ``num_slices`` (cut sliceable
    works, ``table:...`` and ``lines:...``, into this many items in all) and ``name`` (the queue;
    many live side by side in one database). A worker joining with other works, ``num_epochs``,
    ``shuffle``, ``num_slices``, an explicit other ``seed`` or ``max_attempts`` gets
    :class:`QueueConfigMismatch`.

    Keyword-only:

    - ``url``: the database; default ``$WQ_SQL_URL``, else ``sqlite:///wq_sql.db``.
    - ``worker``: this worker's identity; default ``$WQ_SQL_WORKER``, else ``$TF_CONFIG``'s
      ``type:index``, else ``host:pid``. A restarted worker with the same identity takes back the
      items its previous process held, at once.
    - ``lease_seconds=60``: how long a claimed item stays claimed after its worker's last
      heartbeat; then any worker may take it (an attempt counted).
    - ``lease_ahead=None``: items claimed per round trip, kept in a local buffer until taken.
      ``None`` sizes it from this worker's own time per item (the time between hand-outs
      outside ``take()``): the items of one round cover about 0.1 s of its work, from 1 (steps
      of 0.1 s or more) to 512 (items used in microseconds); see :class:`wq_sql.worker.sizing.Sizer`.
      :attr:`lease_ahead` reads the size in force.
    - ``max_attempts=None``: failed deliveries (``fail()``, an expired lease, a crash) after
      which an item is ``failed``; ``None`` means the stored value when joining, 3 when creating.
    - ``auto_complete=True``: ``take()`` marks the previous item done; ``False``: items are done
      only when you ``complete(item)`` them.
    - ``max_item_seconds=None``: stop renewing an item's lease this long after it was claimed, so
      that a worker hung on one item loses it (``None``: renew while the process lives).
    - ``heartbeat_seconds=None``: how often a background thread renews this worker's leases;
      default ``min(lease_seconds / 6, 5)``, at most half of ``lease_seconds``. Another process
      may take this worker identity over once its heartbeat is ``3 * heartbeat_seconds`` old.
    - ``poll_seconds=1``: the longest pause between two looks at the queue while ``take()`` waits
      for the last items, which other workers hold.
    - ``busy_timeout=30``: seconds a transaction is retried while SQLite stays locked by other
      writers (then :class:`DatabaseBusy`) or while a database connection is lost (then the
      driver's error).
    - ``schema``: the PostgreSQL schema that holds the tables (teams sharing one database).
    - ``engine``: an SQLAlchemy engine of your own instead of one made from ``url`` (not needed
      behind PgBouncer: a plain URL works in transaction mode, see ``wq_sql.store.dialects.postgresql``).
    - ``claim_ahead=True``: once the buffer is empty, claim the next round in a background
      thread shortly before this worker is expected to take it (by its own pace), so ``take()``
      rarely waits for the database (see :mod:`wq_sql.worker.refill`). ``False``: ``take()`` claims
      itself when the buffer is empty, nothing is claimed behind the caller's back.
    - ``run=(run_id, restart)``: the job run this worker belongs to and its restart count; a worker
      of a later restart returns the earlier restarts' items at once (``wq_sql.torch`` passes
      torchrun's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``).
    - ``weights``: with ``works`` a dict of named sources (``{"web": [...], "code": [...]}``),
      each source's weight (default equal): an epoch draws each source at its share, every item
      of a source once before any repeats, interleaved evenly. Used when the queue is created;
      afterwards the weights in force are the stored ones, changed for every worker by
      :func:`wq_sql.set_mix` (``wq-sql mix``). See ``docs/guide/mixing.md``.

    Events go to the ``wq_sql`` logger: WARNING for what needs attention (a lost database
    connection, recovered items), INFO for routine ones (a queue created, expired leases).
    """

    def __init__(self, works: Optional[Sequence[Work]], num_epochs: int = 1, shuffle: bool = True,
                 seed: Optional[int] = None, prefix: Optional[str] = None,
                 num_slices: Optional[int] = None, name: str = "work_queue", *,
                 url: Optional[str | URL] = None, worker: Optional[str] = None,
                 lease_seconds: float = 60.0, lease_ahead: Optional[int] = None,
                 max_attempts: Optional[int] = None,
                 auto_complete: bool = True, max_item_seconds: Optional[float] = None,
                 heartbeat_seconds: Optional[float] = None, poll_seconds: float = 1.0,
                 busy_timeout: float = 30.0, schema: Optional[str] = None,
                 engine: Optional[Engine] = None, claim_ahead: bool = True,
                 run: Optional[tuple[str, int]] = None,
                 weights: Optional[Mapping[str, float]] = None) -> None:
        self.name = check_name(name)
        spec = None if works is None else queue_spec(works, weights, num_epochs, shuffle, seed, num_slices,
                                                     prefix)
        self._opts = o = check_options(lease_seconds, lease_ahead, max_attempts, auto_complete,
                                       max_item_seconds, heartbeat_seconds, poll_seconds, busy_timeout,
                                       schema, claim_ahead, run)
        self._worker_given = worker is not None
        self.worker = check_worker_name(worker if worker is not None else default_worker_name())
        url_ = resolve_url(url) if engine is None else engine.url
        # Connections: claims, heartbeat, and making the next epoch in the background.
        own = engine or worker_engine(url_, **_engine_options(schema, o.busy_timeout))
        # After an outage, expire nothing until the others could renew (a few heartbeats).
        self._db = db = Db(own, url_, busy_timeout=o.busy_timeout, label=self.name,
                           quiet_seconds=statements.STALE_BEATS * o.heartbeat_seconds,
                           stall_seconds=o.heartbeat_seconds)
        try:
            db.retrying(lambda: ensure_schema(own, schema))
            row, weighted = open_queue(db, self.name, spec, max_attempts, by=self.worker)
            self._row = row
            self._qid: int = row.id
            self.prefix: Optional[str] = row.prefix if spec is None else spec.prefix
            self._extent = Extent(row.n_works, row.num_epochs)
            order = Order(row.id, row.n_works, row.shuffle, row.seed, weighted)
            epochs = EpochMaker(db, order, row.epochs_created, weak_method(self._num_epochs, 0),
                                weak_method(self._epoch_rows, None), self.name)
            member, recovered = register(db, self._qid, self.name, self.worker, self._terms())
            rules = Rules(self.name, self.worker, o.lease_ahead, o.poll_seconds, row.max_attempts,
                          o.auto_complete, o.claim_ahead)
            self._hot = HotPath(db, self._qid, o.lease_ahead or AUTO_MAX, o.lease_seconds, schema)
            self._d = Dispenser(db, self._hot, member, Book(self.prefix), epochs, self._extent, rules)
            self._outcomes = Outcomes(db, self._hot, self._d)
            self._start(recovered)
            process.add(self, self._d.fresh_locks)
        except BaseException:
            if engine is None:
                db.close()
            raise

    lease_seconds: Part[float] = Part("_opts")
    auto_complete: Part[bool] = Part("_opts")
    max_item_seconds: Part[Optional[float]] = Part("_opts")
    heartbeat_seconds: Part[float] = Part("_opts")
    poll_seconds: Part[float] = Part("_opts")
    busy_timeout: Part[float] = Part("_opts")
    schema: Part[Optional[str]] = Part("_opts")
    claim_ahead: Part[bool] = Part("_opts")
    shuffle: Part[bool] = Part("_row")
    seed: Part[int] = Part("_row")
    num_slices: Part[Optional[int]] = Part("_row")
    max_attempts: Part[int] = Part("_row")

    @classmethod
    def attach(cls, name: str = "work_queue", **kwargs: Any) -> WorkQueue:
        """Join an existing queue without repeating its works: ``WorkQueue.attach("q", url=...)``."""
        return cls(None, name=name, **kwargs)

    @property
    def lease_ahead(self) -> int:
        """Items a claim round claims now: the ``lease_ahead`` given, or the automatic size."""
        return self._d.sizer.size

    @property
    def items_per_epoch(self) -> int:
        return self._extent.items_per_epoch

    @property
    def num_epochs(self) -> int:
        return self._extent.num_epochs

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine of this queue object (for reading its database, e.g. audits)."""
        return self._db.engine

    @property
    def buffered(self) -> int:
        """Items claimed by this object and not yet handed out."""
        with self._d.lock:
            return len(self._d.book.buffer)

    @property
    def dead_after(self) -> float:
        """Another process holds a worker identity until its heartbeat is this old."""
        return self._terms().dead_after

    @property
    def epoch_chunk(self) -> int:
        """Item rows per transaction when this worker makes an epoch."""
        return self._d.epochs.chunk

    @epoch_chunk.setter
    def epoch_chunk(self, rows: int) -> None:
        check_count("epoch_chunk", rows)
        self._d.epochs.chunk = rows

    def _num_epochs(self) -> int:
        return self._extent.num_epochs

    def _terms(self) -> Terms:
        o = self._opts
        return Terms(o.lease_seconds, o.heartbeat_seconds, o.max_item_seconds, self._row.max_attempts, o.run)

    def _start(self, recovered: list[statements.Claimed]) -> None:
        """After registering: the claim round is planned (:meth:`ClaimRound.warm`), the items a
        dead predecessor held go first, and the heartbeat runs."""
        d = self._d
        self._hot.warm()  # Postgres: the round's plans now, not in the first take
        if recovered:
            idx = [r.work_idx for r in recovered]
            works = self._db.tx(lambda c: statements.works_by_idx(c, self._qid, idx),
                                read=True)
            d.book.add(recovered, works)
        self._heartbeat = Heartbeat(self._db, self._hot, d.member, self._terms(), self.name,
                                    holding=weak_method(d.holding, None),
                                    superseded=weak_method(d.lose_identity, None),
                                    returned=weak_method(d.made_claimable, None),
                                    idle=weak_method(d.give_back_idle, 0),
                                    ride=weak_method(d.ride_beat, None))
        d.beat_due = self._heartbeat.next_due
        d.beat_carry = self._heartbeat.carry

    # ------------------------------------------------------------------ taking

    def take(self, timeout: Optional[float] = None) -> WorkItem:
        """The next work item (a ``str``); raises :class:`QueueExhausted` at the end.

        Taking an item marks the items this queue object handed out before as done (unless
        ``auto_complete=False``). While nothing is claimable but live workers still hold items,
        waits (they may die and their items come back); ``timeout`` bounds that wait, after which
        :class:`QueueEmpty` is raised (``timeout=0``: never wait). Only then: while the next
        epoch is due but its first rows are not made yet (another worker is making them), the
        take waits for them whatever ``timeout`` says."""
        self._ensure_process()
        return self._d.take(None if timeout is None else time.monotonic() + timeout)

    def take_many(self, n: int, timeout: Optional[float] = None, *, claim: Optional[int] = None,
                  stop: Optional[Callable[[], bool]] = None) -> list[WorkItem]:
        """Like :meth:`take`, but hands out up to ``n`` items at once: what the local buffer holds
        (never waiting to gather ``n``), or, when it is empty, what the next round trip claims:
        ``lease_ahead`` items, or ``claim`` (at most ``lease_ahead``) when a thread calling
        :meth:`prefetch` claims the rest. Taking marks every item handed out before as done
        (unless ``auto_complete=False``), so the items of one hand-out are done when the next
        hand-out is taken. A wait for other workers' items also ends, with :class:`QueueEmpty`,
        once ``stop()`` is true: make it true, then call :meth:`wake`."""
        self._ensure_process()
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._d.take_many(n, deadline, claim, stop)

    def _epoch_rows(self) -> None:
        self._d.epoch_rows()  # the epoch maker's chunk is in: waiting takes claim it

    def wake(self) -> None:
        """Wake every ``take()`` of this object that waits for other workers' items: it looks
        at its buffer, its ``stop`` condition and the database again now. Called when something
        in this process may have made an item claimable, or a caller's ``stop`` became true."""
        self._d.wake()

    def __iter__(self) -> Iterator[WorkItem]:
        while True:
            try:
                yield self.take()
            except QueueExhausted:
                return

    def prefetch(self, min_claim: int = 1) -> int:
        """Top the buffer of claimed items up to ``lease_ahead`` in one round trip (which also
        sends the pending acknowledgements), if at least ``min_claim`` places are free, without
        holding the queue's lock during the round trip: another thread can take buffered items
        meanwhile (:meth:`refill_soon` runs it in a background thread). One refill at a time, so
        claimed items not yet reached by the consumer stay at most ``lease_ahead``. Returns how
        many items were claimed: 0 when the buffer is full enough, another refill runs, or
        nothing is claimable now (``take()`` then goes on as without prefetching)."""
        self._ensure_process()
        return self._d.prefetch(min_claim)

    def refill_soon(self, min_claim: int = 1) -> None:
        """Top the buffer up in a background thread now (:meth:`prefetch` with ``min_claim``),
        again while rounds claim: for a consumer that pulls items in a pipeline, after each
        hand-out. :meth:`stop_refills` stops it; the next call starts it again."""
        self._d.refill_soon(min_claim)

    def stop_refills(self) -> None:
        """Claim nothing ahead until the next hand-out: the refill thread stops (the next
        ``take()`` or :meth:`refill_soon` starts it again) and a :meth:`prefetch` in flight lands
        in the buffer first. For a consumer whose data ends before the queue's (``wq_sql.tf``'s
        synchronous end), so that no item is claimed into a buffer that nobody will look at."""
        self._d.stop_refills()

    # ------------------------------------------------------------------ reading sliced works

    def read(self, item: str, **options: Any) -> Iterator[Any]:
        """The records of a sliced item (``table:``/``lines:`` works, or a registered source), read
        from its source by the bounds stored at creation. ``item`` is what :meth:`take` returned
        (or its string, among this object's last 4096 hand-outs). Options go to the source, e.g.
        ``columns=["id", "text"]`` for tables. A table row is a tuple, a line is ``bytes``."""
        held = self.recent(item)
        if held is None:
            raise InvalidInput(f"{item!r} is not among the items this queue object handed out "
                               "recently; pass what take() returned")
        found = self._db.tx(lambda c: statements.item_bounds(c, self._qid, held.item_id), read=True)
        if found is None:
            raise InvalidInput(f"{item!r} is not an item of queue {self.name!r}")
        work, bounds = found
        if bounds is None:
            raise InvalidInput(f"{work!r} is a plain work, handed out whole: read it with your own "
                               "reader (only table:, lines: and registered sources are sliced)")
        return read_slice(bounds, self._db.engine, **options)

    def recent(self, item: str) -> Optional[WorkItem]:
        """The hand-out ``item`` stands for (itself, or its string among this object's last 4096
        hand-outs), or None."""
        with self._d.lock:
            return self._d.book.recent(item)

    def work_at(self, idx: int) -> str:
        """The stored work with index ``idx`` (0-based, in the order the works were given; a
        sliced work's items carry the work they came from)."""
        works = self._db.tx(lambda c: statements.works_by_idx(c, self._qid, [idx]), read=True)
        if idx not in works:
            raise InvalidInput(f"queue {self.name!r} has no work with index {idx!r}")
        return works[idx]

    def records(self, **options: Any) -> Iterator[Any]:
        """Every record of every item this worker takes, item after item: ``for row in
        wq.records(): ...``. An item is done when the next one is taken (``auto_complete``), so
        after a crash the records of at most the item in progress are read again."""
        for item in self:
            yield from self.read(item, **options)

    # ------------------------------------------------------------------ explicit control

    def complete(self, item: str) -> None:
        """Mark ``item`` done now; raises :class:`LeaseLost` if its lease was lost meanwhile."""
        self._ensure_process()
        self._outcomes.complete(item)

    def release(self, item: str) -> None:
        """Give ``item`` back to the queue without counting an attempt."""
        self._ensure_process()
        self._outcomes.release(item)

    def fail(self, item: str, error: object = "failed") -> None:
        """Count a failed attempt on ``item`` (recorded as ``last_error``); after ``max_attempts``
        the item is ``failed``, else it goes back to the queue."""
        self._ensure_process()
        self._outcomes.fail(item, str(error)[:10_000])

    def quarantine(self, item: str, reason: object) -> int:
        """Put the work of the handed-out ``item`` in quarantine for every worker (a corrupt
        shard, say): no claim, requeue, reset, restore or later epoch delivers it again until
        ``wq-sql unquarantine``; other workers' buffered copies are dropped at their next claim
        round. ``item`` leaves this object (do not complete it). ``reason`` is recorded, with
        this worker as who. Returns how many item rows were taken out of circulation."""
        self._ensure_process()
        text = str(reason).strip()
        if not text:
            raise InvalidInput("quarantine() needs a reason, e.g. wq.quarantine(item, 'CRC errors')")
        return self._outcomes.quarantine(item, text[:10_000], f"worker {self.worker}").items

    # ------------------------------------------------------------------ checkpoint-consistent consumption

    def cover(self, items: Sequence[WorkItem], step: int, ambiguous: int = 0) -> list[WorkItem]:
        """A model checkpoint at global ``step`` covers ``items`` (handed out, not yet done): mark
        them done in one transaction, stamped with ``step``, and record the save in
        ``wq_checkpoints`` (``ambiguous``: hand-outs the caller left for a later save). Use with
        ``auto_complete=False``; :mod:`wq_sql.tf` calls it. Returns the items whose lease was lost
        (another worker holds or finished them); they are logged, not raised."""
        self._ensure_process()
        return self._outcomes.cover(items, int(step), ambiguous)

    def reopen_after(self, step: Optional[int], *, writer: Optional[str] = None,
                     departed: Sequence[tuple[str, Optional[int]]] = (), since: Optional[int] = None,
                     staying: Optional[Collection[str]] = None) -> int:
        """This worker's model was restored from a checkpoint whose state says global ``step``
        (``None``: from no checkpoint): put back to the queue every item that a later checkpoint
        of this worker identity had covered (:meth:`cover`): the restored model has not trained
        them. Items it still held come back through same-identity recovery. Returns how many items
        were re-opened. Steps are per identity, so other identities' checkpoints are compared
        only with their own states:

        - ``writer``: the identity that saved the restored state, if not this one (the job
          restarted under a new run id): its later checkpoints are forgotten too.
        - ``departed``: ``(identity, step)`` of the states of ranks that did not come back (the
          job restarted with fewer ranks), restored with this one: each one's later checkpoints.
        - ``since`` (an :meth:`event_mark` taken when the restored state was saved) and
          ``staying`` (the identities of the writer's job run that come back and restore their
          own states): what the run's other identities, whose states nobody restores, covered
          after ``since`` (``wq_sql.torch`` passes them for rank 0 of a ``torchrun`` job)."""
        self._ensure_process()
        return self._outcomes.reopen_after(None if step is None else int(step), writer, departed,
                                           since, staying)

    def cover_listed(self, writer: str, ids: Sequence[int], step: int) -> int:
        """Mark done, stamped with ``step``, the items ``ids`` a restored state of another identity
        ``writer`` lists as covered by its checkpoint, if they are still claimed by ``writer`` or
        back in the queue (it was killed before it learnt the checkpoint was saved). Returns how many."""
        self._ensure_process()
        return self._outcomes.cover_listed(writer, ids, int(step))

    def compacted_epochs(self) -> list[int]:
        """The epochs whose ``done`` item rows were deleted by :func:`wq_sql.compact_queue`."""
        self._ensure_process()
        p = self.progress()
        return list(self._db.tx(lambda c: statements.compacted_epochs(c, self._qid, p.items_per_epoch,
                                                                      p.epochs_created), read=True))

    def event_mark(self) -> int:
        """The id of the newest row of the history (``wq_events``): a mark for :meth:`reopen_after`'s
        ``since``."""
        self._ensure_process()
        return self._outcomes.event_mark()

    def return_lost(self, lineage: Optional[str] = None, keep: Collection[str] = ()) -> int:
        """Look now, as heartbeats do from time to time, for the items of workers that are gone (a
        process of this host that is dead, a heartbeat 3 periods old) and of expired leases, and
        put them back to the queue; ``lineage``: only of that identity and those named under it
        (``<lineage>/...``), if gone, but the identities in ``keep``. Returns how many.
        :mod:`wq_sql.torch` calls it when a rank's process begins its first pass, for its own
        name, keeping the DataLoader worker identities it runs: those of its previous process
        beyond them (it ran more ``num_workers``) never come back for what they held, and no
        pass of this rank waits for items others hold."""
        self._ensure_process()
        if not self._db.may_expire:
            return 0
        n, _ = return_lost(self._db, self._qid, self._d.member, self._row.max_attempts, self.name, lineage,
                           keep)
        if n:
            self._d.made_claimable()
        return n

    # ------------------------------------------------------------------ items another process consumes

    @property
    def worker_id(self) -> int:
        """This worker identity's row id (``wq_workers.id``): the holder that
        :meth:`complete_handed` needs to acknowledge items this worker handed to another process."""
        return self._d.member.worker_id

    def hand_off(self, items: Sequence[WorkItem]) -> None:
        """Stop tracking handed-out items whose data went to another process, which acknowledges
        them (:meth:`complete_handed`; use with ``auto_complete=False``). They stay claimed in the
        database, and this object no longer renews, completes, releases or fails them:
        ``close()`` leaves them claimed. If nobody acknowledges them, they come back as a crashed
        worker's items do (to this identity's next process first, else after their lease)."""
        self._outcomes.hand_off(items)

    def still_held(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Those of ``items`` that this worker still holds by the database (claimed by it under the
        same token), in one read; the others were completed (or lost) meanwhile."""
        self._ensure_process()
        return self._outcomes.still_held(items)

    def complete_handed(self, handed: Mapping[int, Sequence[Handout]],
                        steps: Optional[Steps] = None) -> list[Handout]:
        """Mark done, in one transaction, items that other workers of this queue claimed and handed
        to this process: ``{holder: items}``, each holder by its :attr:`worker_id`, each item the
        ``WorkItem`` or its ``item.key``, ``(id, token)`` (what a process that never holds the
        items needs, and the cheapest to send it). Fenced by ``(id, token)`` like :meth:`complete`;
        the events and counters name the holder. Returns the items (or keys) whose lease was lost
        (another worker holds or finished them), logged, not raised. ``steps``: lineage rows
        (``wq_steps``) written in the same transaction (the shims' ``lineage=True``)."""
        self._ensure_process()
        return self._outcomes.complete_handed(handed, steps)

    def adopt_handed(self, handed: Mapping[int, Sequence[WorkItem]],
                     steps: Optional[Steps] = None) -> list[WorkItem]:
        """Hold items other workers handed to this process (``{holder: items}``) under this worker until
        :meth:`cover` or ``close()``; fenced by ``(id, token)``. Returns the items whose lease was lost.
        ``steps``: as for :meth:`complete_handed`."""
        self._ensure_process()
        return self._outcomes.adopt_handed(handed, self._opts.lease_seconds, steps)

    def next_lineage_run(self) -> int:
        """The run number for this worker's next lineage rows: one more than its last in the
        queue (1 for the first)."""
        self._ensure_process()
        return int(self._db.tx(lambda c: lineage_store.next_run(c, self._qid, self.worker), read=True))

    def queue_steps(self, steps: Steps) -> None:
        """Lineage rows (``wq_steps``) that ride on this worker's next write of its own: a claim
        round (which carries the acknowledgements of the items handed out before), an
        acknowledgement, or ``close()``, in its transaction, never a round trip of their own
        (the TensorFlow shim's ``lineage=True``). Rows still queued when the process is killed
        are lost, with the acknowledgements that had not been sent either. Thread-safe."""
        self._hot.queue_steps(steps)

    # ------------------------------------------------------------------ progress and lifecycle

    def add_input_wait(self, seconds: float) -> None:
        """Add ``seconds`` the training loop waited for its next batch to this worker's
        waiting-on-data total, which its heartbeat sends (``wq_workers.input_wait``, the metric
        ``wq_sql_worker_input_wait_seconds_total``, the dashboard's "waiting on data"). The
        shims call it for the rank's own queue object; a custom loop may call it around its
        own wait for data. Thread-safe."""
        self._hot.add_input_wait(seconds)

    @property
    def input_wait(self) -> Optional[float]:
        """This worker's waiting-on-data total, seconds (None: nothing was measured)."""
        return self._hot.input_wait

    @property
    def closed(self) -> bool:
        """Whether this queue object was closed (``close()``, a ``with`` block's end, the exit)."""
        return bool(self._d.closed)

    def progress(self) -> Progress:
        """Counts from the counters table (no scan of the items), after sending this object's
        pending acknowledgements (items finished here count)."""
        self._d.send_acks()

        def read(c: Connection) -> tuple[tuple[int, int, int], int]:
            return statements.progress(c, self._qid), statements.epochs_created(c, self._qid)

        (done, failed, quarantined), created = self._db.tx(read, read=True)
        e = self._extent
        return Progress(e.total, done, failed, created, e.num_epochs, e.items_per_epoch, quarantined)

    def first_open_epoch(self) -> Optional[int]:
        """The lowest epoch with items not yet done or failed (None once every epoch is), from the
        counters: where a job resumes (after a checkpoint restore, the restored one's epoch)."""
        self._d.send_acks()
        ended = self._db.tx(lambda c: statements.ended_per_epoch(c, self._qid), read=True)
        e = self._extent
        return next((k for k in range(e.num_epochs) if ended.get(k, 0) < e.items_per_epoch), None)

    def extend_epochs(self, num_epochs: int) -> None:
        """Raise the queue's ``num_epochs`` (never lower it); every worker sees it on join."""
        check_num_epochs(num_epochs)
        got = self._db.tx(lambda c: statements.extend_epochs(c, self._qid, num_epochs))
        if not got:
            raise InvalidInput(f"num_epochs can only grow; queue {self.name!r} already has more")
        self._extent.num_epochs = got
        self._d.made_claimable()  # takes waiting at the old end see the new epochs now

    def close(self, *, _failed: Optional[BaseException] = None) -> None:
        """Acknowledge what was handed out, give back what was claimed ahead, and leave."""
        d, db = self._d, self._db
        mine = os.getpid() == d.pid
        if mine:
            # Outside the lock: a claim in flight needs it to finish. The threads are told to
            # stop here and joined after the leave's round trip, not before it: at the end of a
            # drain every worker closes at once, and each join waited for a thread to get a
            # core.
            d.stop_refills(join=False)
            d.epochs.stop(timeout=self._opts.busy_timeout)
        try:
            with d.lock:
                if not d.close():
                    return
                process.discard(self)
                self._heartbeat.stop_event.set()
                if not mine or d.superseded:
                    db.close()
                    return
                try:
                    self._outcomes.leave(_failed)
                finally:
                    self._heartbeat.stop()
                    db.close()
        finally:
            if mine:
                d.join_refills()  # it finds the queue closed and touches no connection

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self.close(_failed=exc)

    def __repr__(self) -> str:
        return (f"WorkQueue(name={self.name!r}, url={safe_url(self._db.url)!r}, worker={self.worker!r}, "
                f"items_per_epoch={self.items_per_epoch}, num_epochs={self.num_epochs})")

    def _ensure_process(self) -> None:
        """After ``fork()``: the child opens its own connections under its own identity."""
        d = self._d
        if os.getpid() == d.pid:
            return
        with d.lock:
            if os.getpid() == d.pid:
                return
            self._db.in_child()
            d.epochs.forget_thread()
            self.worker = f"{self.worker}+{os.getpid()}" if self._worker_given else default_worker_name()
            d.rules = dataclasses.replace(d.rules, worker=self.worker)
            member, recovered = register(self._db, self._qid, self.name, self.worker, self._terms())
            d.after_fork(member)
            self._start(recovered)
            process.add(self, self._d.fresh_locks)


def handed_out_by(item: str) -> Optional[tuple[WorkQueue, WorkItem]]:
    """The open queue object of this process that handed ``item`` out recently, and the
    hand-out itself (None if none did)."""
    for wq in process.open_objects():
        held = wq.recent(item) if isinstance(wq, WorkQueue) else None
        if held is not None:
            return wq, held
    return None
