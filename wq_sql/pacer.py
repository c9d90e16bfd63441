"""Pace: how often this worker takes items, and claiming the next one just in time.

``WorkQueue(..., claim_ahead=True)`` starts one thread per queue object that claims the next
item (:meth:`WorkQueue.prefetch`) shortly before the worker is expected to ask for it: at the
last hand-out plus the shortest of the worker's last few intervals between hand-outs, minus
about twice the claim's round trip. The shortest, not the average: with occasional stragglers
(a slow item, a GC pause) the average would make every normal item's claim late, and a claim
that comes early only holds one item a little longer. ``take()`` then finds the item in the
buffer instead of waiting for the database, and the item is claimed only a round trip or two
early, so a slow worker does not sit on work that a fast one could do (the reason not to claim
far ahead).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from wq_sql.queue import WorkQueue

log = logging.getLogger("wq_sql")
SMOOTHING = 0.2  # weight of the newest interval in the moving averages
RECENT = 8  # intervals whose shortest schedules the next claim


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


class JustInTime:
    """The thread that claims ahead for ``claim_ahead=True``; see the module docstring."""

    def __init__(self, queue: WorkQueue) -> None:
        self.round_trip = 0.005
        self._wake = threading.Condition()
        self._due: Optional[float] = None
        self._stopped = False
        self._thread = threading.Thread(target=_loop, args=(weakref.ref(queue), self), daemon=True,
                                        name=f"wq_sql-claim-ahead-{queue.name}")
        self._thread.start()

    def schedule(self, pace: Pace) -> None:
        """A hand-out happened: claim the next item when it is about to be wanted."""
        if pace.last is None:
            return
        fastest = pace.fastest
        ahead = 0.0 if fastest is None else max(0.0, fastest - 2 * self.round_trip)
        with self._wake:
            self._due = pace.last + ahead
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def _next(self) -> bool:
        """Wait until a claim is due; False once stopped."""
        with self._wake:
            while not self._stopped:
                now = time.monotonic()
                if self._due is not None and now >= self._due:
                    self._due = None
                    return True
                self._wake.wait(None if self._due is None else self._due - now)
            return False


def _loop(ref: weakref.ref[WorkQueue], jit: JustInTime) -> None:
    while jit._next():
        queue = ref()
        if queue is None:
            return
        t = time.monotonic()
        try:
            claimed = queue.prefetch()
        except Exception as e:  # closed, or the database is away: take() reports it to the caller
            log.debug("claim ahead of queue %r failed: %s", queue.name, type(e).__name__)
            claimed = 0
        if claimed:
            jit.round_trip = (1 - SMOOTHING) * jit.round_trip + SMOOTHING * (time.monotonic() - t)
        del queue
