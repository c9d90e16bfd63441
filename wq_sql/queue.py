"""The public facade: ``WorkQueue`` owns the engine, the transactions, the local buffer of claimed
items and the heartbeat thread. Statements live in ``wq_sql.ops``."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import random
import sqlite3
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from wq_sql import ops
from wq_sql.engine import Backend, driver_transaction, make_engine, open_error, resolve_url, safe_url
from wq_sql.epochs import EpochMaker
from wq_sql.errors import (
    DatabaseBusy,
    DatabaseUnavailable,
    InvalidInput,
    LeaseLost,
    QueueConfigMismatch,
    QueueEmpty,
    QueueExhausted,
    QueueNotFound,
    WorkerConflict,
    WqSqlError,
)
from wq_sql.identity import (
    check_worker_name,
    default_worker_name,
    hostname,
    process_alive,
    process_start,
)
from wq_sql.liveness import why_gone
from wq_sql.migrate import ensure_schema
from wq_sql.mismatch import DEFAULT_MAX_ATTEMPTS, differences, extend_to
from wq_sql.pacer import JustInTime, Pace
from wq_sql.plan import (
    QueueSpec,
    Work,
    check_num_epochs,
    check_num_slices,
    check_seed,
    check_text,
    new_seed,
    normalize_works,
)
from wq_sql.sources import plan_items, read_slice

log = logging.getLogger("wq_sql")
T = TypeVar("T")

_live: weakref.WeakSet[WorkQueue] = weakref.WeakSet()
_RECENT = 4096  # hand-outs that read() finds by their string alone
ORPHAN_POLLS = 2  # a waiting take() looks for items it holds but does not know after this many polls
CHECKPOINT_SECONDS = 1.0  # SQLite: how often the heartbeat thread checkpoints the WAL
# SQLite: the longest a statement waits for the write lock before _retrying tries again, after
# LOCK_RETRY seconds (with jitter): see engine.make_engine(lock_slice=).
LOCK_SLICE, LOCK_RETRY = 0.05, 0.002


class WorkItem(str):
    """A work string as handed out (``prefix + work``), carrying which item it is, so that
    ``complete``/``release``/``fail`` act on exactly this hand-out even when works repeat."""

    __slots__ = ("work", "epoch", "seq", "item_id", "token", "attempts")
    work: str
    epoch: int
    seq: int
    item_id: int
    token: int
    attempts: int

    def __new__(cls, value: str, work: str, claimed: ops.Claimed) -> WorkItem:
        self = super().__new__(cls, value)
        self.work, self.epoch, self.seq = work, claimed.epoch, claimed.seq
        self.item_id, self.token, self.attempts = claimed.id, claimed.token, claimed.attempts
        return self

    @property
    def key(self) -> tuple[int, int]:
        return (self.item_id, self.token)

    def __reduce__(self) -> Any:
        c = ops.Claimed(self.item_id, self.epoch, self.seq, -1, self.token, self.attempts)
        return (WorkItem, (str(self), self.work, c))


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
        self.name = _check_name(name)
        self._attach = works is None
        if not self._attach:
            assert works is not None
            spec = QueueSpec(normalize_works(works), check_num_epochs(num_epochs), bool(shuffle),
                             check_seed(seed), check_num_slices(num_slices), _check_prefix(prefix))
        _check_seconds("lease_seconds", lease_seconds)
        _check_positive("busy_timeout", busy_timeout)
        _check_positive("poll_seconds", poll_seconds)
        _check_count("lease_ahead", lease_ahead)
        if max_attempts is not None:
            _check_count("max_attempts", max_attempts)
        if max_item_seconds is not None:
            _check_seconds("max_item_seconds", max_item_seconds)
        if heartbeat_seconds is not None:
            _check_seconds("heartbeat_seconds", heartbeat_seconds)
        self.lease_seconds = float(lease_seconds)
        self.lease_ahead = lease_ahead
        self.auto_complete = auto_complete
        self.max_item_seconds = max_item_seconds
        self.heartbeat_seconds = float(heartbeat_seconds if heartbeat_seconds is not None
                                       else min(self.lease_seconds / 6.0, 5.0))
        if self.heartbeat_seconds * 2 > self.lease_seconds:
            raise InvalidInput("heartbeat_seconds must be at most half of lease_seconds, or leases "
                               "of live workers would expire between two heartbeats")
        # Another process holds an identity until its heartbeat is this old.
        self.dead_after = 3.0 * self.heartbeat_seconds
        self.poll_seconds = float(poll_seconds)
        self.busy_timeout = float(busy_timeout)
        self.schema = schema
        self._url = resolve_url(url) if engine is None else engine.url
        # Connections: claims, heartbeat, and making the next epoch in the background.
        self._engine = engine or make_engine(self._url, schema=schema, busy_timeout=busy_timeout, pool_size=3,
                                             autocheckpoint=False, lock_slice=LOCK_SLICE)
        self._backend = Backend(self._engine.dialect.name)
        self._worker_given = worker is not None
        self.worker = check_worker_name(worker if worker is not None else default_worker_name())

        self._lock = threading.RLock()
        self._buffer: deque[WorkItem] = deque()      # claimed, not yet handed out
        self._out: dict[int, WorkItem] = {}          # handed out, not yet acknowledged
        self._acks: dict[int, WorkItem] = {}         # to be marked done in the next transaction
        self._closed = False
        self._superseded = False
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._gate = _TxGate()
        self._filling = False                        # a prefetch() round trip is in flight
        self._handed = 0                             # items of the last take_many()
        self._recent: OrderedDict[str, WorkItem] = OrderedDict()  # last hand-outs, for read(str)
        self.claim_ahead = bool(claim_ahead)
        self._pace = Pace()                          # how often this worker takes items
        self._jit: Optional[JustInTime] = None       # claims the next item just in time
        self._no_expire_until = 0.0                  # after an outage: let others renew first
        self._reached = False                        # a transaction succeeded: outages are waited for
        self._epochs = EpochMaker(self)              # makes the next epochs
        # Notified when the buffer gets items or something in this process may have made an
        # item claimable (``_news`` counts those): a waiting take() wakes at once (see _wait).
        self._changed = threading.Condition(self._lock)
        self._news = 0

        try:
            self._retrying(lambda: ensure_schema(self._engine, schema))
            row = self._open(None if self._attach else spec, max_attempts)
            self._qid: int = row.id
            self.num_epochs: int = row.num_epochs
            self.shuffle: bool = row.shuffle
            self.seed: int = row.seed
            self.num_slices: Optional[int] = row.num_slices
            self.items_per_epoch: int = row.n_works
            self.max_attempts: int = row.max_attempts
            self.prefix: Optional[str] = row.prefix if self._attach else spec.prefix
            self._epochs_created: int = row.epochs_created
            self._round = ops.ClaimRound(self._backend, lease_ahead, self.lease_seconds, schema)
            self.epoch_chunk = ops.EPOCH_CHUNK_SQLITE if self._backend.is_sqlite else ops.EPOCH_CHUNK_PG
            self._register()
            _live.add(self)
        except BaseException:
            if engine is None:
                self._engine.dispose()
            raise

    @classmethod
    def attach(cls, name: str = "work_queue", **kwargs: Any) -> WorkQueue:
        """Join an existing queue without repeating its works: ``WorkQueue.attach("q", url=...)``."""
        return cls(None, name=name, **kwargs)

    # ------------------------------------------------------------------ transactions

    def _tx(self, fn: Callable[[Connection], T], *, read: bool = False) -> T:
        """Run ``fn`` in one transaction (see :meth:`_retrying`)."""
        def once() -> T:
            with self._gate, self._engine.connect() as conn:
                if read:
                    conn.execution_options(wq_read=True)
                with conn.begin():
                    return fn(conn)
        return self._retrying(once)

    def _claim_round(self, acks: list[WorkItem], limit: Optional[int] = None
                     ) -> tuple[set[int], list[ops.Claimed], dict[int, str]]:
        """The hot path: one claim round (``ops.ClaimRound``) in one transaction, on the driver's
        connection (see ``engine.driver_transaction``), retried like :meth:`_tx`."""
        keys = [a.key for a in acks]

        def once() -> tuple[set[int], list[ops.Claimed], dict[int, str]]:
            with self._gate, driver_transaction(self._engine) as conn:
                return self._round.run(conn, self._qid, self._worker_id, keys, limit)
        return self._retrying(once)

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying what is transient: SQLite locked past its busy handler (every
        few ms, up to ``busy_timeout``, then :class:`DatabaseBusy`); on Postgres a lost or
        refused connection (a restart, ``pg_terminate_backend``), a deadlock or a serialization
        failure (up to ``busy_timeout`` too). Each retry reruns the whole transaction. A database
        this queue object never reached is not waited for: a refused port or an unknown host is
        a wrong URL or a server not started, and raises :class:`DatabaseUnavailable` at once."""
        start = time.monotonic()
        deadline = start + self.busy_timeout
        delay = 0.01
        outage = False
        while True:
            try:
                result = fn()
                self._reached = True
                if outage:
                    log.warning("queue %r: the database is back after %.1fs; continuing", self.name,
                                time.monotonic() - start)
                    # Everyone's leases ran on while nobody could renew them: give the other
                    # workers time to reconnect (their retry pause is at most 1.5 s) and renew
                    # theirs (a few heartbeats) before expiring anything.
                    self._no_expire_until = time.monotonic() + 1.5 + 3 * self.heartbeat_seconds
                return result
            except DBAPIError as e:
                why = _transient(e, self._backend, self._reached)
                if why is None:
                    unavailable = open_error(self._url, e)
                    if unavailable is None:
                        raise
                    raise unavailable from e
                if time.monotonic() >= deadline:
                    if why == "locked":
                        raise DatabaseBusy(
                            f"the SQLite database {safe_url(self._url)} stayed locked for "
                            f"{self.busy_timeout:.0f}s; raise busy_timeout= or use fewer writers") from None
                    if why in _LOST:
                        unavailable = open_error(self._url, e)
                        raise DatabaseUnavailable(
                            f"the database stayed unreachable for {self.busy_timeout:.0f}s (busy_timeout=, "
                            f"raise it to wait longer): {unavailable or safe_url(self._url)}") from e
                    raise
                if why in _LOST and not outage:
                    # Operators should see a restart or failover, not only DEBUG logs.
                    log.warning("queue %r: database connection lost (%s); retrying for up to %.0fs "
                                "(busy_timeout)", self.name, why, self.busy_timeout)
                    outage = True
                log.debug("retrying transaction: %s", why)
                if why == "locked":  # every few ms, not backing off: see LOCK_SLICE
                    time.sleep(LOCK_RETRY * (0.5 + random.random()))
                    continue
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)

    # ------------------------------------------------------------------ opening and joining

    def _open(self, spec: Optional[QueueSpec], max_attempts: Optional[int]) -> Any:
        row = self._tx(lambda c: ops.find_queue(c, self.name), read=True)
        if row is None and spec is None:
            raise QueueNotFound(f"no queue named {self.name!r} in {safe_url(self._url)}; create it "
                                "with WorkQueue(works, name=...) first")
        if row is None:
            assert spec is not None
            items = plan_items(spec.works, spec.num_slices, self._engine, spec.prefix)  # no transaction
            seed = spec.seed if spec.seed is not None else new_seed()

            def create(c: Connection) -> tuple[Optional[int], Any]:
                qid = ops.create_queue(c, self._backend, self.name, spec, items, seed,
                                       DEFAULT_MAX_ATTEMPTS if max_attempts is None else max_attempts)
                return qid, ops.find_queue(c, self.name)

            qid, row = self._tx(create)
            if qid is not None:
                log.info("created queue %r: %d items per epoch, %d epochs", self.name,
                         row.n_works, row.num_epochs)

        def check(c: Connection) -> tuple[list[str], tuple[int, int]]:
            return differences(c, row, spec, max_attempts), ops.progress(c, row.id)

        diffs, (done, failed) = self._tx(check, read=True)
        if diffs:
            raise QueueConfigMismatch(self.name, diffs, extend_to(row, spec))
        if done + failed >= row.n_works * row.num_epochs:
            log.warning("queue %r is already finished (%d done, %d failed): take() will raise "
                        "QueueExhausted. Use another name, or reset it to start over.",
                        self.name, done, failed)
        return row

    def _register(self) -> None:
        """Take this worker identity, waiting briefly for a dead predecessor to be recognised as
        dead; a live holder of the same identity is an error."""
        self._incarnation = uuid.uuid4().hex
        host, pid, start = hostname(), os.getpid(), process_start(os.getpid())
        deadline = time.monotonic() + self.dead_after + self.heartbeat_seconds
        b = self._backend

        def attempt(c: Connection) -> tuple[str, Any]:
            wid = ops.insert_worker(c, b, self._qid, self.worker, self._incarnation, host, pid, start,
                                   self.heartbeat_seconds)
            if wid is not None:
                return "ok", (wid, [])
            row = ops.find_worker(c, self._qid, self.worker, lock=True)
            if row is None:
                raise QueueNotFound(f"queue {self.name!r} was dropped while this worker joined it")
            if row.heartbeat_at is not None:
                if row.host == host:
                    if process_alive(row.pid, row.proc_start):
                        return "live", row
                else:
                    age = ops.heartbeat_age(c, b, row.id)
                    if age is not None and age < self.dead_after:
                        return "wait", row
            ops.take_over_worker(c, b, row.id, self._incarnation, host, pid, start, self.heartbeat_seconds)
            return "ok", (row.id, ops.recover(c, b, self._qid, row.id, self.lease_seconds,
                                              self.max_attempts))

        while True:
            status, value = self._tx(attempt)
            if status == "ok":
                break
            if status == "wait" and time.monotonic() < deadline:
                time.sleep(min(0.5, self.heartbeat_seconds))
                continue
            raise WorkerConflict(
                f"worker {self.worker!r} of queue {self.name!r} is already held by a live process "
                f"(pid {value.pid} on {value.host}); give each process its own worker= "
                "(or $WQ_SQL_WORKER), or stop the other one first")
        self._worker_id, recovered = value
        if recovered:
            log.warning("worker %r recovered %d item(s) its previous process held", self.worker,
                        len(recovered))
            works = self._tx(lambda c: ops.works_by_idx(c, self._qid, [r.work_idx for r in recovered]),
                             read=True)
            self._buffer.extend(self._wrap(r, works) for r in recovered)
        self._stop.clear()
        self._heartbeat = threading.Thread(target=_heartbeat_loop, args=(weakref.ref(self), self._stop),
                                           name=f"wq_sql-heartbeat-{self.name}", daemon=True)
        self._heartbeat.start()

    def _wrap(self, c: ops.Claimed, works: dict[int, str]) -> WorkItem:
        work = works[c.work_idx]
        return WorkItem((self.prefix or "") + work, work, c)

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
                if self.auto_complete:
                    self._acks.update(self._out)
                    self._out.clear()
                while not self._buffer and self._filling:  # prefetch() is claiming: no 2nd claim
                    self._changed.wait()
                if not self._buffer:
                    self._fill(claim)
                if self._buffer:
                    got = [self._buffer.popleft() for _ in range(min(max(1, n), len(self._buffer)))]
                    for item in got:
                        self._out[item.item_id] = item
                        self._recent[item] = item
                        self._recent.move_to_end(item)
                    while len(self._recent) > _RECENT:
                        self._recent.popitem(last=False)
                    self._handed = len(got)
                    self._pace.handed_out(time.monotonic())
                    if self.claim_ahead:
                        if self._jit is None or not self._jit.alive():
                            self._jit = JustInTime(self)
                        self._jit.schedule(self._pace)
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
        while True:
            next_poll = time.monotonic() + pause * (0.5 + random.random())
            with self._lock:
                while True:
                    if self._buffer or self._news != news or self._closed:
                        return  # take_many() hands out, claims again, or says it is closed
                    now = time.monotonic()
                    if (deadline is not None and now >= deadline) or (stop is not None and stop()):
                        raise QueueEmpty(f"no item of queue {self.name!r} is claimable now; other "
                                         "workers still hold the remaining ones")
                    if now >= next_poll:
                        break
                    self._changed.wait(min(next_poll, deadline if deadline is not None else next_poll) - now)
            pause = min(pause * 2, cap)
            peek = self._tx(lambda c: ops.peek(c, self._backend, self._qid, self._worker_id), read=True)
            if (peek.pending or peek.expired or peek.finished >= total
                    or peek.epochs_created != self._epochs_created):
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
            held = self._tx(lambda c: ops.held_by(c, self._qid, self._worker_id), read=True)
            known = {i.item_id for i in self._buffer} | self._out.keys() | self._acks.keys()
            lost = [c for c in held if c.id not in known]
            if not lost:
                return False
            works = self._tx(lambda c: ops.works_by_idx(c, self._qid, [x.work_idx for x in lost]),
                             read=True)
            log.warning("queue %r: worker %r holds %d item(s) that it never handed out and no part of "
                        "it knew about; handing them out now: %s", self.name, self.worker, len(lost),
                        ", ".join(f"(epoch {c.epoch}, seq {c.seq})" for c in lost))
            self._buffer.extend(self._wrap(c, works) for c in lost)
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

    def _fill(self, limit: Optional[int] = None) -> None:
        """One round trip: acknowledge finished items and claim up to ``limit`` (at most
        ``lease_ahead``, the default) new ones. If none is claimable, try to make the next epoch,
        detect the end, or return expired items, in that order."""
        b, qid = self._backend, self._qid
        acks = list(self._acks.values())
        limit = self.lease_ahead if limit is None else max(1, min(limit, self.lease_ahead))
        created = self._epochs_created
        accepted, got, works = self._claim_round(acks, limit)
        self._settle_acks(acks, accepted)
        self._buffer.extend(self._wrap(g, works) for g in got)
        if got:
            self._epochs.after_claim(got)
            return
        if self._epochs_created != created:  # the epoch maker committed rows the claim did not see
            return self._fill(limit)
        # Nothing pending. The next epoch may be missing (a crash between a claim and its
        # advance), the queue may be finished (checked before expiring leases: a finished queue
        # holds none, and the end of every worker's drain comes here), or leases may have expired.
        if self._epochs.make():
            return self._fill(limit)
        def finished(c: Connection) -> tuple[int, int, int]:
            done, failed = ops.progress(c, qid)
            return done, failed, ops.find_queue_by_id(c, qid).num_epochs

        done, failed, num_epochs = self._tx(finished, read=True)
        if num_epochs != self.num_epochs:  # another worker called extend_epochs()
            self.num_epochs = num_epochs
            return self._fill(limit)
        if done + failed >= self.items_per_epoch * self.num_epochs:
            raise QueueExhausted(self.name, done, failed)
        if time.monotonic() >= self._no_expire_until and self._tx(
                lambda c: ops.expire(c, b, qid, self.max_attempts)):
            return self._fill(limit)

    def prefetch(self, min_claim: int = 1) -> int:
        """Top the buffer of claimed items up to ``lease_ahead`` in one round trip (which also
        sends the pending acknowledgements), if at least ``min_claim`` places are free. Unlike
        ``take()``, the queue's lock is not held during the round trip, so another thread can take
        buffered items meanwhile: a background thread calling this keeps ``take()`` off the
        database. One refill at a time (``take()`` on an empty buffer waits for it instead of
        claiming too), so claimed-but-not-handed-out items stay at most ``lease_ahead``; after a
        ``take_many()``, its items but one count against ``lease_ahead`` too, so claimed items not
        yet reached by the consumer stay at most ``lease_ahead``.

        Returns how many items were claimed: 0 when the buffer is full enough, another refill
        runs, or nothing is claimable now (then ``take()`` makes the next epoch, recovers expired
        leases, waits or raises ``QueueExhausted``, as without prefetching)."""
        self._ensure_process()
        with self._lock:
            self._check_usable()
            n = self.lease_ahead - len(self._buffer) - max(0, self._handed - 1)
            if self._filling or n < max(1, min_claim):
                return 0
            acks = list(self._acks.values())
            for a in acks:  # in flight: complete()/close() must not act on them a second time
                del self._acks[a.item_id]
            self._filling = True
        try:
            accepted, got, works = self._claim_round(acks, limit=n)
        except BaseException:
            with self._lock:
                self._acks.update((a.item_id, a) for a in acks)
                self._filling = False
                self._changed.notify_all()
            raise
        with self._lock:  # one critical section: a waiting take() sees the buffer filled
            try:
                self._settle_acks(acks, accepted)
                self._buffer.extend(self._wrap(g, works) for g in got)
            finally:
                self._filling = False
                self._changed.notify_all()
        self._epochs.after_claim(got)
        return len(got)

    def stop_refills(self) -> None:
        """Claim nothing ahead until the next hand-out: the claim-ahead thread stops (the next
        ``take()`` starts it again) and a :meth:`prefetch` in flight lands in the buffer first.
        For a consumer whose data ends before the queue's (``wq_sql.tf``'s synchronous end), so
        that no item is claimed into a buffer that nobody will look at."""
        jit = self._jit
        if jit is not None and os.getpid() == self._pid:
            jit.stop()
        with self._lock:
            while self._filling:
                self._changed.wait()

    def _settle_acks(self, sent: list[WorkItem], accepted: set[int]) -> list[WorkItem]:
        lost = []
        for item in sent:
            self._acks.pop(item.item_id, None)
            if item.item_id not in accepted:
                lost.append(item)
        if lost:
            log.warning("%d item(s) of queue %r were finished after their lease expired and were "
                        "handed to another worker meanwhile; their completion was rejected: %s",
                        len(lost), self.name, ", ".join(f"(epoch {i.epoch}, seq {i.seq})" for i in lost))
        return lost

    # ------------------------------------------------------------------ reading sliced works

    def read(self, item: str, **options: Any) -> Iterator[Any]:
        """The records of a sliced item (``table:``/``lines:`` works, or a registered source), read
        from its source by the bounds stored at creation. ``item`` is what :meth:`take` returned
        (or its string, among this object's last 4096 hand-outs). Options go to the source, e.g.
        ``columns=["id", "text"]`` for tables. A table row is a tuple, a line is ``bytes``."""
        held = item if isinstance(item, WorkItem) else self._recent.get(item)
        if held is None:
            raise InvalidInput(f"{item!r} is not among the items this queue object handed out "
                               "recently; pass what take() returned")
        found = self._tx(lambda c: ops.item_bounds(c, self._qid, held.item_id), read=True)
        if found is None:
            raise InvalidInput(f"{item!r} is not an item of queue {self.name!r}")
        work, bounds = found
        if bounds is None:
            raise InvalidInput(f"{work!r} is a plain work, handed out whole: read it with your own "
                               "reader (only table:, lines: and registered sources are sliced)")
        return read_slice(bounds, self._engine, **options)

    def records(self, **options: Any) -> Iterator[Any]:
        """Every record of every item this worker takes, item after item: ``for row in
        wq.records(): ...``. An item is done when the next one is taken (``auto_complete``), so
        after a crash the records of at most the item in progress are read again."""
        for item in self:
            yield from self.read(item, **options)

    # ------------------------------------------------------------------ explicit control

    def _find(self, item: str) -> WorkItem:
        if isinstance(item, WorkItem):
            found = self._out.get(item.item_id) or self._acks.get(item.item_id)
            if found is not None and found.token == item.token:
                return found
            raise InvalidInput(f"{item!r} (epoch {item.epoch}, seq {item.seq}) is not an item this "
                               "queue object holds: it was already completed, released or failed")
        for pool in (self._out, self._acks):
            for held in pool.values():
                if held == item:
                    return held
        raise InvalidInput(f"{item!r} is not an item this queue object holds; pass what take() returned")

    def complete(self, item: str) -> None:
        """Mark ``item`` done now; raises :class:`LeaseLost` if its lease was lost meanwhile."""
        self._act(item, "complete")

    def release(self, item: str) -> None:
        """Give ``item`` back to the queue without counting an attempt."""
        self._act(item, "release")

    def fail(self, item: str, error: object = "failed") -> None:
        """Count a failed attempt on ``item`` (recorded as ``last_error``); after ``max_attempts``
        the item is ``failed``, else it goes back to the queue."""
        self._act(item, "fail", str(error)[:10_000])

    def _act(self, item: str, action: str, error: str = "") -> None:
        self._ensure_process()
        b, qid, wid = self._backend, self._qid, self._worker_id
        with self._lock:
            self._check_usable()
            held = self._find(item)
            keys = [held.key]
            if action == "complete":
                accepted = self._tx(lambda c: ops.complete(c, b, qid, wid, keys))
            elif action == "release":
                accepted = self._tx(lambda c: ops.release(c, b, qid, wid, keys))
            else:
                accepted = self._tx(lambda c: ops.fail(c, b, qid, wid, keys, error, self.max_attempts))
            self._out.pop(held.item_id, None)
            self._acks.pop(held.item_id, None)
            if action != "complete" and held.item_id in accepted:
                self._news += 1  # back in the queue: another thread's take() may claim it
                self._changed.notify_all()
        if held.item_id not in accepted:
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
        b, qid, wid = self._backend, self._qid, self._worker_id
        with self._lock:
            self._check_usable()
            held = [i for i in items if self._out.get(i.item_id) is i]
            accepted = self._tx(lambda c: ops.cover(c, b, qid, wid, [i.key for i in held], int(step),
                                                    ambiguous))
            for i in held:
                self._out.pop(i.item_id, None)
            return self._settle_acks(held, accepted)

    def reopen_after(self, step: Optional[int]) -> int:
        """This worker's model was restored from its checkpoint at global ``step`` (``None``: from
        no checkpoint): put back to the queue every item that a later checkpoint of this worker
        identity had covered (:meth:`cover`). Items it still held come back through same-identity
        recovery. Returns how many items were re-opened."""
        self._ensure_process()
        b, qid, wid = self._backend, self._qid, self._worker_id
        with self._lock:
            self._check_usable()
            n = self._tx(lambda c: ops.reopen_after(c, b, qid, wid, None if step is None else int(step)))
        if n:
            log.warning("worker %r restored from checkpoint step %s: %d item(s) covered by later "
                        "checkpoints went back to queue %r", self.worker, step, n, self.name)
        return n

    # ------------------------------------------------------------------ progress and lifecycle

    def progress(self) -> Progress:
        """Counts from the counters table (no scan of the items)."""
        def read(c: Connection) -> tuple[tuple[int, int], int]:
            return ops.progress(c, self._qid), ops.epochs_created(c, self._qid)

        (done, failed), created = self._tx(read, read=True)
        return Progress(self.items_per_epoch * self.num_epochs, done, failed, created,
                        self.num_epochs, self.items_per_epoch)

    def extend_epochs(self, num_epochs: int) -> None:
        """Raise the queue's ``num_epochs`` (never lower it); every worker sees it on join."""
        check_num_epochs(num_epochs)
        got = self._tx(lambda c: ops.extend_epochs(c, self._qid, num_epochs))
        if not got:
            raise InvalidInput(f"num_epochs can only grow; queue {self.name!r} already has more")
        self.num_epochs = got

    def close(self, *, _failed: Optional[BaseException] = None) -> None:
        """Acknowledge what was handed out, give back what was claimed ahead, and leave."""
        jit = self._jit
        if jit is not None and os.getpid() == self._pid:
            jit.stop()  # outside the lock: its claim in flight needs the lock to finish
        if os.getpid() == self._pid:
            self._epochs.stop(timeout=self.busy_timeout)
        with self._lock:
            if self._closed:
                return
            while self._filling:  # a prefetch() in flight adds its items to the buffer first
                self._changed.wait()
            self._closed = True
            self._changed.notify_all()  # takes waiting in other threads see it closed
            _live.discard(self)
            self._stop.set()
            if os.getpid() != self._pid or self._superseded:
                self._engine.dispose(close=os.getpid() == self._pid)
                return
            b, qid, wid = self._backend, self._qid, self._worker_id
            done = list(self._acks.values())
            give_back = list(self._buffer)
            failing: list[WorkItem] = []
            if _failed is not None and isinstance(_failed, Exception):
                failing = list(self._out.values())
            elif self.auto_complete and _failed is None:
                done += list(self._out.values())
            else:
                give_back += list(self._out.values())
            error = f"{type(_failed).__name__}: {_failed}"[:10_000] if failing else ""

            def leave(c: Connection) -> set[int]:
                accepted = ops.complete(c, b, qid, wid, [i.key for i in done])
                ops.release(c, b, qid, wid, [i.key for i in give_back])
                ops.fail(c, b, qid, wid, [i.key for i in failing], error, self.max_attempts)
                ops.close_worker(c, wid, self._incarnation)
                return accepted

            try:
                self._settle_acks(done, self._tx(leave))
            finally:
                self._buffer.clear()
                self._out.clear()
                if self._heartbeat is not None:
                    self._heartbeat.join(timeout=5)
                self._engine.dispose()

    def __enter__(self) -> WorkQueue:
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        self.close(_failed=exc)

    def __repr__(self) -> str:
        return (f"WorkQueue(name={self.name!r}, url={safe_url(self._url)!r}, worker={self.worker!r}, "
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
            # Postgres: never close the parent's sockets. SQLite: close the inherited idle
            # connections, or the child's new ones share their in-process lock state (copied by
            # fork) instead of taking real file locks, and the parent's last close deletes the
            # WAL under the child's feet (its commits are lost). An inherited connection cannot
            # take the write lock while the parent holds the database open, so closing is safe.
            self._engine.dispose(close=self._backend.is_sqlite)
            self._pid = os.getpid()
            self._filling = False
            self._handed = 0
            self._jit = None  # the parent's threads do not exist here
            self._epochs.forget_thread()
            self._pace = Pace()
            self._buffer.clear()
            self._out.clear()
            self._acks.clear()
            self.worker = f"{self.worker}+{self._pid}" if self._worker_given else default_worker_name()
            self._register()
            _live.add(self)

    # for the heartbeat thread
    def _checkpoint(self) -> None:
        """SQLite: copy committed WAL pages into the database file (``PRAGMA
        wal_checkpoint(PASSIVE)``: it waits for no reader or writer, and does what it can). The
        engine wq_sql makes turns SQLite's automatic checkpoint off, which would otherwise run
        inside whichever claim's commit crossed 1,000 WAL pages, fsync included. Another
        process checkpointing at the same time makes this one a no-op."""
        with self._gate:
            if self._closed or os.getpid() != self._pid:
                return
            try:
                fairy = self._engine.raw_connection()
                try:
                    fairy.dbapi_connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # type: ignore[union-attr]
                finally:
                    fairy.close()
            except sqlite3.Error as e:  # best effort (busy: another checkpoint runs); never
                # let it end the heartbeat thread, whose lease renewals matter
                log.debug("checkpoint of %s skipped: %s", safe_url(self._url), e)

    def _beat(self) -> None:
        # close() joins this thread while holding the lock: once it is stopping, stop waiting
        # for the lock, or close() stalls for the whole join timeout (bench/long_tail.py).
        while not self._lock.acquire(timeout=0.05):
            if self._stop.is_set():
                return
        try:
            tokens = {i.token for pool in (self._buffer, self._out.values(), self._acks.values())
                      for i in pool}
            buffered = len(self._buffer)
            if self._closed or os.getpid() != self._pid:
                return
        finally:
            self._lock.release()
        b = self._backend
        ok = self._tx(lambda c: ops.renew(c, b, self._worker_id, self._incarnation, sorted(tokens),
                                          self.lease_seconds, self.max_item_seconds, buffered))
        if not ok:
            self._superseded = True
            return
        if time.monotonic() < self._no_expire_until:
            return
        gone = self._give_back_gone()
        n = self._tx(lambda c: ops.expire(c, b, self._qid, self.max_attempts))
        if n:
            log.info("queue %r: %d item(s) whose lease expired went back to the queue", self.name, n)
        if n or gone:
            self.wake()

    def _give_back_gone(self) -> int:
        """Return the items of workers that are gone (dead on this host, or not heartbeating:
        :mod:`wq_sql.liveness`) to the queue, without waiting for their leases."""
        b, host = self._backend, hostname()
        holders = self._tx(lambda c: ops.holders_to_check(c, b, self._qid, self._worker_id, host), read=True)
        total = 0
        for h in holders:
            gone = why_gone(h, host)
            if gone is None:
                continue
            why, dead = gone
            n = self._tx(functools.partial(ops.give_back_held, b=b, qid=self._qid, h=h,
                                           max_attempts=self.max_attempts, why=why, dead=dead))
            if n:
                log.warning("queue %r: %s; the %d item(s) it held went back to the queue", self.name, why, n)
            total += n
        return total


def _heartbeat_loop(ref: weakref.ref[WorkQueue], stop: threading.Event) -> None:
    """Renew leases every ``heartbeat_seconds``; on SQLite also checkpoint the WAL every
    ``CHECKPOINT_SECONDS`` (see :meth:`WorkQueue._checkpoint`)."""
    next_beat = 0.0
    while True:
        wq = ref()
        if wq is None:
            return
        now = time.monotonic()
        if not next_beat:
            next_beat = now + wq.heartbeat_seconds
        sqlite = wq._backend.is_sqlite
        del wq
        if stop.wait(max(0.0, min(next_beat - now, CHECKPOINT_SECONDS) if sqlite else next_beat - now)):
            return
        wq = ref()
        if wq is None:
            return
        try:
            if sqlite:
                wq._checkpoint()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + wq.heartbeat_seconds
                wq._beat()
        except (DBAPIError, WqSqlError) as e:  # the next beat tries again; leases outlast several
            log.warning("heartbeat of queue %r failed: %s", wq.name, e)
        del wq


_LOST = ("disconnected", "cannot connect")
# A server that answers, but cannot take this connection yet: worth waiting for on a first connect.
_SERVER_BUSY = ("the database system is starting up", "too many clients", "remaining connection slots")


def _transient(e: DBAPIError, b: Backend, reached: bool) -> Optional[str]:
    """Why ``e`` is worth retrying, or None. Before ``reached`` (no transaction of this queue
    object succeeded yet), a lost or refused connection is not, unless the server said it is busy."""
    if b.is_sqlite:
        msg = str(e.orig)
        return "locked" if ("locked" in msg or "busy" in msg) else None
    code = getattr(e.orig, "pgcode", None)
    lost: Optional[str] = None
    if e.connection_invalidated:
        lost = "disconnected"
    elif code is None and isinstance(e, OperationalError):
        msg = str(e.orig)
        if any(m in msg for m in ("authentication", "does not exist", "no password", "permission")):
            return None  # a configuration error: retrying cannot help
        lost = "cannot connect"  # refused, reset, server starting up: psycopg2 gives no code
    elif code and (code.startswith("08") or code in ("57P01", "57P02", "57P03")):
        lost = "disconnected"
    if lost is not None:
        return lost if reached or any(m in str(e.orig) for m in _SERVER_BUSY) else None
    if code in ("40P01", "40001"):
        return "deadlock or serialization failure"
    return None


def _check_name(name: object) -> str:
    if isinstance(name, str) and "\x00" in name:
        raise InvalidInput("name contains a NUL character, which neither backend can store")
    if not isinstance(name, str) or not name or len(name) > 200:
        raise InvalidInput(f"name must be a non-empty str of at most 200 characters, got {name!r}")
    check_text("name", name)
    if not any(ch.isprintable() and not ch.isspace() for ch in name):
        # Spaces or invisible characters only: a blank row in `wq-sql ls`, and hard to type.
        raise InvalidInput(f"name must contain a visible character (not only spaces or invisible "
                           f"ones), got {name!r}")
    return name


def _check_prefix(prefix: object) -> Optional[str]:
    if prefix is None:
        return None
    if isinstance(prefix, bytes):
        try:
            prefix = prefix.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidInput(f"prefix is not valid UTF-8 ({e}); pass str or UTF-8 bytes") from None
    if not isinstance(prefix, str) or "\x00" in prefix:
        raise InvalidInput(f"prefix must be None or a str without NUL, got {prefix!r}")
    check_text("prefix", prefix)
    return prefix


def _check_positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInput(f"{what} must be a positive number, got {value!r}")


def _check_seconds(what: str, value: object) -> None:
    """A duration the database adds to its clock: positive and at most 1e9 s (31 years), so it
    stays a valid interval (Postgres) and timestamp (SQLite)."""
    _check_positive(what, value)
    if not value <= 1e9:  # type: ignore[operator]
        raise InvalidInput(f"{what} must be at most 1e9 seconds (about 31 years), got {value!r}")


def _check_count(what: str, value: object) -> None:
    """A count stored in a 32-bit INTEGER column."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**31 - 1:
        raise InvalidInput(f"{what} must be an int from 1 to 2**31 - 1, got {value!r}")


@atexit.register
def _close_all() -> None:
    """A normal interpreter exit is a clean exit: acknowledge what was handed out."""
    for wq in list(_live):
        try:
            wq.close()
        except Exception as e:  # the database may be gone at exit; leases cover it
            log.warning("closing queue %r at exit failed: %s", wq.name, e)


class _TxGate:
    """Counts the transactions in flight, so that ``fork()`` can wait until there are none and
    hold new ones back meanwhile."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._shut = False

    def __enter__(self) -> None:
        with self._cond:
            while self._shut:
                self._cond.wait()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def shut(self) -> None:
        with self._cond:
            self._shut = True
            while self._active:
                self._cond.wait()

    def open(self) -> None:
        with self._cond:
            self._shut = False
            self._cond.notify_all()


_forking: list[_TxGate] = []


def _before_fork() -> None:
    """SQLite keeps per-process lock state that ``fork()`` copies: a child that inherits an open
    connection (worse, one inside another thread's write transaction) shares that state instead
    of taking real file locks, and waits forever or loses its commits. So wait until no thread
    is inside a SQLite transaction, and close the idle connections: the child inherits none."""
    for wq in list(_live):
        if wq._backend.is_sqlite and wq._pid == os.getpid() and not wq._closed:
            wq._gate.shut()
            _forking.append(wq._gate)
            wq._engine.dispose()


def _after_fork_in_parent() -> None:
    while _forking:
        _forking.pop().open()


def _after_fork_in_child() -> None:
    """Locks that another thread of the parent held at ``fork()`` (say, inside ``take()``) would
    stay held forever in the child, where that thread does not exist: give every queue fresh
    ones before the child touches it (``_ensure_process`` then re-registers it)."""
    _forking.clear()
    for wq in list(_live):
        wq._lock = threading.RLock()
        wq._changed = threading.Condition(wq._lock)
        wq._stop = threading.Event()
        wq._gate = _TxGate()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
