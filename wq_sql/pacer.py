"""Refilling a queue object's buffer in the background: one thread, two triggers.

``WorkQueue.prefetch`` tops the buffer up in one round trip without holding the queue's lock.
The :class:`Refiller` thread calls it when either trigger fires:

- a due time (``claim_ahead=True``): the next item is claimed shortly before the worker is
  expected to ask for it: at the last hand-out plus the shortest of the worker's last few
  intervals between hand-outs (:class:`Pace`), minus about twice the claim's round trip. The
  shortest, not the average: with occasional stragglers (a slow item, a GC pause) the average
  would make every normal item's claim late, and a claim that comes early only holds one item
  a little longer. The item is claimed only a round trip or two early, so a slow worker does
  not sit on work that a fast one could do (the reason not to claim far ahead).
- a kick (``WorkQueue.refill_soon``, the TensorFlow pipeline after each hand-out): refill now,
  again and again while a round claims something, once at least ``min_claim`` places are free.

How many items a round claims (``lease_ahead``) is the :class:`Sizer`'s: a number given by the
user, or by default sized from the consumer's own time per item, so that the items claimed
ahead hold about ``AHEAD_SECONDS`` of its work (a few 20 ms training steps; hundreds of files
read in a fraction of a millisecond: one round trip, and one Python call of the TF pipeline,
per hundreds of items), and less as the queue nears its end while other workers share it
(the time left until nothing is claimable, from the positions of successive claims), so that
at the end no worker sits on items that idle peers could take.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Callable, Optional

from wq_sql.errors import WorkerConflict, WqSqlError

log = logging.getLogger("wq_sql")
SMOOTHING = 0.2  # weight of the newest interval in the moving averages
RECENT = 8  # intervals whose shortest schedules the next claim
IDLE_CHECK = 1.0  # seconds: an idle refill thread looks this often whether its owner is gone
AHEAD_SECONDS = 0.1  # automatic lease_ahead: the consumer's time the items of one round cover
AUTO_MAX = 512  # automatic lease_ahead: at most this many items per round
TAIL = 16  # automatic lease_ahead: a round covers at most 1/TAIL of the time until the queue is dry
ALONE = 0.95  # a worker claiming this share of all claims has no peer to leave items to


class Pace:
    """The intervals between this worker's hand-outs (seconds): their moving average
    (``interval``) and the shortest of the last few (``fastest``)."""

    def __init__(self) -> None:
        self.last: Optional[float] = None
        self.interval: Optional[float] = None
        self._recent: deque[float] = deque(maxlen=RECENT)

    @property
    def fastest(self) -> Optional[float]:
        return min(self._recent) if self._recent else None

    def handed_out(self, now: float) -> None:
        if self.last is not None:
            d = now - self.last
            self.interval = d if self.interval is None else (1 - SMOOTHING) * self.interval + SMOOTHING * d
            self._recent.append(d)
        self.last = now


def _smooth(average: Optional[float], sample: float) -> float:
    """The moving average after ``sample`` (the sample itself when there is none yet)."""
    return sample if average is None else (1 - SMOOTHING) * average + SMOOTHING * sample


class Sizer:
    """How many items a claim round claims: ``fixed`` (the user's ``lease_ahead``), or, when it
    is None, a size that follows the consumer. The consumer's time per item is the time between
    a hand-out's return and the next call, over the items handed out (its own work: the time it
    waits inside ``take()`` for a round trip does not count), smoothed. The size is what covers
    ``AHEAD_SECONDS`` of that time, and at least what keeps up with the claim round trip (two
    round trips' worth), from 1 to ``AUTO_MAX``; it at most doubles per hand-out, so a burst
    of fast pulls at the start (a pipeline filling its buffers) does not claim hundreds of
    slow items, and shrinks at once when items get slower.

    Near the end: claims go out in (epoch, seq) order, so between two of this worker's rounds
    the position of the claims tells how fast all workers together claim, and what share of it
    is this worker's. Unless this worker is alone (its share >= ``ALONE``), a round covers at
    most ``1 / TAIL`` of the time until every item is claimed (items left / pool rate), down to
    one item at the end: the dynamic-sharding rule (guided self-scheduling) that keeps a fast
    worker from holding what idle peers could take, with no count of the workers needed.

    But never below ``TAIL`` round trips of the consumer's time (the floor ``F``; or the size
    far from the end, if that is less). A round of
    ``F`` seconds of work leaves idle peers at most ``F`` at the end, while each round trip the
    tail rule adds costs about one; and shrinking rounds by ``1 / TAIL`` of the time left takes
    about ``TAIL * ln(T / F)`` rounds to go from ``T`` seconds left down to ``F``: the sum
    ``F + TAIL * round_trip * ln(T / F)`` is least at ``F = TAIL * round_trip``. Items far
    longer than a round trip (training steps) still end in rounds of one item; items shorter
    than one (files read in a millisecond against a round trip of one) no longer end a pass in
    dozens of one-item rounds (bench/torch_phases.py: ~100 rounds per DataLoader worker and
    1,000-item pass before)."""

    def __init__(self, fixed: Optional[int]) -> None:
        self.fixed = fixed
        self.size = fixed or 1
        self.per_item: Optional[float] = None  # seconds of the consumer's own time per item
        self.round_trip: Optional[float] = None  # seconds per claim round, smoothed
        self.pool_rate: Optional[float] = None  # items claimed per second by all workers
        self.share: Optional[float] = None  # this worker's share of the claims, smoothed
        self.left = 0  # items after this worker's last claim, in claim order
        self._returned: Optional[float] = None
        self._handed = 0
        self._last: Optional[tuple[float, int, int]] = None  # (time, first position, items) of the last round

    def called(self, now: float) -> None:
        """A hand-out was asked for at ``now``: what the consumer spent on the last one."""
        if self._returned is None or not self._handed:
            return
        self.per_item = _smooth(self.per_item, (now - self._returned) / self._handed)
        self._returned = None
        self._resize()

    def handed_out(self, now: float, n: int) -> None:
        """``n`` items were handed out, returning to the consumer at ``now``."""
        self._returned, self._handed = now, n

    def claimed(self, seconds: float, now: float, first: int, last: int, n: int, total: int) -> None:
        """A claim round took ``seconds`` and claimed ``n`` items, at positions ``first`` to
        ``last`` in claim order (``epoch * items_per_epoch + seq``) of ``total``."""
        self.round_trip = _smooth(self.round_trip, seconds)
        if not n or self.fixed is not None:
            return
        self.left = max(0, total - 1 - last)
        prev, self._last = self._last, (now, first, n)
        if prev is None or first <= prev[1] or now <= prev[0]:
            return  # the first round, or items that came back (released, expired): no rate
        rate, share = (first - prev[1]) / (now - prev[0]), min(1.0, prev[2] / (first - prev[1]))
        self.pool_rate = _smooth(self.pool_rate, rate)
        self.share = _smooth(self.share, share)

    def dry_within(self, seconds: float) -> bool:
        """Whether, at the rate all workers claim, every item will be claimed within ``seconds``
        and this worker has peers (its share of the claims below ``ALONE``): a wait for their
        last items is near. False while the rate is not known (a fixed ``lease_ahead``)."""
        rate, share = self.pool_rate, self.share
        return rate is not None and share is not None and share < ALONE and self.left < seconds * rate

    def ahead_helps(self) -> bool:
        """Whether claiming the next round in the background can save the consumer a wait: the
        consumer spends at least a round trip on a round's items. Otherwise (a consumer that
        does next to nothing per item) it would wait for the background round anyway, plus a
        hand-off between threads, so ``take()`` had better claim itself."""
        per, rt = self.per_item, self.round_trip
        return per is None or rt is None or per * self.size >= rt

    def _resize(self) -> None:
        if self.fixed is not None:
            return
        per = self.per_item
        if per is None:
            return
        trip = self.round_trip or 0.0
        cover = max(AHEAD_SECONDS, 2 * trip)
        if self.pool_rate and self.share is not None and self.share < ALONE:
            # Guided self-scheduling, down to TAIL round trips of the consumer's time: below
            # that the end costs more in rounds than it gains in balance (see the docstring).
            cover = min(cover, max(self.left / self.pool_rate / TAIL, TAIL * trip))
        want = AUTO_MAX if per <= cover / AUTO_MAX else max(1, int(cover / per + 1e-6))
        self.size = min(want, 2 * self.size, AUTO_MAX)


class Refiller:
    """The refill thread of one queue object (see the module docstring). ``refill(min_claim)``
    claims into the buffer and returns how many it claimed. The thread holds this object
    weakly, so an owner that is collected ends it."""

    def __init__(self, refill: Callable[[int], int], label: str) -> None:
        self.round_trip = 0.005
        self._refill = refill
        self._label = label
        self._wake = threading.Condition()
        self._due: Optional[float] = None
        self._kicked = 0  # min_claim of a pending kick, 0: none
        self._stopped = False
        self._pid = os.getpid()
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(self), self._wake),
                                        name=f"wq_sql-refill-{label}", daemon=True)
        self._thread.start()

    def schedule(self, pace: Pace) -> None:
        """A hand-out happened: claim the next item when it is about to be wanted. Nothing
        before the pace is known (two hand-outs): a worker that took one item holds one."""
        fastest = pace.fastest
        if pace.last is None or fastest is None:
            return
        ahead = max(0.0, fastest - 2 * self.round_trip)
        with self._wake:
            self._due = pace.last + ahead
            self._wake.notify()

    def kick(self, min_claim: int) -> None:
        """Refill now, while rounds claim, once ``min_claim`` places are free."""
        with self._wake:
            self._kicked = max(1, min_claim)
            self._wake.notify()

    def stop(self, join: bool = True) -> None:
        """End the thread (a refill in flight finishes first); ``join=False``: do not wait for
        it here (:meth:`join` later)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if join:
            self.join()

    def join(self) -> None:
        if self._pid == os.getpid() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._pid == os.getpid() and self._thread.is_alive() and not self._stopped

    def _next(self) -> Optional[tuple[int, bool]]:
        """Wait for a trigger: (min_claim, whether to repeat while rounds claim), or None when
        stopped. Returns None also after ``IDLE_CHECK`` with nothing to do, so that the loop
        can look whether the owner still exists."""
        with self._wake:
            deadline = time.monotonic() + IDLE_CHECK
            while not self._stopped:
                now = time.monotonic()
                if self._kicked:
                    n, self._kicked = self._kicked, 0
                    return n, True
                if self._due is not None and now >= self._due:
                    self._due = None
                    return 1, False
                if now >= deadline and self._due is None:
                    return 0, False
                self._wake.wait((self._due if self._due is not None else deadline) - now)
            return None

    def _run(self, min_claim: int, repeat: bool) -> bool:
        """One trigger's refills; False once this thread should end."""
        t = time.monotonic()
        try:
            claimed = self._refill(min_claim)
            if not repeat:
                if claimed:
                    self.round_trip = (1 - SMOOTHING) * self.round_trip + SMOOTHING * (time.monotonic() - t)
                return True
            while claimed and not self._stopped:
                claimed = self._refill(min_claim)
        except WorkerConflict:
            return False  # superseded: take() says so to the caller
        except WqSqlError as e:
            if type(e) is WqSqlError:  # closed
                return False
            log.debug("refill of queue %r failed, take() will retry: %s", self._label, e)
        except Exception as e:  # a database error: the caller's own take() retries and reports it
            log.debug("refill of queue %r failed, take() will retry: %s", self._label, type(e).__name__)
        return True


def _loop(ref: weakref.ref[Refiller], wake: threading.Condition) -> None:
    while True:
        r = ref()
        if r is None:
            return
        trigger = r._next()
        if trigger is None:
            return
        if trigger[0] and not r._run(*trigger):
            with wake:
                r._stopped = True
            return
        del r
