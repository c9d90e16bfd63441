"""The automatic hand-out size (``lease_ahead=None``, :class:`wq_sql.pacer.Sizer`): rounds cover
about ``AHEAD_SECONDS`` of the consumer's own time, one item for slow steps, hundreds for fast
reads; a given ``lease_ahead`` stays as given."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from wq_sql import WorkQueue
from wq_sql.store.hot.claim import ClaimRound
from wq_sql.worker.sizing import AHEAD_SECONDS, AUTO_MAX, TAIL, Sizer


def feed(s: Sizer, per_item: float, rounds: int, t: float = 0.0, n: int = 1) -> float:
    """``rounds`` hand-outs of ``n`` items, each used for ``per_item`` seconds by the consumer."""
    for _ in range(rounds):
        s.called(t)
        s.handed_out(t, n)
        t += per_item * n
    s.called(t)
    return t


def test_slow_steps_claim_few_items() -> None:
    s = Sizer(None)
    feed(s, 0.020, 50)  # 20 ms training steps
    assert s.size == int(AHEAD_SECONDS / 0.020)
    feed(s, 0.5, 10)  # longer steps than AHEAD_SECONDS: one item per round
    assert s.size == 1


def test_fast_reads_grow_to_what_covers_the_ahead_time_doubling_at_most() -> None:
    s = Sizer(None)
    sizes = []
    t = 0.0
    for _ in range(12):
        t = feed(s, 40e-6, 1, t, n=s.size)
        sizes.append(s.size)
    assert sizes[:5] == [2, 4, 8, 16, 32]  # at most doubling per hand-out
    assert sizes[-1] == min(AUTO_MAX, int(AHEAD_SECONDS / 40e-6))
    feed(s, 1e-7, 20, t, n=s.size)
    assert s.size == AUTO_MAX


def test_the_size_shrinks_at_once_when_items_get_slower() -> None:
    s = Sizer(None)
    t = feed(s, 40e-6, 40)
    assert s.size == AUTO_MAX
    feed(s, 0.040, 12, t)  # the smoothed time per item converges to 40 ms
    assert s.size == int(AHEAD_SECONDS / 0.040)


def test_a_slow_round_trip_claims_enough_to_keep_up() -> None:
    s = Sizer(None)
    for _ in range(30):
        s.claimed(0.300, 0.0, 0, 0, 0, 10**6)  # 300 ms per claim round (a far database)
    feed(s, 0.010, 30)
    assert 59 <= s.size <= 60  # two round trips' worth (0.6 s / 10 ms), more than AHEAD_SECONDS
    assert Sizer(7).size == 7
    fixed = Sizer(7)
    feed(fixed, 40e-6, 30)
    assert fixed.size == 7


def claims(s: Sizer, rounds: int, peers: int, per_item: float, total: int, t: float = 0.0,
           pos: int = 0, trip: float = 0.0001) -> tuple[float, int]:
    """``rounds`` claim rounds of this worker, each of ``s.size`` items used in ``per_item`` s
    each, while ``peers`` other workers as fast as this one claim one item per ``per_item``;
    a claim round takes ``trip`` seconds."""
    for _ in range(rounds):
        n = min(s.size, total - pos)
        if n <= 0:
            break
        s.claimed(trip, t, pos, pos + n - 1, n, total)
        for _ in range(n):
            s.called(t)
            s.handed_out(t, 1)
            t += per_item
        pos += n + peers * n  # the peers claimed as many meanwhile
    s.called(t)
    return t, pos


def test_near_the_end_rounds_shrink_to_one_item_when_peers_share_the_queue() -> None:
    s = Sizer(None)
    t, pos = claims(s, 10, 7, 0.002, 100_000)  # 8 workers, 2 ms items, far from the end
    assert s.size == int(AHEAD_SECONDS / 0.002)
    assert 0.1 < s.share < 0.2
    seen = []
    while pos < 100_000:
        t, pos = claims(s, 1, 7, 0.002, 100_000, t, pos)
        seen.append((100_000 - pos, s.size))
    # a round covers at most 1/TAIL of the time left: one item once the pool needs < TAIL items' time
    assert all(size <= max(1, left / 8 / TAIL * 1.5) for left, size in seen[-20:]), seen[-20:]
    assert seen[-1][1] == 1


def test_the_end_is_known_to_be_near_only_with_peers_and_a_known_rate() -> None:
    # 8 workers, 20 ms items, 1,600 items (bench/long_tail.py): the pool claims 400 items/s, so
    # the queue runs dry within a second once fewer than 400 items are left after this
    # worker's claims (Dispenser.take_many subscribes to the bell then).
    s = Sizer(None)
    assert not s.dry_within(1.0)  # no rate yet
    t, pos = claims(s, 5, 7, 0.020, 1_600)
    assert not s.dry_within(1.0) and s.dry_within(10.0), (pos, s.left, s.pool_rate)
    while s.left >= 0.9 * 400:
        t, pos = claims(s, 1, 7, 0.020, 1_600, t, pos)
    assert s.dry_within(1.0)
    alone = Sizer(None)
    claims(alone, 50, 0, 0.020, 1_600)
    assert not alone.dry_within(1e9)  # no peer to wait for
    fixed = Sizer(8)
    claims(fixed, 50, 7, 0.020, 1_600)
    assert not fixed.dry_within(1e9)  # a given lease_ahead measures no rate


def drain(s: Sizer, peers: int, per_item: float, total: int, trip: float) -> list[tuple[int, int]]:
    """(items left, size) after each of this worker's rounds until the queue is claimed."""
    t, pos, seen = 0.0, 0, []
    while pos < total:
        t, pos = claims(s, 1, peers, per_item, total, t, pos, trip)
        seen.append((total - pos, s.size))
    return seen


