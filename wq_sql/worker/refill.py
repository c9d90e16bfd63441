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

How many items a round claims, and how many may be claimed ahead at all, is the rule of
:mod:`wq_sql.worker.sizing`.
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
from wq_sql.worker.sizing import SMOOTHING

log = logging.getLogger("wq_sql")
RECENT = 8  # intervals whose shortest schedules the next claim
IDLE_CHECK = 1.0  # seconds: an idle refill thread looks this often whether its owner is gone
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
