"""Quarantine, on every backend: a work held back from every worker of a running queue.

What it promises (docs/decisions/0009-quarantine-as-a-state.md): once ``quarantine`` commits,
no claim, requeue, reset, checkpoint restore or later epoch delivers the work's items until it
is taken out; an item of it in flight is taken back (a worker's buffered copies are dropped at
its next claim round; the ack of one already handed out is refused); the counters count its
items as finished, so the queue ends; ``unquarantine`` gives them back, each delivered once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from worker_proc import Proc
from worker_proc import query as rows

import wq_sql
from wq_sql import InvalidInput, QueueExhausted, WorkQueue
from wq_sql.cli import main as cli
from wq_sql.monitor.metrics import QueueCollector

WORKS = [f"w{i:02d}" for i in range(20)]
HELD = {f"w0{i}" for i in range(5)}  # what "w0[0-4]" names


def states(url: str, name: str) -> dict[str, int]:
    return {r[0]: int(r[1]) for r in rows(
        url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state", q=name)}


def drain(url: str, name: str, worker: str, n: int = 0, **kw: Any) -> list[str]:
    """Take up to ``n`` items (0: until the queue is exhausted) as ``worker``; returns the works."""
    got: list[str] = []
    with WorkQueue.attach(name, url=url, worker=worker, **kw) as q:
        try:
            while not n or len(got) < n:
                got.append(q.take().work)
        except QueueExhausted:
            pass
    return got


def test_a_quarantined_work_stays_out_through_requeues_resets_restores_and_new_epochs(db_url: str) -> None:
    """Ten cycles of what makes rows claimable again, with five works in quarantine: none of
    their items is ever delivered, the audit stays exactly-once, and the queue ends."""
    name = "q"
    with WorkQueue(WORKS, num_epochs=3, shuffle=False, name=name, url=db_url, worker="a", max_attempts=1,
                   claim_ahead=False,  # nothing claimed behind the test's back: w02 alone is in flight
                   lease_ahead=1) as q:
        first = [q.take().work for _ in range(3)]  # w00, w01 done, w02 in hand
        out = wq_sql.quarantine(name, work="w0[0-4]", reason="corrupt records", url=db_url, by="test")
        assert (out.works, out.already) == (5, 0)
        # Epoch 0's w02 (in hand), w03, w04, and the five of each later epoch made so far.
        made = rows(db_url, "SELECT epochs_created FROM wq_queues WHERE name = :q", q=name)[0][0]
        assert out.items == 3 + 5 * (made - 1) == states(db_url, name)["quarantined"]
        assert out.in_flight == 1
        assert first == ["w00", "w01", "w02"]
        with pytest.raises(wq_sql.LeaseLost):
            q.complete(q.recent("w02") or pytest.fail("w02 not in hand"))
    delivered: list[str] = []
    for cycle in range(10):
        delivered += drain(db_url, name, f"c{cycle}", n=7)
        kind = cycle % 5
        if kind == 0:
            assert cli(["requeue", name, "--done", "--url", db_url]) == 0
        elif kind == 1:
            with WorkQueue.attach(name, url=db_url, worker=f"f{cycle}") as f:
                f.fail(f.take(), "a bad record")  # max_attempts 1: failed for good
            assert cli(["requeue", name, "--failed", "--url", db_url]) == 0
        elif kind == 2:
            wq_sql.reset_queue(name, url=db_url)
        elif kind == 3:
            with WorkQueue.attach(name, url=db_url, worker=f"r{cycle}", auto_complete=False) as r:
                taken = [r.take() for _ in range(4)]
                r.cover(taken, step=10)
                # The model restored from a checkpoint of step 5: what step 10 covered comes back,
                # the quarantined works' items to quarantine, not to the queue.
                assert r.reopen_after(5) == 4
        else:
            wq_sql.extend_queue(name, 3 + cycle // 5 + 1, url=db_url)
        assert not HELD & set(delivered), (cycle, sorted(HELD & set(delivered)))
    delivered += drain(db_url, name, "last")
    assert not HELD & set(delivered)
    with pytest.raises(QueueExhausted) as ended:
        WorkQueue.attach(name, url=db_url, worker="late").take()
    assert ended.value.quarantined > 0 and "quarantine" in str(ended.value)
    assert cli(["audit", name, "--url", db_url]) == 0
    # Every held row of every epoch is quarantined; every other row is done.
    n_epochs = rows(db_url, "SELECT num_epochs FROM wq_queues WHERE name = :q", q=name)[0][0]
    held_rows = [r for r in rows(db_url, "SELECT work, state FROM wq_audit WHERE queue = :q", q=name)
                 if r[0] in HELD]
    assert {s for _, s in held_rows} <= {"quarantined", "done"}
    assert states(db_url, name).get("quarantined") == sum(1 for _, s in held_rows if s == "quarantined")
    assert sum(states(db_url, name).values()) == len(WORKS) * n_epochs

    # Taken out: each of its rows is delivered once, then the queue ends again.
    w03 = sum(1 for w, s in held_rows if w == "w03" and s == "quarantined")
    assert w03 >= n_epochs - 1  # epoch 0's was done before the quarantine, if at all
    assert wq_sql.unquarantine(name, work="w03", url=db_url) == (1, w03)
    back = w03
    again = drain(db_url, name, "after")
    assert again == ["w03"] * back
    assert cli(["audit", name, "--url", db_url]) == 0


def test_worker_processes_drop_a_quarantined_work_within_one_claim_round(db_url: str, tmp_path: Path) -> None:
    """Four worker processes (lease_ahead 8) drain 2,000 works; a quarantine of 100 of them
    commits while they run. After it, each worker receives at most what it had claimed ahead
    plus the item in hand (9); the others are never delivered, every other item is done once,
    and every worker ends with the queue."""
    name = "live"
    n = 2000
    held = {f"w{i:05d}" for i in range(1000, 1100)}
    procs = [Proc(db_url, name, f"p{i}", tmp_path / f"p{i}.log", n, lease_ahead=8, item_ms=2, shuffle=1)
             for i in range(4)]
    try:
        for p in procs:
            p.expect("STARTED")
        deadline = time.monotonic() + 120
        while sum(len(p.log.read_text().splitlines()) for p in procs if p.log.exists()) < 300:
            assert time.monotonic() < deadline, "workers too slow"
            time.sleep(0.02)
        out = wq_sql.quarantine(name, where="work >= 'w01000' AND work < 'w01100'", reason="bad shard",
                                url=db_url)
        before = {p.worker: sum(1 for line in p.log.read_text().splitlines() if line.split()[2] in held)
                  for p in procs}
        assert out.works == 100
        for p in procs:
            p.expect("EXHAUSTED", timeout=300)
            assert p.finish(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    got = {p.worker: [line.split()[2] for line in p.log.read_text().splitlines()] for p in procs}
    for w, works in got.items():
        late = sum(1 for x in works if x in held) - before[w]
        assert late <= 9, (w, late)
    st = states(db_url, name)
    assert set(st) <= {"done", "quarantined"} and st["done"] + st["quarantined"] == n
    assert st["quarantined"] == out.items
    done = [r[0] for r in rows(db_url, "SELECT work FROM wq_audit WHERE queue = :q AND state = 'done'",
                               q=name)]
    assert len(done) == len(set(done))
    assert set(done) | {r[0] for r in rows(db_url, "SELECT work FROM wq_audit WHERE queue = :q AND "
                                                   "state = 'quarantined'", q=name)} == \
        {f"w{i:05d}" for i in range(n)}
    assert cli(["audit", name, "--url", db_url]) == 0


def test_the_cli_lists_refuses_bad_input_and_changes_nothing(db_url: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with WorkQueue(WORKS, shuffle=False, name="c", url=db_url, worker="a") as q:
        q.take()
    before = rows(db_url, "SELECT id, state, attempts FROM wq_items ORDER BY id")
    for args, needle in [
        (["--work", "zz*", "--reason", "x"], "no work of queue 'c' matches 'zz*'"),
        (["--where", "work = 'w01'; DROP TABLE wq_items", "--reason", "x"], "is not a plain one"),
        (["--where", "nosuch = 1", "--reason", "x"], "nosuch"),
        (["--work", "w01"], "--reason"),
        (["--work", "w01", "--reason", "  "], "reason"),
    ]:
        assert cli(["quarantine", "c", "--url", db_url, *args]) == 1, args
        assert needle in capsys.readouterr().err, args
    assert cli(["unquarantine", "c", "--url", db_url, "--all"]) == 1
    assert "nothing changed" in capsys.readouterr().err
    assert rows(db_url, "SELECT id, state, attempts FROM wq_items ORDER BY id") == before
    assert rows(db_url, "SELECT count(*) FROM wq_quarantine")[0][0] == 0

    assert cli(["quarantine", "c", "--url", db_url, "--where", "work IN ('w05', 'w06') OR seq = 7",
                "--reason", "CRC errors"]) == 0
    assert "3 work(s) put in quarantine; 3 item(s) held back" in capsys.readouterr().out
    assert cli(["quarantine", "c", "--url", db_url]) == 0
    listing = capsys.readouterr().out
    assert "3 work(s) in quarantine" in listing and "CRC errors" in listing and "w07" in listing
    assert cli(["status", "c", "--url", db_url]) == 0
    assert "QUARANTINED" in capsys.readouterr().out
    with pytest.raises(InvalidInput, match="either by work= .* or by where="):
        wq_sql.quarantine("c", work="w01", where="seq = 1", reason="x", url=db_url)
    assert cli(["unquarantine", "c", "--url", db_url, "--work", "w0[5-6]"]) == 0
    assert "2 work(s) out of quarantine; 2 item(s) pending again" in capsys.readouterr().out
    assert [h.work for h in wq_sql.quarantined("c", url=db_url)] == ["w07"]
    # The metrics count it apart: a series of its own, the pending ones without it.
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        items = {s.labels["state"]: s.value for m in QueueCollector(engine, queues=["c"]).collect()
                 if m.name == "wq_sql_items" for s in m.samples if s.labels["epoch"] == "0"}
    finally:
        engine.dispose()
    assert items == {"pending": 18, "claimed": 0, "done": 1, "failed": 0, "quarantined": 1}


def test_a_trainer_quarantines_the_item_in_its_hands(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """``wq.quarantine(item, reason)`` instead of completing it: its work is never handed out
    again, to this worker or another, in this epoch or the next; nothing is logged as a lost
    lease; the queue ends with it counted."""
    with WorkQueue(WORKS, num_epochs=2, shuffle=False, name="t", url=db_url, worker="a") as q:
        bad = q.take()
        assert bad.work == "w00"
        with pytest.raises(InvalidInput, match="needs a reason"):
            q.quarantine(bad, "  ")
        assert q.quarantine(bad, "UnicodeDecodeError at byte 4242") >= 1
        with caplog.at_level("WARNING", logger="wq_sql"):
            rest = [q.take().work for _ in range(len(WORKS) - 1)]
        assert "w00" not in rest and not [r for r in caplog.records if "lease" in r.getMessage().lower()]
    other = drain(db_url, "t", "b")
    assert "w00" not in other and len(rest) + len(other) == 2 * len(WORKS) - 2
    [(work, reason, by)] = [(h.work, h.reason, h.by) for h in wq_sql.quarantined("t", url=db_url)]
    assert (work, reason, by) == ("w00", "UnicodeDecodeError at byte 4242", "worker a")
    assert states(db_url, "t") == {"done": 38, "quarantined": 2}
    assert cli(["audit", "t", "--url", db_url]) == 0