def test_the_end_keeps_rounds_of_tail_round_trips_when_items_are_shorter_than_a_round_trip() -> None:
    # A DataLoader worker and its peer reading files in 0.2 ms each, a round trip of 1 ms: the
    # rounds stop shrinking at TAIL round trips' worth (16 ms: 80 items), not one item each.
    seen = drain(Sizer(None), 1, 0.0002, 20_000, 0.001)
    floor = int(TAIL * 0.001 / 0.0002)
    assert min(size for _, size in seen[10:]) == floor, seen
    bare = Sizer(None)
    bare_seen = drain(bare, 1, 0.0002, 20_000, 0.0)  # no round trip: no floor, one item at the end
    assert bare_seen[-1][1] == 1
    assert len(seen) < len(bare_seen) / 2, (len(seen), len(bare_seen))


def test_items_longer_than_the_floor_still_end_in_rounds_of_one_item() -> None:
    # 8 workers, 20 ms training steps, a slow round trip of 1 ms: the floor (16 ms) is under
    # one item, so the long tail's end is as before.
    seen = drain(Sizer(None), 7, 0.020, 4_000, 0.001)
    assert max(size for _, size in seen) == int(AHEAD_SECONDS / 0.020)
    assert seen[-1][1] == 1


def test_a_worker_alone_keeps_its_size_to_the_end() -> None:
    s = Sizer(None)
    t, pos = claims(s, 10_000, 0, 40e-6, 20_000)
    assert pos >= 20_000 - s.size  # drained by rounds of the full size
    assert s.size == AUTO_MAX


def count_rounds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The thread of every claim round from now on (on SQLite a round runs on a connection kept
    out of the pool: the pool's checkouts do not count it)."""
    rounds: list[str] = []
    real = ClaimRound.run

    def run(self: ClaimRound, *args: Any, **kwargs: Any) -> Any:
        rounds.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ClaimRound, "run", run)
    return rounds


def test_a_fast_consumer_takes_many_items_per_round(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with WorkQueue([f"w{i}" for i in range(3000)], url=db_url, claim_ahead=False) as wq:
        assert wq.lease_ahead == 1
        rounds = count_rounds(monkeypatch)
        for _ in range(3000):
            wq.take()
        assert wq.lease_ahead > 8
        assert len(rounds) < 3000 / 8, len(rounds)


def test_a_slow_consumer_keeps_one_item_per_round(db_url: str) -> None:
    with WorkQueue([f"w{i}" for i in range(6)], url=db_url) as wq:
        for _ in range(6):
            wq.take()
            time.sleep(0.12)  # a step longer than AHEAD_SECONDS
            assert wq.lease_ahead == 1


def test_claiming_ahead_only_where_it_can_save_a_wait() -> None:
    fixed = Sizer(32)
    assert fixed.ahead_helps()  # nothing measured yet
    fixed.claimed(0.001, 0.0, 0, 31, 32, 10**6)  # a round trip of 1 ms
    feed(fixed, 5e-6, 20, n=32)  # 32 items used in 0.16 ms: the consumer would wait anyway
    assert not fixed.ahead_helps()
    feed(fixed, 0.001, 20, n=32)  # 32 ms of work per round: a background round hides the trip
    assert fixed.ahead_helps()
