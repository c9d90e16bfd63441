"""``claim_ahead=True``: the next item is claimed in the background just before this worker's
pace says it will be wanted, so ``take()`` finds it buffered; and idle polling follows the pace."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import ROOT

from wq_sql import QueueExhausted, WorkQueue
from wq_sql.store.engine import resolve_url
from wq_sql.store.hot.claim import ClaimRound


def states(url: str) -> collections.Counter[str]:
    engine = sa.create_engine(resolve_url(url))
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT state, attempts FROM wq_items")).all()
    engine.dispose()
    return collections.Counter(f"{s}/{a}" for s, a in rows)


def record_rounds(wq: WorkQueue, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """(time, thread name) of every claim round run from now on (``ClaimRound.run``: on SQLite
    it runs on a connection kept out of the pool, so the pool's checkouts do not show it)."""
    rounds: list[tuple[float, str]] = []
    real = ClaimRound.run

    def run(self: ClaimRound, *args: Any, **kwargs: Any) -> Any:
        rounds.append((time.monotonic(), threading.current_thread().name))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ClaimRound, "run", run)
    return rounds


def test_take_finds_the_next_item_claimed_just_in_time(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wq = WorkQueue([f"w{i}" for i in range(12)], shuffle=False, url=db_url, claim_ahead=True,
                   heartbeat_seconds=5)
    rounds = record_rounds(wq, monkeypatch)
    in_take = []
    for _ in range(10):
        t = time.monotonic()
        wq.take()
        in_take.append([r for r in rounds if r[0] >= t and r[1] == threading.current_thread().name])
        time.sleep(0.1)  # the "step"
    # After the pace is known (two hand-outs), take() runs no claim round: the item was claimed
    # in the background during the step.
    assert in_take[0], "the first take() claims itself"
    assert in_take[3:] == [[]] * 7, in_take
    assert sum(1 for r in rounds if r[1].startswith("wq_sql-refill")) >= 7
    # At most one item claimed ahead: claimed = the one in hand + the one just claimed.
    assert states(db_url)["claimed/0"] <= 2
    wq.close()
    assert states(db_url) == {"done/0": 10, "pending/0": 2}  # close() gave the buffered one back


def test_without_claim_ahead_take_claims_itself(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wq = WorkQueue([f"w{i}" for i in range(6)], url=db_url, heartbeat_seconds=5, claim_ahead=False,
                   lease_ahead=1)
    rounds = record_rounds(wq, monkeypatch)
    for k in range(5):
        wq.take()
        assert len(rounds) == k + 1  # one round per take() at lease-ahead 1 ...
        time.sleep(0.05)
        assert len(rounds) == k + 1  # ... and nothing is claimed behind the worker's back
    wq.close()


WORKER = """
import sys, time
from wq_sql import WorkQueue
url, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
with WorkQueue([f"item-{i}" for i in range(120)], num_epochs=2, seed=1, url=url, worker=name,
               claim_ahead=True) as wq, open(out, "w") as f:
    for item in wq:
        time.sleep(0.01 if name != "slow" else 0.04)
        f.write(f"{item.epoch} {item}\\n")
"""


def test_several_processes_claiming_ahead_take_every_item_once(db_url: str, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    outs = {n: tmp_path / f"{n}.txt" for n in ("a", "b", "slow")}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, db_url, n, str(o)], env=env, text=True,
                              stderr=subprocess.PIPE) for n, o in outs.items()]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    lines = collections.Counter(line for o in outs.values() for line in o.read_text().splitlines())
    assert lines == collections.Counter(f"{e} item-{i}" for e in range(2) for i in range(120))
    counts = {n: len(o.read_text().splitlines()) for n, o in outs.items()}
    assert counts["slow"] < min(counts["a"], counts["b"]), counts
    assert states(db_url) == {"done/0": 240}


