"""Handing out items: the stateful loop of one queue object.

A :class:`Dispenser` owns the queue object's lock and the condition its waits sleep on. It hands
out what the buffer holds; refills the buffer with claim rounds (in the caller's thread, or in
the refill thread: :meth:`prefetch`); when nothing is claimable it makes the next epoch, detects
the end of the queue or returns expired leases; and otherwise waits, woken by what it waits for
(an item landing in the buffer, :meth:`wake`) or by a read-only poll of the database.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from wq_sql.errors import QueueEmpty, QueueExhausted, WorkerConflict, WqSqlError
from wq_sql.store import notify, quarantine, statements
from wq_sql.store.db import Db
from wq_sql.store.hot import Carry, HotPath, Peek
from wq_sql.worker.book import Book, WorkItem
from wq_sql.worker.epochs import EpochMaker
from wq_sql.worker.heartbeat import Member
from wq_sql.worker.process import weak_method
from wq_sql.worker.refill import Pace, Refiller
from wq_sql.worker.sizing import Sizer, room

log = logging.getLogger("wq_sql")
ORPHAN_POLLS = 2  # a waiting take() looks for items it holds but does not know after this many polls
# The heartbeat comes a little after it was due, and a wait plans its next poll a little after
# its last one: this much of a poll interval is not counted against the spacing (before_beat).
BEAT_SLACK = 0.1
# A take that may wait (no deadline) subscribes to the bell once the queue is expected to run dry
# within this many seconds, not at its first wait (Dispenser.take_many).
LISTEN_AHEAD = 1.0
IDLE_PACES = 10  # claimed-ahead items go back once no take() came for this many of the worker's intervals,
# and a waiting take polls at the worker's pace for this many of them after its last hand-out


def before_beat(now: float, due: float, interval: float) -> float:
    """When a waiting take that polls every ``interval`` polls next, given that its heartbeat,
    which polls too (``Dispenser.ride_beat``), is due at ``due``: the time until the beat split
    into as many equal gaps of at least about ``interval`` as fit, so polls and beats together
    come at most once per interval, and the gaps stay ``interval`` when the heartbeat period is
    a multiple of it (5 s and 1 s, the defaults). With no room for a poll before the beat, the
    next poll is an interval after the beat was due (the beat polls first; this one only if it
    did not come)."""
    gaps = math.floor((due - now) / interval + BEAT_SLACK)
    return max(now, due) + interval if gaps <= 1 else now + (due - now) / gaps


@dataclass
class Extent:
    """How many items a queue has: ``num_epochs`` may grow (``extend_epochs``)."""

    items_per_epoch: int
    num_epochs: int

    @property
    def total(self) -> int:
        return self.items_per_epoch * self.num_epochs


@dataclass(frozen=True)
class Rules:
    """What one queue object's hand-outs follow (``WorkQueue``'s keywords of the same names)."""

    name: str
    worker: str
    lease_ahead: Optional[int]  # None: sized automatically (sizing.Sizer)
    poll_seconds: float
    max_attempts: int
    auto_complete: bool
    claim_ahead: bool


class Dispenser:
    """See the module docstring. ``book`` is shared with the owner, which reads and changes it
    only while holding :attr:`lock`; ``member`` is replaced after a fork re-registers."""

    def __init__(self, db: Db, hot: HotPath, member: Member, book: Book, epochs: EpochMaker,
                 extent: Extent, rules: Rules) -> None:
        self.db, self.hot, self.qid, self.member, self.book = db, hot, hot.qid, member, book
        self.epochs, self.extent, self.rules = epochs, extent, rules
        self.lock = threading.RLock()
        # Notified when the buffer gets items or something in this process may have made an item
        # claimable (``news`` counts those): a waiting take() wakes at once (see wait()).
        self.changed = threading.Condition(self.lock)
        self.news = 0
        self.closed = False
        self.superseded = False
        self.filling = False                        # a prefetch() round trip is in flight
        # Items of the last hand-out after its first, which the consumer reads one by one: not
        # reached until it takes again (the claim-ahead rule: wq_sql.worker.sizing).
        self.in_use = 0
        self.pace = Pace()                          # how often this worker takes items
        self.sizer = Sizer(rules.lease_ahead)       # how many items a round claims
        self.refiller: Optional[Refiller] = None   # refills the buffer in the background
        self.pid = os.getpid()
        # The doorbell (notify.py): rings of this queue heard so far, and how to stop hearing them
        # (subscribed at the first wait, so a worker that never waits opens no listener).
        self.rings = 0
        # The last ring that said the queue is finished: its number among the rings heard, and
        # what the ringer read (see heard()).
        self.end_heard: Optional[tuple[int, Peek]] = None
        self._deafen: Optional[Callable[[], None]] = None
        self._rows_rang = 0.0  # when epoch_rows() last rang
        # The last claim round got fewer items than it asked for: an acknowledgement of this
        # worker's may be the queue's last one (after_acks()).
        self.drained = False
        self._rang_end = False  # this object rang the queue's end (once is enough)
        # Takes waiting right now (_wait), and the last poll that rode on a heartbeat's renewal
        # (ride_beat): when it was read, and what it said.
        self.waiting = 0
        self.beat_peek: Optional[tuple[float, Peek]] = None
        # When this worker's next heartbeat is due (set once the heartbeat runs): a poll due
        # shortly before it waits for it instead (_poll_until).
        self.beat_due: Callable[[], Optional[float]] = lambda: None
        # The heartbeat's renewal that a claim round may carry (heartbeat.Heartbeat.carry), asked
        # with the usual spacing of this worker's rounds (seconds, smoothed; None until known).
        self.beat_carry: Callable[[Optional[float], Callable[[], tuple[set[int], int]]],
                                  Optional[Carry]] = lambda gap, held: None
        self._round_at = 0.0
        self._revoked: Optional[int] = None  # the queue's revoked counter, as last seen
        self._round_gap: Optional[float] = None

    def check_usable(self) -> None:
        if self.closed:
            raise WqSqlError(f"queue {self.rules.name!r} is closed")
        if self.superseded:
            raise WorkerConflict(f"another process took over worker {self.rules.worker!r} while this "
                                 "one was not heartbeating (stopped or partitioned); its items were "
                                 "handed on")

    def take(self, deadline: Optional[float]) -> WorkItem:
        """``WorkQueue.take``: :meth:`take_many` of one item, with the common case, an item in
        the buffer, in one short path (with items claimed ahead, most of a claim loop's Python is
        its ``take()`` calls, not its rounds)."""
        with self.lock:
            book = self.book
            if book.buffer and not (self.closed or self.superseded):
                now = time.monotonic()
                self.sizer.called(now)
                if self.rules.auto_complete:
                    book.ack_out()
                item = book.hand_one()
                self.in_use = 0
                self._handed(now, 1, deadline)
                return item
        return self.take_many(1, deadline, None, None)[0]

    def _handed(self, now: float, n: int, deadline: Optional[float]) -> None:
        """``n`` items were just handed out, at ``now``, by a take with ``deadline`` (the lock
        held)."""
        self.pace.handed_out(now)
        self.sizer.handed_out(now, n)
        # Claim ahead only once the buffer is empty: a round then claims up to
        # lease_ahead items, so lease_ahead > 1 never becomes a round trip per item.
        if not self.book.buffer and self.rules.claim_ahead and self.sizer.ahead_helps():
            r = self.refills()
            if r is not None:
                r.schedule(self.pace)
        # Hear the rings before the wait at the end, not from its start: at the end of a drain
        # every worker waits at once, and each one's listener connecting and proving it hears
        # then (on Postgres a new server connection, a probe NOTIFY and its own commit) took the
        # machine's cores at the moment the last items' ends had to be heard. Not for a take
        # that never waits (a deadline: wq_sql.torch's timeout=0, see _wait).
        if deadline is None and self._deafen is None and self.sizer.dry_within(LISTEN_AHEAD):
            self._listen()

    def take_many(self, n: int, deadline: Optional[float], claim: Optional[int],
                  stop: Optional[Callable[[], bool]]) -> list[WorkItem]:
        """``WorkQueue.take_many``: hand out, refill, or wait, until items or an exception."""
        asked: Optional[float] = time.monotonic()
        while True:
            rings = self.rings  # before the round: a ring after it may mean something it missed
            with self.lock:
                self.check_usable()
                if asked is not None:
                    self.sizer.called(asked)
                    asked = None
                    self.in_use = 0  # a take: the last hand-out was read
                book = self.book
                if self.rules.auto_complete:
                    book.ack_out()
                while not book.buffer and self.filling:  # prefetch() is claiming: no 2nd claim
                    self.changed.wait()
                if not book.buffer:
                    self._fill(claim)
                if book.buffer:
                    got = book.hand_out(n)
                    self.in_use = len(got) - 1
                    self._handed(time.monotonic(), len(got), deadline)
                    return got
            self._wait(deadline, stop, rings)

    def _wait(self, deadline: Optional[float], stop: Optional[Callable[[], bool]], rings: int) -> None:
        """Nothing was claimable, but live workers hold items. Wait until this worker's own buffer
        holds an item (a refill thread may claim one at any moment, and notifies), something in
        this process may have made an item claimable (the epoch maker's rows, an item released or
        expired here: :meth:`wake`), the queue rang (``notify.py``: another process made such a
        change, or finished the queue; ``rings`` is the count seen before the round that found
        nothing), or a poll of the database says an item may be claimable or the queue is
        finished (then the take ends with :class:`QueueExhausted` from the poll). A ring is
        answered by a poll at once. Polls are read-only probes (cheap for the database even with
        a thousand waiting workers; no write lock on SQLite), with backoff up to ``poll_seconds``;
        the lock is not held during a poll, so other threads can complete items meanwhile. A
        poll that rode on this worker's heartbeat (:meth:`ride_beat`) counts as one: the next
        is an interval after it."""
        # A wait that raises QueueEmpty at its first look (``timeout=0``, a ``stop`` already
        # true) hears no ring: it subscribes to none. The bell costs a listener thread, and on
        # Postgres a connection of its own, which the pass end of a ``wq_sql.torch`` DataLoader
        # worker (``take_many(timeout=0)``) opened once per process.
        if not (_late(deadline, stop) and not self.epoch_due()):
            self._listen()
        since = time.monotonic()
        with self.lock:
            news = self.news
            beat = self.beat_peek
            self.waiting += 1
        try:
            self._poll_until(deadline, stop, rings, since, news, beat)
        finally:
            with self.lock:
                self.waiting -= 1

    def _poll_until(self, deadline: Optional[float], stop: Optional[Callable[[], bool]], rings: int,
                    since: float, news: int, beat: Optional[tuple[float, Peek]]) -> None:
        """:meth:`_wait`'s loop; ``beat`` is the heartbeat's poll already seen when it began."""
        pause = 0.02
        polls = 0
        db = self.db
        while True:
            # While the bell is live, polls are the safety net only: every poll_seconds. Without
            # it, poll about as often as this worker took items while it had work (never more
            # than every 20 ms): at the end of a drain, the others' last items take about that
            # long, and a 1 s backoff would add up to 1 s to the job. That pace holds for
            # IDLE_PACES of its intervals after this worker's last hand-out, then the polls back
            # off to poll_seconds: a worker that took a few items in a burst (items given back
            # or released, claimed in quick rounds) polled every 20 ms for as long as the others
            # held items.
            paced, last = self.pace.interval, self.pace.last
            cap = (self.rules.poll_seconds if notify.live(db.engine) or paced is None or last is None
                   or time.monotonic() - last > IDLE_PACES * paced else
                   min(self.rules.poll_seconds, max(pause, paced)))
            # Jittered while backing off (waiters started together drift apart), then every
            # ``cap``, spaced with the heartbeat's polls: at most one transaction per worker per
            # poll_seconds, its renewals included.
            now = time.monotonic()
            due = self.beat_due()
            next_poll = (now + pause * (0.5 + random.random()) if pause < cap else
                         now + cap if due is None else before_beat(now, due, cap))
            peek: Optional[Peek] = None
            with self.lock:
                while True:
                    if self.book.buffer or self.news != news or self.closed:
                        return  # take_many() hands out, claims again, or says it is closed
                    if self.rings != rings:
                        end = self.end_heard
                        if end is not None and end[0] > rings:  # rung after this take's round
                            peek = end[1]  # the ringer's read: no poll of this worker's own
                        rings = self.rings
                        break  # poll now
                    got = self.beat_peek
                    if got is not beat and got is not None and got[0] >= since:
                        beat, peek = got, got[1]  # a heartbeat read it after this take's round
                        break
                    now = time.monotonic()
                    late = _late(deadline, stop, now)
                    # An epoch that is due but not made yet (another worker's maker holds its
                    # lock) is not "others hold the rest": its rows come within a chunk's time.
                    if late and not self.epoch_due():
                        raise QueueEmpty(f"no item of queue {self.rules.name!r} is claimable now; "
                                         "other workers still hold the remaining ones")
                    if now >= next_poll:
                        break
                    until = next_poll if late or deadline is None else min(next_poll, deadline)
                    self.changed.wait(until - now)
            pause = min(pause * 2, cap)
            if peek is None:
                peek = self._look(poll=True)
            if peek.finished >= self.extent.total and peek.num_epochs == self.extent.num_epochs:
                # The end, as _fill() would find it, without its claim round and read: at the end
                # of a drain every waiting worker gets here at once.
                raise QueueExhausted(self.rules.name, peek.done, peek.failed, peek.quarantined)
            if (peek.pending or peek.expired or peek.finished >= self.extent.total
                    or peek.epochs_created != self.epochs.created):
                return
            polls += 1
            if polls >= ORPHAN_POLLS and self.epoch_due():
                return  # its maker may have died holding its lock: _fill() makes a chunk itself
            if peek.mine and polls >= ORPHAN_POLLS and self._adopt_orphans():
                return

    def _look(self, *, poll: bool = False) -> Peek:
        """One read of the queue's state (``HotPath.poll``): a waiting take's poll, or the read
        after a claim round that found nothing or acknowledgements that may have been the last."""
        worker_id = self.member.worker_id
        return self.hot.poll(worker_id) if poll else self.hot.read(worker_id)

    def ride_beat(self) -> Optional[Callable[[Peek], None]]:
        """For the heartbeat, before its renewal: while a take waits, the poll rides on the
        renewal (one statement, ``renew.Renewal``), and once it committed the waiting takes
        count it as their poll. A waiting worker's heartbeats then take no transaction of their
        own on top of its polls: one transaction per ``poll_seconds`` in all. Returns what
        takes the poll, or None: no take waits."""
        if not self.waiting or self.closed or os.getpid() != self.pid:
            return None
        at = time.monotonic()  # before the read: a wait that began after it does not use it

        def polled(peek: Peek) -> None:
            # Read by the waits without the lock's help: one reference, set at once. The
            # notify only hurries a wait that the poll's news may end; without it, the wait
            # takes this poll at its next check instead of polling. close() joins the heartbeat
            # while holding the lock, so never wait for it (a close at the end of a drain
            # would stall meanwhile).
            self.beat_peek = (at, peek)
            if not self.closed and self.lock.acquire(timeout=0.002):
                try:
                    self.changed.notify_all()
                finally:
                    self.lock.release()
        return polled

    def epoch_due(self) -> bool:
        """After a round that found nothing: the next epoch's rows are still to be made."""
        return self.epochs.created < self.extent.num_epochs

    def _listen(self) -> None:
        """Subscribe to this queue's rings (once per process; see :meth:`heard`)."""
        if self._deafen is None and not self.closed:
            self._deafen = notify.subscribe(self.db.engine, self.qid, weak_method(self.heard, None))

    def heard(self, news: str = "") -> None:
        """From the bell's thread: this queue rang. A waiting take polls at once, unless the
        ring said the queue is finished (``news`` from :meth:`ring_end`): then it ends without
        a poll. At the end of a drain every waiting worker used to poll at the same moment, on
        Postgres one round trip each while the others closed."""
        end = _end_news(news)
        if end is not None:
            self.end_heard = (self.rings + 1, end)  # before the count: a waiter reads both
        self.rings += 1  # only the bell's thread writes it
        # The lock is held briefly by a waiter between its checks, or for a claim round, whose
        # end notifies anyway (_claim): give up after a while rather than stall the bell.
        if self.lock.acquire(timeout=0.2):
            try:
                self.changed.notify_all()
            finally:
                self.lock.release()

    def ring(self) -> None:
        """After a transaction that made an item of this queue claimable: wake the takes that
        wait for it, in every process (``notify.py``)."""
        notify.ring(self.db.engine, self.qid)

    def ring_end(self, peek: Peek, notified: bool = False) -> None:
        """After a read that found the queue finished: wake the waiting takes with the news
        (the counts they would read), so that they end without a poll (:meth:`heard`).
        ``notified``: the read rang already (:meth:`_look_end`)."""
        news = f"{END} {peek.finished} {peek.failed} {peek.num_epochs} {peek.quarantined}"
        notify.ring(self.db.engine, self.qid, news, notified=notified)

    def _look_end(self, ring: bool) -> tuple[Peek, bool]:
        """The read after a claim round that found nothing, or after acknowledgements that may
        have been the queue's last: ``_look()``, and with ``ring`` on Postgres, if it finds the
        queue finished, the ring of the end in the same statement (``Poll.read_ringing``).
        Returns the read and whether it rang."""
        to = notify.notify_args(self.db.engine, self.qid) if ring else None
        if to is None:
            return self._look(), False
        e = self.extent
        total, num_epochs = e.total, e.num_epochs
        peek = self.hot.read_ringing(self.member.worker_id, total, num_epochs, *to)
        return peek, peek.finished >= total and peek.num_epochs == num_epochs

    def deafen(self) -> None:
        """Stop hearing this queue's rings (closed, or a forked child: not the parent's)."""
        deafen, self._deafen = self._deafen, None
        if deafen is not None and os.getpid() == self.pid:
            deafen()

    def _adopt_orphans(self) -> bool:
        """The guard for what the rest cannot prove: items the database says this worker holds
        but no part of this object knows (claimed into a buffer that no consumer looks at, or
        claimed by a commit whose reply an outage lost). With the lock held and no refill in
        flight the local book is complete, so such an item is put in the buffer for the waiting
        consumer, with a WARNING: it should never happen."""
        with self.lock:
            if self.filling or self.closed:
                return False
            held = self.db.tx(lambda c: statements.held_by(c, self.qid, self.member.worker_id), read=True)
            known = self.book.known()
            lost = [c for c in held if c.id not in known]
            if not lost:
                return False
            works = self.db.tx(lambda c: statements.works_by_idx(c, self.qid, [x.work_idx for x in lost]),
                               read=True)
            log.warning("queue %r: worker %r holds %d item(s) that it never handed out and no part of "
                        "it knew about; handing them out now: %s", self.rules.name, self.rules.worker,
                        len(lost), ", ".join(f"(epoch {c.epoch}, seq {c.seq})" for c in lost))
            self.book.add(lost, works)
            self.changed.notify_all()
            return True

    def send_acks(self) -> None:
        """Send the pending acknowledgements now, in a round that claims nothing (they otherwise
        ride on the next claim round, which with large rounds may be a while)."""
        with self.lock:
            while self.filling:  # a refill in flight carries acks of its own: let it land
                self.changed.wait()
            if self.closed or os.getpid() != self.pid or not self.book.acks:
                return
            acks = self.book.send_acks()
            try:
                self._claim(acks, 0)
            except BaseException:
                self.book.unsend(acks)
                raise
        self.after_acks()

    def give_back_idle(self, beat: float) -> int:
        """For the heartbeat: give back the buffered (claimed ahead, never handed out) items
        once this worker's consumer stopped taking: no hand-out for ``IDLE_PACES`` times its
        usual interval and at least two heartbeats (``beat`` seconds each). A worker that
        stays open but stopped iterating then never holds items that its peers wait for; the
        next take() claims again. Returns how many went back."""
        if not self.lock.acquire(timeout=0.05):
            return 0  # in use: not idle
        try:
            book, last = self.book, self.pace.last
            if (self.closed or self.filling or not book.buffer or last is None
                    or os.getpid() != self.pid):
                return 0
            idle = time.monotonic() - last
            if idle < max(2 * beat, IDLE_PACES * (self.pace.interval or 0.0)):
                return 0
            give = list(book.buffer)
            db = self.db
            back = db.tx(lambda c: statements.release(c, db.dialect, self.qid, self.member.worker_id,
                                               [i.key for i in give]))
            book.buffer.clear()
            log.info("queue %r: worker %r gave back %d item(s) claimed ahead that no take() asked "
                     "for in %.1f s", self.rules.name, self.rules.worker, len(back), idle)
        finally:
            self.lock.release()
        if back:
            self.ring()
        return len(back)

    def wake(self) -> None:
        """``WorkQueue.wake``: every waiting take looks again now."""
        with self.lock:
            self.news += 1
            self.changed.notify_all()

    def made_claimable(self) -> None:
        """Something in this process made items of this queue claimable (returned lost items,
        released or failed one for a retry): the waiting takes of this object and, through the
        bell, of every process look again now."""
        self.wake()
        self.ring()

    def epoch_rows(self) -> None:
        """The epoch maker committed a chunk of rows: takes of this object waiting for them
        claim now; other processes' hear one ring per quarter second of making at most (only
        the first chunk matters to a waiting take: after it, it claims)."""
        self.wake()
        now = time.monotonic()
        if now - self._rows_rang >= 0.25:
            self._rows_rang = now
            self.ring()

    def after_acks(self, always: bool = False) -> None:
        """After a transaction that acknowledged items outside a claim round: if this worker
        found nothing left to claim (or claimed the queue's last item in claim order), or
        ``always``, its acknowledgement may have finished the queue, which the takes waiting in
        other processes must hear (one read, only then)."""
        if not (self.drained or always):
            return
        peek, rang = self._look_end(True)
        if peek.finished >= self.extent.total:
            self.ring_end(peek, rang)

    def _claim(self, acks: list[WorkItem], limit: int) -> int:
        """One claim round (``claim.ClaimRound``) that also acknowledges ``acks``; the claimed
        items join the buffer. Returns how many."""
        keys = [(a.item_id, a.token) for a in acks]
        t = time.monotonic()
        if self._round_at:
            gap = t - self._round_at
            self._round_gap = gap if self._round_gap is None else 0.7 * self._round_gap + 0.3 * gap
        self._round_at = t
        carry = self.beat_carry(self._round_gap, self._held) if limit else None
        accepted, got = self.hot.round(self.member.worker_id, keys, limit, carry)
        if limit:
            self.drained = len(got) < limit
            revoked = self.hot.revoked
            if revoked is not None and revoked != self._revoked:
                seen, self._revoked = self._revoked, revoked
                if seen is not None:
                    self._drop_revoked()
        if got:
            now, per_epoch = time.monotonic(), self.extent.items_per_epoch
            # Positions in claim order (got is in hand-out order, (epoch, seq)): first and last.
            first, last = (got[0].epoch * per_epoch + got[0].seq, got[-1].epoch * per_epoch + got[-1].seq)
            if last == self.extent.total - 1:  # the last item in claim order: nothing after it
                self.drained = True
            self.sizer.claimed(now - t, now, first, last, len(got), self.extent.total)
        if len(accepted) < len(keys):  # rare: an outage may have lost a committed round's reply
            missing = [k for k in keys if k[0] not in accepted]
            accepted = accepted | self.db.tx(lambda c: statements.done_already(c, missing), read=True)
        with self.lock:  # one critical section: a waiting take() sees the buffer filled
            self.book.settle(acks, accepted, self.rules.name)
            self.book.add(got)
            self.changed.notify_all()
        self.epochs.after_claim(got)
        return len(got)

    def _fill(self, limit: Optional[int] = None) -> None:
        """One round trip, with the lock held: acknowledge finished items and claim up to
        ``limit`` (at most the round's size, ``lease_ahead``, the default) new ones. If none is
        claimable, try to make the next epoch, detect the end, or return expired items, in that
        order."""
        db, qid, rules = self.db, self.qid, self.rules
        size = self.sizer.size
        limit = size if limit is None else max(1, min(limit, size))
        created = self.epochs.created
        acks = self.book.send_acks()
        try:
            if self._claim(acks, limit):
                return
        except BaseException:
            self.book.unsend(acks)
            raise
        if self.epochs.created != created:  # the epoch maker committed rows the claim did not see
            return self._fill(limit)
        # Nothing pending. The next epoch may be missing (a crash between a claim and its
        # advance), the queue may be finished (checked before expiring leases: a finished queue
        # holds none, and the end of every worker's drain comes here), or leases may have expired.
        if self.epochs.make():
            return self._fill(limit)

        # One read-only statement (the waiting take's poll): the counters, the epochs, and
        # whether any lease ran out. Only then a write transaction returns expired items: at
        # the end of a drain every worker gets here once, and an expiry sweep that finds
        # nothing took SQLite's writers' queue as often.
        peek, rang = self._look_end(not self._rang_end)
        if peek.num_epochs != self.extent.num_epochs:  # another worker called extend_epochs()
            self.extent.num_epochs = peek.num_epochs
            self._rang_end = False
            return self._fill(limit)
        if peek.finished >= self.extent.total:
            if not self._rang_end:  # this worker's acknowledgements may have been the last ones
                self._rang_end = True
                self.ring_end(peek, rang)
            raise QueueExhausted(rules.name, peek.done, peek.failed, peek.quarantined)
        if peek.expired and db.may_expire and db.expire_tx(
                lambda c: statements.expire(c, db.dialect, qid, rules.max_attempts), default=0):
            self.ring()  # more came back than this round may claim
            return self._fill(limit)

    def _drop_revoked(self) -> None:
        """A quarantine took items back from their holders since the last round: drop from the
        buffer those this worker no longer holds (one read). Items already handed out stay with
        the consumer; their acknowledgement is rejected as for a take-over."""
        with self.lock:
            keys = [(i.item_id, i.token) for i in self.book.buffer]
        if not keys:
            return
        wid = self.member.worker_id
        held = self.db.tx(lambda c: quarantine.still_held(c, self.qid, wid, keys), read=True)
        with self.lock:
            dropped = self.book.drop_buffered({k for k in keys if k[0] not in held})
        if dropped:
            log.warning("%d buffered item(s) of queue %r were taken back (their work was quarantined) and "
                        "are not handed out: %s", len(dropped), self.rules.name,
                        ", ".join(f"(epoch {i.epoch}, seq {i.seq})" for i in dropped))

    def room(self) -> int:
        """Places a refill may claim into: the round's size less what is claimed and not reached
        by the consumer (the buffer, the rest of the hand-out in use: ``sizing.room``)."""
        return room(self.sizer.size, len(self.book.buffer), self.in_use)

    def refill_soon(self, min_claim: int) -> None:
        """``WorkQueue.refill_soon``. A kick that would find fewer than ``min_claim`` places free
        only wakes the refill thread to do nothing (most hand-outs of a pipeline: a DataLoader
        worker's pass had ~90 such wake-ups): the next hand-out kicks again. Read without the
        lock: a stale answer costs one wake-up too many, or waits for the next hand-out."""
        if not self.filling and self.room() < max(1, min_claim):
            return
        r = self.refills()
        if r is not None:
            r.kick(min_claim)

    def prefetch(self, min_claim: int = 1) -> int:
        """``WorkQueue.prefetch``: top the buffer up without holding the lock meanwhile."""
        with self.lock:
            self.check_usable()
            n = self.room()
            if self.filling or n < max(1, min_claim):
                return 0
            acks = self.book.send_acks()
            self.filling = True
        try:
            return self._claim(acks, n)
        except BaseException:
            with self.lock:
                self.book.unsend(acks)
            raise
        finally:
            with self.lock:
                self.filling = False
                self.changed.notify_all()

    def refills(self) -> Optional[Refiller]:
        """The refill thread, started if needed; None once closed or superseded."""
        r = self.refiller
        if r is None or not r.alive():
            with self.lock:
                if self.closed or self.superseded:
                    return None
                r = self.refiller
                if r is None or not r.alive():
                    r = self.refiller = Refiller(weak_method(self.prefetch, 0), self.rules.name)
        return r

    def stop_refills(self, join: bool = True) -> None:
        """``WorkQueue.stop_refills``: the refill thread stops; a refill in flight lands first.
        ``join=False``: the thread ends by itself a little later (:meth:`join_refills`); no
        refill starts after this returns."""
        r = self.refiller
        if r is not None and os.getpid() == self.pid:
            r.stop(join)
        with self.lock:
            while self.filling:
                self.changed.wait()

    def join_refills(self) -> None:
        """Wait for a refill thread told to stop. Without the lock: the thread may be about to
        take it, and find this object closed."""
        r = self.refiller
        if r is not None and os.getpid() == self.pid:
            r.join()

    def close(self) -> bool:
        """Stop handing out: False if already closed. Called with the lock held."""
        if self.closed:
            return False
        while self.filling:  # a prefetch() in flight adds its items to the buffer first
            self.changed.wait()
        self.closed = True
        self.changed.notify_all()  # takes waiting in other threads see it closed
        self.deafen()
        return True

    def _held(self) -> tuple[set[int], int]:
        """The tokens of the items held and how many are buffered (a carried renewal's)."""
        with self.lock:
            return self.book.tokens(), len(self.book.buffer)

    def holding(self, stop: threading.Event) -> Optional[tuple[set[int], int]]:
        """For the heartbeat: the tokens of the items held, and how many are buffered; None once
        closed (or in a forked child that has not re-registered yet)."""
        # close() joins the heartbeat while holding the lock: once it is stopping, stop waiting
        # for the lock, or close() stalls for the whole join timeout.
        while not self.lock.acquire(timeout=0.05):
            if stop.is_set():
                return None
        try:
            if self.closed or os.getpid() != self.pid:
                return None
            return self.book.tokens(), len(self.book.buffer)
        finally:
            self.lock.release()

    def lose_identity(self) -> None:
        self.superseded = True

    def after_fork(self, member: Member) -> None:
        """In a forked child, re-registered as ``member``: nothing of the parent's hand-outs."""
        self.pid = os.getpid()
        self.member = member
        self.filling = False
        self.in_use = 0
        self.refiller = None  # the parent's threads do not exist here
        self._deafen = None   # nor its bell (notify.py forgets it in the child)
        self.end_heard = None
        self.drained = False
        self.pace = Pace()
        self.sizer = Sizer(self.rules.lease_ahead)
        self._round_at, self._round_gap = 0.0, None
        self.book.clear()

    def fresh_locks(self) -> None:
        """In a forked child: locks another thread of the parent held at the fork would stay held
        forever here, where that thread does not exist."""
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)


END = "end"  # a ring's news: the queue is finished; then finished, failed, num_epochs, quarantined


def _end_news(news: str) -> Optional[Peek]:
    """What a ring that said the queue is finished read (:meth:`Dispenser.ring_end`), as the
    waiting take's poll would have: None for any other news (or none)."""
    parts = news.split()
    if len(parts) != 5 or parts[0] != END or not all(p.isdigit() for p in parts[1:]):
        return None
    finished, failed, num_epochs, quarantined = (int(p) for p in parts[1:])
    return Peek(pending=False, expired=False, finished=finished, epochs_created=num_epochs, mine=0,
                failed=failed, num_epochs=num_epochs, quarantined=quarantined)


def _late(deadline: Optional[float], stop: Optional[Callable[[], bool]], now: Optional[float] = None) -> bool:
    """A wait's deadline passed, or its ``stop()`` is true."""
    return ((deadline is not None and (time.monotonic() if now is None else now) >= deadline)
            or (stop is not None and stop()))
