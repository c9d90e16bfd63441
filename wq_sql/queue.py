"""The public facade: ``WorkQueue`` composes the parts below it and owns the queue object's lock.

Parts: the database handle (``db.Db``), the hand-out book (``holdings.Holdings``), the claim
round (``claim.ClaimRound``), the heartbeat (``lease.Heartbeat``), the epoch maker
(``epochs.EpochMaker``) and the refill thread (``pacer.Refiller``). Statements live in ``ops``;
``docs/design.md`` draws the map.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL

from wq_sql import ops
from wq_sql.claim import ClaimRound
from wq_sql.db import LOCK_SLICE, Db
from wq_sql.engine import make_engine, resolve_url, safe_url
from wq_sql.epochs import EpochMaker, Order
from wq_sql.errors import (
    InvalidInput,
    LeaseLost,
    QueueConfigMismatch,
    QueueEmpty,
    QueueExhausted,
    QueueNotFound,
    WorkerConflict,
    WqSqlError,
)
from wq_sql.holdings import Holdings, WorkItem
from wq_sql.identity import check_worker_name, default_worker_name
from wq_sql.lease import Heartbeat, Member, Terms, register
from wq_sql.migrate import ensure_schema
from wq_sql.mismatch import DEFAULT_MAX_ATTEMPTS, differences, extend_to
from wq_sql.pacer import Pace, Refiller
from wq_sql.plan import (
    QueueSpec,
    Work,
    check_count,
    check_name,
    check_num_epochs,
    check_num_slices,
    check_positive,
    check_prefix,
    check_seconds,
    check_seed,
    new_seed,
    normalize_works,
)
from wq_sql.sources import plan_items, read_slice
from wq_sql.weak import weak_method

__all__ = ["Progress", "WorkItem", "WorkQueue"]

log = logging.getLogger("wq_sql")

_live: weakref.WeakSet[WorkQueue] = weakref.WeakSet()
ORPHAN_POLLS = 2  # a waiting take() looks for items it holds but does not know after this many polls


@dataclass(frozen=True)
class Progress:
    """Counts for one queue; ``pending`` includes items of epochs not yet created."""

    total: int
    done: int
    failed: int
    epochs_created: int
    num_epochs: int
    items_per_epoch: int

    @property
    def remaining(self) -> int:
        return self.total - self.done - self.failed


class WorkQueue:
    """A global queue of work items in a SQL table that many worker processes claim from.

    Every worker constructs the same ``WorkQueue(...)``; whichever comes first creates the queue,
    the rest join it. Fast workers take more items, slow ones fewer::

        from wq_sql import WorkQueue, QueueExhausted
        with WorkQueue(["a.txt", "b.txt", "c.txt"], num_epochs=2, url="sqlite:///q.db") as wq:
            for path in wq:          # each item is done when the next is taken
                train_on(path)

    Arguments before ``*`` are DeepRec's: ``works`` (a non-empty list of str or UTF-8 bytes, each
    stripped; ``None`` only through :meth:`attach`), ``num_epochs``, ``shuffle``, ``seed``
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
    - ``lease_ahead=1``: items claimed per round trip, kept in a local buffer until taken.
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
    - ``engine``: an SQLAlchemy engine of your own instead of one made from ``url`` (e.g.
      ``make_engine(resolve_url(url), startup_options=False)`` behind PgBouncer).
    - ``claim_ahead=False``: claim the next item in a background thread shortly before this
      worker is expected to take it (by its own pace), so ``take()`` rarely waits for the
      database (see :mod:`wq_sql.pacer`).

    Events go to the ``wq_sql`` logger: WARNING for what needs attention (a lost database
    connection, recovered items), INFO for routine ones (a queue created, expired leases).
    """

    def __init__(self, works: Optional[Sequence[Work]], num_epochs: int = 1, shuffle: bool = True,
                 seed: Optional[int] = None, prefix: Optional[str] = None,
                 num_slices: Optional[int] = None, name: str = "work_queue", *,
                 url: Optional[str | URL] = None, worker: Optional[str] = None,
                 lease_seconds: float = 60.0, lease_ahead: int = 1, max_attempts: Optional[int] = None,
                 auto_complete: bool = True, max_item_seconds: Optional[float] = None,
                 heartbeat_seconds: Optional[float] = None, poll_seconds: float = 1.0,
                 busy_timeout: float = 30.0, schema: Optional[str] = None,
                 engine: Optional[Engine] = None, claim_ahead: bool = False) -> None:
        self.name = check_name(name)
        attach = works is None
        if not attach:
            assert works is not None
            spec = QueueSpec(normalize_works(works), check_num_epochs(num_epochs), bool(shuffle),
                             check_seed(seed), check_num_slices(num_slices), check_prefix(prefix))
        check_seconds("lease_seconds", lease_seconds)
        check_positive("busy_timeout", busy_timeout)
        check_positive("poll_seconds", poll_seconds)
        check_count("lease_ahead", lease_ahead)
        if max_attempts is not None:
            check_count("max_attempts", max_attempts)
        if max_item_seconds is not None:
            check_seconds("max_item_seconds", max_item_seconds)
        if heartbeat_seconds is not None:
            check_seconds("heartbeat_seconds", heartbeat_seconds)
        self.lease_seconds = float(lease_seconds)
        self.lease_ahead = lease_ahead
        self.auto_complete = auto_complete
        self.max_item_seconds = max_item_seconds
        self.heartbeat_seconds = float(heartbeat_seconds if heartbeat_seconds is not None
                                       else min(self.lease_seconds / 6.0, 5.0))
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise InvalidInput("heartbeat_seconds must be at most half of lease_seconds, or leases "
                               "of live workers would expire between two heartbeats")
        self.poll_seconds = float(poll_seconds)
        self.busy_timeout = float(busy_timeout)
        self.schema = schema
        self.claim_ahead = bool(claim_ahead)
        self._worker_given = worker is not None
        self.worker = check_worker_name(worker if worker is not None else default_worker_name())
        url_ = resolve_url(url) if engine is None else engine.url
        # Connections: claims, heartbeat, and making the next epoch in the background.
        own = engine or make_engine(url_, schema=schema, busy_timeout=busy_timeout, pool_size=3,
                                    autocheckpoint=False, lock_slice=LOCK_SLICE)
        # After an outage, expire nothing until the others could renew (a few heartbeats).
        self._db = Db(own, url_, busy_timeout=self.busy_timeout, label=self.name,
                      quiet_seconds=ops.STALE_BEATS * self.heartbeat_seconds)

        self._lock = threading.RLock()
        # Notified when the book's buffer gets items or something in this process may have made
        # an item claimable (``_news`` counts those): a waiting take() wakes at once (see _wait).
        self._changed = threading.Condition(self._lock)
        self._news = 0
        self._closed = False
        self._superseded = False
        self._filling = False                        # a prefetch() round trip is in flight
        self._pace = Pace()                          # how often this worker takes items
        self._refiller: Optional[Refiller] = None   # refills the buffer in the background
        self._pid = os.getpid()
        try:
            self._db.retrying(lambda: ensure_schema(own, schema))
            row = self._open(None if attach else spec, max_attempts)
            self._qid: int = row.id
            self.num_epochs: int = row.num_epochs
            self.shuffle: bool = row.shuffle
            self.seed: int = row.seed
            self.num_slices: Optional[int] = row.num_slices
            self.items_per_epoch: int = row.n_works
            self.max_attempts: int = row.max_attempts
            self.prefix: Optional[str] = row.prefix if attach else spec.prefix
            self._book = Holdings(self.prefix)
            self._round = ClaimRound(self._db.dialect, lease_ahead, self.lease_seconds, schema)
            self._epochs = EpochMaker(self._db, Order(row.id, row.n_works, row.shuffle, row.seed),
                                      row.epochs_created, weak_method(self._num_epochs, 0),
                                      weak_method(self.wake, None), self.name)
            self._register()
            _live.add(self)
        except BaseException:
            if engine is None:
                self._db.close()
            raise

    @classmethod
    def attach(cls, name: str = "work_queue", **kwargs: Any) -> WorkQueue:
        """Join an existing queue without repeating its works: ``WorkQueue.attach("q", url=...)``."""
        return cls(None, name=name, **kwargs)

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine of this queue object (for reading its database, e.g. audits)."""
        return self._db.engine

    @property
    def buffered(self) -> int:
        """Items claimed by this object and not yet handed out."""
        with self._lock:
            return len(self._book.buffer)

    @property
    def dead_after(self) -> float:
        """Another process holds a worker identity until its heartbeat is this old."""
        return self._terms().dead_after

    @property
    def epoch_chunk(self) -> int:
        """Item rows per transaction when this worker makes an epoch."""
        return self._epochs.chunk

    @epoch_chunk.setter
    def epoch_chunk(self, rows: int) -> None:
        check_count("epoch_chunk", rows)
        self._epochs.chunk = rows

    # ------------------------------------------------------------------ opening and joining

    def _open(self, spec: Optional[QueueSpec], max_attempts: Optional[int]) -> Any:
        db = self._db
        row = db.tx(lambda c: ops.find_queue(c, self.name), read=True)
        if row is None and spec is None:
            raise QueueNotFound(f"no queue named {self.name!r} in {safe_url(db.url)}; create it "
                                "with WorkQueue(works, name=...) first")
        if row is None:
            assert spec is not None
            items = plan_items(spec.works, spec.num_slices, db.engine, spec.prefix)  # no transaction
            seed = spec.seed if spec.seed is not None else new_seed()

            def create(c: Connection) -> tuple[Optional[int], Any]:
                qid = ops.create_queue(c, db.dialect, self.name, spec, items, seed,
                                       DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts)
                return qid, ops.find_queue(c, self.name)

            qid, row = db.tx(create)
            if qid is not None:
                log.info("created queue %r: %d items per epoch, %d epochs", self.name,
                         row.n_works, row.num_epochs)

        def check(c: Connection) -> tuple[list[str], tuple[int, int]]:
            return differences(c, row, spec, max_attempts), ops.progress(c, row.id)

        diffs, (done, failed) = db.tx(check, read=True)
        if diffs:
            raise QueueConfigMismatch(self.name, diffs, extend_to(row, spec))
        if done + failed >= row.n_works * row.num_epochs:
            log.warning("queue %r is already finished (%d done, %d failed): take() will raise "
                        "QueueExhausted. Use another name, or reset it to start over.",
                        self.name, done, failed)
        return row

    def _terms(self) -> Terms:
        return Terms(self.lease_seconds, self.heartbeat_seconds, self.max_item_seconds, self.max_attempts)

    def _register(self) -> None:
        """Take this worker identity (``lease.register``) and start its heartbeat."""
        self._member: Member
        self._member, recovered = register(self._db, self._qid, self.name, self.worker, self._terms())
        if recovered:
            works = self._db.tx(lambda c: ops.works_by_idx(c, self._qid, [r.work_idx for r in recovered]),
                                read=True)
            self._book.add(recovered, works)
        self._heartbeat = Heartbeat(self._db, self._qid, self._member, self._terms(), self.name,
                                    holding=weak_method(self._holding, None),
                                    superseded=weak_method(self._lose_identity, None),
                                    returned=weak_method(self.wake, None))

    def _holding(self, stop: threading.Event) -> Optional[tuple[set[int], int]]:
        """For the heartbeat: the tokens of the items held, and how many are buffered."""
        # close() joins the heartbeat while holding the lock: once it is stopping, stop waiting
        # for the lock, or close() stalls for the whole join timeout (bench/long_tail.py).
        while not self._lock.acquire(timeout=0.05):
            if stop.is_set():
                return None
        try:
            if self._closed or os.getpid() != self._pid:
                return None
            return self._book.tokens(), len(self._book.buffer)
        finally:
            self._lock.release()

    def _lose_identity(self) -> None:
        self._superseded = True

    def _num_epochs(self) -> int:
        return self.num_epochs

    # ------------------------------------------------------------------ taking

    def take(self, timeout: Optional[float] = None) -> WorkItem:
        """The next work item (a ``str``); raises :class:`QueueExhausted` at the end.

        Taking an item marks the items this queue object handed out before as done (unless
        ``auto_complete=False``). While nothing is claimable but live workers still hold items,
        waits (they may die and their items come back); ``timeout`` bounds that wait, after which
        :class:`QueueEmpty` is raised (``timeout=0``: never wait)."""
        return self.take_many(1, timeout)[0]

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
        while True:
            with self._lock:
                self._check_usable()
                book = self._book
                if self.auto_complete:
                    book.ack_out()
                while not book.buffer and self._filling:  # prefetch() is claiming: no 2nd claim
                    self._changed.wait()
                if not book.buffer:
                    self._fill(claim)
                if book.buffer:
                    got = book.hand_out(n)
                    self._pace.handed_out(time.monotonic())
                    r = self._refills() if self.claim_ahead else None
                    if r is not None:
                        r.schedule(self._pace)
                    return got
            self._wait(deadline, stop)

    def _wait(self, deadline: Optional[float], stop: Optional[Callable[[], bool]] = None) -> None:
        """Nothing was claimable, but live workers hold items. Wait until this worker's own buffer
        holds an item (a refill thread may claim one at any moment, and notifies), something in
        this process may have made an item claimable (the epoch maker's rows, an item released or
        expired here: :meth:`wake`), or a poll of the database says an item may be claimable or
        the queue is finished. Polls are read-only probes (cheap for the database even with a
        thousand waiting workers; no write lock on SQLite), with backoff up to ``poll_seconds``;
        the lock is not held during a poll, so other threads can complete items meanwhile."""
        pause = 0.02
        # Poll about as often as this worker took items while it had work (never more than every
        # 20 ms, never less than every poll_seconds): at the end of a drain, the others' last
        # items take about that long, and a 1 s backoff would add up to 1 s to the job.
        cap = min(self.poll_seconds, max(pause, self._pace.interval or self.poll_seconds))
        total = self.items_per_epoch * self.num_epochs
        with self._lock:
            news = self._news
        polls = 0
        db = self._db
        while True:
            next_poll = time.monotonic() + pause * (0.5 + random.random())
            with self._lock:
                while True:
                    if self._book.buffer or self._news != news or self._closed:
                        return  # take_many() hands out, claims again, or says it is closed
                    now = time.monotonic()
                    if (deadline is not None and now >= deadline) or (stop is not None and stop()):
                        raise QueueEmpty(f"no item of queue {self.name!r} is claimable now; other "
                                         "workers still hold the remaining ones")
                    if now >= next_poll:
                        break
                    self._changed.wait(min(next_poll, deadline if deadline is not None else next_poll) - now)
            pause = min(pause * 2, cap)
            peek = db.tx(lambda c: ops.peek(c, db.dialect, self._qid, self._member.worker_id), read=True)
            if (peek.pending or peek.expired or peek.finished >= total
                    or peek.epochs_created != self._epochs.created):
                return
            polls += 1
            if peek.mine and polls >= ORPHAN_POLLS and self._adopt_orphans():
                return

    def _adopt_orphans(self) -> bool:
        """The guard for what the rest cannot prove: items the database says this worker holds
        but no part of this object knows (claimed into a buffer that no consumer looks at, or
        claimed by a commit whose reply an outage lost). With the lock held and no refill in
        flight the local book is complete, so such an item is put in the buffer for the waiting
        consumer, with a WARNING: it should never happen."""
        with self._lock:
            if self._filling or self._closed:
                return False
            held = self._db.tx(lambda c: ops.held_by(c, self._qid, self._member.worker_id), read=True)
            known = self._book.known()
            lost = [c for c in held if c.id not in known]
            if not lost:
                return False
            works = self._db.tx(lambda c: ops.works_by_idx(c, self._qid, [x.work_idx for x in lost]),
                                read=True)
            log.warning("queue %r: worker %r holds %d item(s) that it never handed out and no part of "
                        "it knew about; handing them out now: %s", self.name, self.worker, len(lost),
                        ", ".join(f"(epoch {c.epoch}, seq {c.seq})" for c in lost))
            self._book.add(lost, works)
            self._changed.notify_all()
            return True

    def wake(self) -> None:
        """Wake every ``take()`` of this object that waits for other workers' items: it looks
        at its buffer, its ``stop`` condition and the database again now. Called when something
        in this process may have made an item claimable, or a caller's ``stop`` became true."""
        with self._lock:
            self._news += 1
            self._changed.notify_all()

    def __iter__(self) -> Iterator[WorkItem]:
        while True:
            try:
                yield self.take()
            except QueueExhausted:
                return

    def _claim(self, acks: list[WorkItem], limit: int) -> int:
        """One claim round (``claim.ClaimRound``) that also acknowledges ``acks``; the claimed
        items join the buffer. Call with the lock held or ``_filling`` set. Returns how many."""
        keys = [a.key for a in acks]
        accepted, got, works = self._db.driver_tx(
            lambda conn: self._round.run(conn, self._qid, self._member.worker_id, keys, limit))
        with self._lock:  # one critical section: a waiting take() sees the buffer filled
            self._book.settle(acks, accepted, self.name)
            self._book.add(got, works)
            self._changed.notify_all()
        self._epochs.after_claim(got)
        return len(got)

    def _fill(self, limit: Optional[int] = None) -> None:
        """One round trip: acknowledge finished items and claim up to ``limit`` (at most
        ``lease_ahead``, the default) new ones. If none is claimable, try to make the next epoch,
        detect the end, or return expired items, in that order."""
        db, qid = self._db, self._qid
        limit = self.lease_ahead if limit is None else max(1, min(limit, self.lease_ahead))
        created = self._epochs.created
        acks = self._book.send_acks()
        try:
            if self._claim(acks, limit):
                return
        except BaseException:
            self._book.unsend(acks)
            raise
        if self._epochs.created != created:  # the epoch maker committed rows the claim did not see
            return self._fill(limit)
        # Nothing pending. The next epoch may be missing (a crash between a claim and its
        # advance), the queue may be finished (checked before expiring leases: a finished queue
        # holds none, and the end of every worker's drain comes here), or leases may have expired.
        if self._epochs.make():
            return self._fill(limit)

        def finished(c: Connection) -> tuple[int, int, int]:
            done, failed = ops.progress(c, qid)
            return done, failed, ops.find_queue_by_id(c, qid).num_epochs

        done, failed, num_epochs = db.tx(finished, read=True)
        if num_epochs != self.num_epochs:  # another worker called extend_epochs()
            self.num_epochs = num_epochs
            return self._fill(limit)
        if done + failed >= self.items_per_epoch * self.num_epochs:
            raise QueueExhausted(self.name, done, failed)
        if db.may_expire and db.tx(lambda c: ops.expire(c, db.dialect, qid, self.max_attempts)):
            return self._fill(limit)

    def prefetch(self, min_claim: int = 1) -> int:
        """Top the buffer of claimed items up to ``lease_ahead`` in one round trip (which also
        sends the pending acknowledgements), if at least ``min_claim`` places are free. Unlike
        ``take()``, the queue's lock is not held during the round trip, so another thread can take
        buffered items meanwhile: a background thread calling this keeps ``take()`` off the
        database (:meth:`refill_soon`). One refill at a time (``take()`` on an empty buffer waits
        for it instead of claiming too), so claimed-but-not-handed-out items stay at most
        ``lease_ahead``; after a ``take_many()``, its items but one count against ``lease_ahead``
        too, so claimed items not yet reached by the consumer stay at most ``lease_ahead``.

        Returns how many items were claimed: 0 when the buffer is full enough, another refill
        runs, or nothing is claimable now (then ``take()`` makes the next epoch, recovers expired
        leases, waits or raises ``QueueExhausted``, as without prefetching)."""
        self._ensure_process()
        with self._lock:
            self._check_usable()
            n = self.lease_ahead - len(self._book.buffer) - max(0, self._book.handed - 1)
            if self._filling or n < max(1, min_claim):
                return 0
            acks = self._book.send_acks()
            self._filling = True
        try:
            return self._claim(acks, n)
        except BaseException:
            with self._lock:
                self._book.unsend(acks)
            raise
        finally:
            with self._lock:
                self._filling = False
                self._changed.notify_all()

    def refill_soon(self, min_claim: int = 1) -> None:
        """Top the buffer up in a background thread now (:meth:`prefetch` with ``min_claim``),
        again while rounds claim: for a consumer that pulls items in a pipeline, after each
        hand-out. :meth:`stop_refills` stops it; the next call starts it again."""
        r = self._refills()
        if r is not None:
            r.kick(min_claim)

    def _refills(self) -> Optional[Refiller]:
        """The refill thread, started if needed; None once this object is closed or superseded
        (its next take() says so)."""
        r = self._refiller
        if r is None or not r.alive():
            with self._lock:
                if self._closed or self._superseded:
                    return None
                r = self._refiller
                if r is None or not r.alive():
                    r = self._refiller = Refiller(weak_method(self.prefetch, 0), self.name)
        return r

    def stop_refills(self) -> None:
        """Claim nothing ahead until the next hand-out: the refill thread stops (the next
        ``take()`` or :meth:`refill_soon` starts it again) and a :meth:`prefetch` in flight lands
        in the buffer first. For a consumer whose data ends before the queue's (``wq_sql.tf``'s
        synchronous end), so that no item is claimed into a buffer that nobody will look at."""
        r = self._refiller
        if r is not None and os.getpid() == self._pid:
            r.stop()
        with self._lock:
            while self._filling:
                self._changed.wait()

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
        found = self._db.tx(lambda c: ops.item_bounds(c, self._qid, held.item_id), read=True)
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
        with self._lock:
            return self._book.recent(item)

    def work_at(self, idx: int) -> str:
        """The stored work with index ``idx`` (0-based, in the order the works were given; a
        sliced work's items carry the work they came from)."""
        works = self._db.tx(lambda c: ops.works_by_idx(c, self._qid, [idx]), read=True)
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
        self._act(item, ops.complete)

    def release(self, item: str) -> None:
        """Give ``item`` back to the queue without counting an attempt."""
        self._act(item, ops.release)

    def fail(self, item: str, error: object = "failed") -> None:
        """Count a failed attempt on ``item`` (recorded as ``last_error``); after ``max_attempts``
        the item is ``failed``, else it goes back to the queue."""
        error_text = str(error)[:10_000]
        self._act(item, lambda c, d, q, w, keys: ops.fail(c, d, q, w, keys, error_text, self.max_attempts))

    def _act(self, item: str, op: Callable[..., set[int]]) -> None:
        self._ensure_process()
        db, qid, wid = self._db, self._qid, self._member.worker_id
        with self._lock:
            self._check_usable()
            held = self._book.find(item)
            keys = [held.key]
            accepted = db.tx(lambda c: op(c, db.dialect, qid, wid, keys))
            self._book.drop(held)
            if op is not ops.complete and held.item_id in accepted:
                self._news += 1  # back in the queue: another thread's take() may claim it
                self._changed.notify_all()
        if held.item_id not in accepted:
            action = {ops.complete: "complete", ops.release: "release"}.get(op, "fail")
            raise LeaseLost(f"cannot {action} {held!r} (epoch {held.epoch}, seq {held.seq}): its lease "
                            "expired and another worker holds or finished it")

    # ------------------------------------------------------------------ checkpoint-consistent consumption

    def cover(self, items: Sequence[WorkItem], step: int, ambiguous: int = 0) -> list[WorkItem]:
        """A model checkpoint at global ``step`` covers ``items`` (handed out, not yet done): mark
        them done in one transaction, stamped with ``step``, and record the save in
        ``wq_checkpoints`` (``ambiguous``: hand-outs the caller left for a later save). Use with
        ``auto_complete=False``; :mod:`wq_sql.tf` calls it. Returns the items whose lease was lost
        (another worker holds or finished them); they are logged, not raised."""
        self._ensure_process()
        db, qid, wid = self._db, self._qid, self._member.worker_id
        with self._lock:
            self._check_usable()
            held = [i for i in items if self._book.out.get(i.item_id) is i]
            accepted = db.tx(lambda c: ops.cover(c, db.dialect, qid, wid, [i.key for i in held], int(step),
                                                 ambiguous))
            for i in held:
                self._book.out.pop(i.item_id, None)
            return self._book.settle(held, accepted, self.name)

    def reopen_after(self, step: Optional[int]) -> int:
        """This worker's model was restored from its checkpoint at global ``step`` (``None``: from
        no checkpoint): put back to the queue every item that a later checkpoint of this worker
        identity had covered (:meth:`cover`). Items it still held come back through same-identity
        recovery. Returns how many items were re-opened."""
        self._ensure_process()
        db, qid, wid = self._db, self._qid, self._member.worker_id
        with self._lock:
            self._check_usable()
            at = None if step is None else int(step)
            n = db.tx(lambda c: ops.reopen_after(c, db.dialect, qid, wid, at))
        if n:
            log.warning("worker %r restored from checkpoint step %s: %d item(s) covered by later "
                        "checkpoints went back to queue %r", self.worker, step, n, self.name)
        return n

    # ------------------------------------------------------------------ items another process consumes

    @property
    def worker_id(self) -> int:
        """This worker identity's row id (``wq_workers.id``): the holder that
        :meth:`complete_handed` needs to acknowledge items this worker handed to another process."""
        return self._member.worker_id

    def hand_off(self, items: Sequence[WorkItem]) -> None:
        """Stop tracking handed-out items whose data went to another process, which acknowledges
        them (:meth:`complete_handed`; use with ``auto_complete=False``). They stay claimed in the
        database, and this object no longer renews, completes, releases or fails them:
        ``close()`` leaves them claimed. If nobody acknowledges them, they come back as a crashed
        worker's items do (to this identity's next process first, else after their lease)."""
        with self._lock:
            for item in items:
                if self._book.out.get(item.item_id) is item:
                    self._book.drop(item)

    def still_held(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Those of ``items`` that this worker still holds by the database (claimed by it under the
        same token), in one read; the others were completed (or lost) meanwhile."""
        self._ensure_process()
        held = {(c.id, c.token) for c in self._db.tx(
            lambda c: ops.held_by(c, self._qid, self._member.worker_id), read=True)}
        return [i for i in items if i.key in held]

    def complete_handed(self, handed: Mapping[int, Sequence[WorkItem]]) -> list[WorkItem]:
        """Mark done, in one transaction, items that other workers of this queue claimed and handed
        to this process: ``{holder: items}``, each holder by its :attr:`worker_id`. Fenced by
        ``(id, token)`` like :meth:`complete`; the events and counters name the holder. Returns the
        items whose lease was lost (another worker holds or finished them), logged, not raised."""
        self._ensure_process()
        with self._lock:
            self._check_usable()
        work = [(holder, [i.key for i in items]) for holder, items in handed.items() if items]

        def done(conn: Any) -> set[int]:
            # The claim round's acknowledgement, claiming nothing: the hot path's statement,
            # several times cheaper per item than ops.complete.
            accepted: set[int] = set()
            for holder, keys in work:
                accepted |= self._round.run(conn, self._qid, holder, keys, 0)[0]
            return accepted

        accepted = self._db.driver_tx(done) if work else set()
        with self._lock:
            return self._book.settle([i for items in handed.values() for i in items], accepted, self.name)

    # ------------------------------------------------------------------ progress and lifecycle

    def progress(self) -> Progress:
        """Counts from the counters table (no scan of the items)."""
        def read(c: Connection) -> tuple[tuple[int, int], int]:
            return ops.progress(c, self._qid), ops.epochs_created(c, self._qid)

        (done, failed), created = self._db.tx(read, read=True)
        return Progress(self.items_per_epoch * self.num_epochs, done, failed, created,
                        self.num_epochs, self.items_per_epoch)

    def extend_epochs(self, num_epochs: int) -> None:
        """Raise the queue's ``num_epochs`` (never lower it); every worker sees it on join."""
        check_num_epochs(num_epochs)
        got = self._db.tx(lambda c: ops.extend_epochs(c, self._qid, num_epochs))
        if not got:
            raise InvalidInput(f"num_epochs can only grow; queue {self.name!r} already has more")
        self.num_epochs = got

    def close(self, *, _failed: Optional[BaseException] = None) -> None:
        """Acknowledge what was handed out, give back what was claimed ahead, and leave."""
        mine = os.getpid() == self._pid
        r = self._refiller
        if r is not None and mine:
            r.stop()  # outside the lock: its claim in flight needs the lock to finish
        if mine:
            self._epochs.stop(timeout=self.busy_timeout)
        with self._lock:
            if self._closed:
                return
            while self._filling:  # a prefetch() in flight adds its items to the buffer first
                self._changed.wait()
            self._closed = True
            self._changed.notify_all()  # takes waiting in other threads see it closed
            _live.discard(self)
            self._heartbeat.stop_event.set()
            if not mine or self._superseded:
                self._db.close()
                return
            db, qid, wid, book = self._db, self._qid, self._member.worker_id, self._book
            done = list(book.acks.values())
            give_back = list(book.buffer)
            failing: list[WorkItem] = []
            if _failed is not None and isinstance(_failed, Exception):
                failing = list(book.out.values())
            elif self.auto_complete and _failed is None:
                done += list(book.out.values())
            else:
                give_back += list(book.out.values())
            error = f"{type(_failed).__name__}: {_failed}"[:10_000] if failing else ""

            def leave(c: Connection) -> set[int]:
                d = db.dialect
                accepted = ops.complete(c, d, qid, wid, [i.key for i in done])
                ops.release(c, d, qid, wid, [i.key for i in give_back])
                ops.fail(c, d, qid, wid, [i.key for i in failing], error, self.max_attempts)
                ops.close_worker(c, wid, self._member.incarnation)
                return accepted

            try:
                book.settle(done, db.tx(leave), self.name)
            finally:
                book.clear()
                self._heartbeat.stop()
                db.close()

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self.close(_failed=exc)

    def __repr__(self) -> str:
        return (f"WorkQueue(name={self.name!r}, url={safe_url(self._db.url)!r}, worker={self.worker!r}, "
                f"items_per_epoch={self.items_per_epoch}, num_epochs={self.num_epochs})")

    def _check_usable(self) -> None:
        if self._closed:
            raise WqSqlError(f"queue {self.name!r} is closed")
        if self._superseded:
            raise WorkerConflict(f"another process took over worker {self.worker!r} while this one "
                                 "was not heartbeating (stopped or partitioned); its items were handed on")

    def _ensure_process(self) -> None:
        """After ``fork()``: the child opens its own connections under its own identity."""
        if os.getpid() == self._pid:
            return
        with self._lock:
            if os.getpid() == self._pid:
                return
            self._db.in_child()
            self._pid = os.getpid()
            self._filling = False
            self._refiller = None  # the parent's threads do not exist here
            self._epochs.forget_thread()
            self._pace = Pace()
            self._book.clear()
            self.worker = f"{self.worker}+{self._pid}" if self._worker_given else default_worker_name()
            self._register()
            _live.add(self)


@atexit.register
def _close_all() -> None:
    """A normal interpreter exit is a clean exit: acknowledge what was handed out."""
    for wq in list(_live):
        try:
            wq.close()
        except Exception as e:  # the database may be gone at exit; leases cover it
            log.warning("closing queue %r at exit failed: %s", wq.name, e)


def handed_out_by(item: str) -> Optional[tuple[WorkQueue, WorkItem]]:
    """The open queue object of this process that handed ``item`` out recently, and the
    hand-out itself (None if none did)."""
    for wq in list(_live):
        held = wq.recent(item)
        if held is not None:
            return wq, held
    return None


def _after_fork_in_child() -> None:
    """Locks that another thread of the parent held at ``fork()`` (say, inside ``take()``) would
    stay held forever in the child, where that thread does not exist: give every queue fresh
    ones before the child touches it (``_ensure_process`` then re-registers it). The database
    handles reset their own state (``db.py``)."""
    for wq in list(_live):
        wq._lock = threading.RLock()
        wq._changed = threading.Condition(wq._lock)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