def test_claim_ahead_with_lease_ahead_claims_a_batch_when_the_buffer_runs_out(
        db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``lease_ahead=4`` the background claim runs once the buffer is empty and claims four
    items: about one round per four items, never a round per item."""
    wq = WorkQueue([f"w{i}" for i in range(24)], shuffle=False, url=db_url, claim_ahead=True,
                   lease_ahead=4, heartbeat_seconds=5)
    rounds = record_rounds(wq, monkeypatch)
    for _ in range(20):
        wq.take()
        time.sleep(0.05)
    refills = [r for r in rounds if r[1].startswith("wq_sql-refill")]
    assert 3 <= len(refills) <= 7, rounds  # 20 items / 4 per round, give or take the first ones
    assert states(db_url)["claimed/0"] <= 5  # the item in hand and at most one batch ahead
    wq.close()


def test_an_idle_worker_polls_at_its_own_pace(db_url: str) -> None:
    """A worker that waits for another's last item notices the end about as fast as it used to
    take items, not after a poll_seconds backoff."""
    a = WorkQueue([f"w{i}" for i in range(6)], url=db_url, worker="a", poll_seconds=20,
                  claim_ahead=False, lease_ahead=1)
    b = WorkQueue.attach(url=db_url, worker="b")
    for _ in range(5):
        a.take()
        time.sleep(0.02)
    last = b.take()
    ended = []

    def wait_for_end() -> None:
        try:
            a.take()
        except QueueExhausted:
            ended.append(time.monotonic())

    t = threading.Thread(target=wait_for_end)
    t.start()
    time.sleep(3.0)  # a backoff towards 20 s would now sleep about 2.5 s between polls
    b.complete(last)
    done_at = time.monotonic()
    t.join(timeout=30)
    assert ended, "a never saw the end"
    assert ended[0] - done_at < 1.0, "the idle poll backed off towards poll_seconds=20"
    a.close()
    b.close()


def test_items_claimed_ahead_go_back_once_the_worker_stops_taking(db_url: str) -> None:
    """A worker that stays open but stops iterating does not sit on what it claimed ahead: its
    heartbeat gives the buffered items back after two beats without a take()."""
    a = WorkQueue([f"w{i}" for i in range(6)], shuffle=False, url=db_url, worker="a", heartbeat_seconds=0.5)
    b = WorkQueue.attach(url=db_url, worker="b", claim_ahead=False)
    for _ in range(5):
        a.take()
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while a.buffered == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.buffered == 1, "claim-ahead did not claim the last item"
    t = time.monotonic()
    assert str(b.take(timeout=20)) == "w5"  # a never takes it: its heartbeat gave it back
    assert time.monotonic() - t >= 0.9  # not before two beats without a take()
    assert a.buffered == 0
    b.close()
    with pytest.raises(QueueExhausted):
        a.take()
    a.close()
    engine = sa.create_engine(resolve_url(db_url))
    with engine.connect() as c:
        kinds = c.execute(sa.text("SELECT kind FROM wq_history WHERE seq = 5 ORDER BY event_id"))
        kinds = kinds.scalars().all()
    engine.dispose()
    assert kinds == ["claim", "release", "claim", "done"], kinds


def test_a_kick_with_too_few_places_free_wakes_no_refill_thread(db_url: str) -> None:
    name = "kick"
    with WorkQueue([f"w{i}" for i in range(20)], url=db_url, name=name, lease_ahead=4,
                   claim_ahead=False) as wq:
        wq.take()  # one round of 4: 3 buffered, 1 handed out
        assert wq.buffered == 3
        wq.refill_soon(2)  # one place free: nothing to claim, no thread woken (or started)
        assert not [t for t in threading.enumerate() if t.name == f"wq_sql-refill-{name}"]
        wq.take()
        wq.take()  # 1 buffered: three places free
        wq.refill_soon(2)
        deadline = time.monotonic() + 30
        while wq.buffered < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert wq.buffered == 4
