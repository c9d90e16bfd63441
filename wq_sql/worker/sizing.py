"""How many items a worker claims ahead: one rule, for the core and both shims.

``L`` is the ``lease_ahead`` in force: the user's number, or the :class:`Sizer`'s automatic size.
A consumer either takes one item at a time (``WorkQueue.take``) or takes *hand-outs* of several
that it then reads one by one (``take_many``: the TensorFlow pipeline, a PyTorch loader).

1. **The bound.** Everything this worker holds claimed that its consumer has not reached yet
   stays within ``L``: the buffer (claimed, not handed out) plus the hand-out in use, less its
   first item, which the consumer reaches as it is handed out (:func:`room`). An item counts as
   reached once the consumer took it (``take``), or once it took the next hand-out (the items of
   the one before are all read). TensorFlow's own one-element read-ahead comes on top.
2. **Hand-outs** are of :func:`hand_out_size` items: half a round, so that while the consumer
   reads one the refill claims the next, at most :data:`HAND_OUT_MAX` (what a crash may deliver
   again and what a checkpoint assumes read ahead stay small).
3. **With an empty buffer** a take claims in its own thread at most :func:`first_claim` items
   when a refill thread will claim the rest (the consumer starts after a short round trip), or
   a whole round ``L`` when there is none (a loader on SQLite, where a round is this process's
   own CPU work: another thread would only split it in two).
4. **A refill** (the background thread, kicked after each hand-out) claims the room the bound
   leaves, once at least one hand-out's worth is free, so one round trip claims about a
   hand-out.
"""

from __future__ import annotations

from typing import Optional

SMOOTHING = 0.2  # weight of the newest interval in the moving averages
AHEAD_SECONDS = 0.1  # automatic lease_ahead: the consumer's time the items of one round cover
AUTO_MAX = 512  # automatic lease_ahead: at most this many items per round
TAIL = 16  # automatic lease_ahead: a round covers at most 1/TAIL of the time until the queue is dry
ALONE = 0.95  # a worker claiming this share of all claims has no peer to leave items to
HAND_OUT_MAX = 64  # items per hand-out at most (rule 2)
FIRST_CLAIM = 32  # items a take claims itself at most when a refill thread claims the rest (rule 3)


def hand_out_size(lease_ahead: int) -> int:
    """Items per hand-out (rule 2): half of ``lease_ahead``, rounded up, at most ``HAND_OUT_MAX``."""
    return min(HAND_OUT_MAX, max(1, (lease_ahead + 1) // 2))


def first_claim(hand_out: int) -> int:
    """What a take with an empty buffer claims itself when a refill thread claims the rest
    (rule 3): one hand-out, at most ``FIRST_CLAIM``."""
    return max(1, min(hand_out, FIRST_CLAIM))


def room(lease_ahead: int, buffered: int, in_use: int) -> int:
    """Places a refill may claim into (rule 1): ``lease_ahead`` less the buffered items and the
    ``in_use`` items of the hand-out being read that the consumer has not reached."""
    return max(0, lease_ahead - buffered - in_use)


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
    dozens of one-item rounds."""

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


