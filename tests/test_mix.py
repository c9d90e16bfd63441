"""Weighted sources and mid-run mix changes, on every backend, with real worker processes.

What an epoch means with weights (``wq_sql.mixing``): as many items as the sources hold, each
source's share rounded by largest remainder, its items drawn from its stream (each item once
before any repeats), interleaved evenly. A change of the weights redraws the rows no worker has
claimed yet, so each worker follows from its next claim round; it is recorded in ``wq_mixes``.
Shares are read from the audit (``wq_audit.source``) and from what the workers received.
"""

from __future__ import annotations

import collections
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from mix_worker import SCRIPT, SIZES, WEIGHTS, source_of, sources
from procwatch import child_env
from worker_proc import query as rows

import wq_sql
from wq_sql import InvalidInput, QueueConfigMismatch, QueueNotFound, WorkQueue
from wq_sql.cli import main as cli

SHARES = {"web": 0.6, "code": 0.3, "math": 0.1}


def start(url: str, name: str, worker: str, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SCRIPT), "--url", url, "--name", name, "--worker", worker,
                             "--log", str(log), *extra], env=child_env(), stderr=subprocess.PIPE)


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, p.stderr.read().decode()[-3000:] if p.stderr else p.returncode


def received(log: Path) -> list[tuple[int, str]]:
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        t, w = line.split(" ", 1)
        out.append((int(t), w))
    return out


def in_order(url: str, name: str) -> list[str]:
    """The sources of every delivered row in hand-out order (epoch, seq)."""
    sql = "SELECT source FROM wq_audit WHERE queue = :q AND claimed_at IS NOT NULL ORDER BY epoch, seq"
    return [r.source for r in rows(url, sql, q=name)]


def windows(seq: list[str], size: int) -> list[dict[str, float]]:
    out = []
    for k in range(0, len(seq) - size + 1, size):
        c = collections.Counter(seq[k:k + size])
        out.append({s: c[s] / size for s in SHARES})
    return out


# ---------------------------------------------------------------- what an epoch is


def test_an_epoch_draws_each_source_at_its_share_and_every_item_before_any_repeats(db_url: str) -> None:
    """web (50 items) at 0.6 of 100 draws repeats 10 of its items; math (20) at 0.1 is
    subsampled, 10 per epoch, its next epoch continuing with the other 10; no item of a source
    comes again before all of that source's items came."""
    works = sources({"web": 50, "code": 30, "math": 20})
    with WorkQueue(works, weights=SHARES, num_epochs=4, seed=3, url=db_url, name="e", lease_ahead=8) as q:
        got = list(q)
    assert len(got) == 400
    for e in range(4):
        c = collections.Counter(source_of(w) for w in got[e * 100:(e + 1) * 100])
        assert c == {"web": 60, "code": 30, "math": 10}, (e, c)
    for src, n in (("web", 50), ("code", 30), ("math", 20)):
        stream = [w for w in got if source_of(w) == src]
        for k in range(0, len(stream) - n + 1, n):
            assert len(set(stream[k:k + n])) == n, (src, k)  # each cycle: every item once
    # Deterministic from the seed: a second queue with the same seed hands out the same order.
    with WorkQueue(works, weights=SHARES, num_epochs=4, seed=3, url=db_url, name="e2", lease_ahead=8) as q:
        assert list(q) == got
    audit = rows(db_url, "SELECT source, count(*) AS n FROM wq_audit WHERE queue = 'e' GROUP BY source "
                         "ORDER BY source")
    assert [tuple(r) for r in audit] == [("code", 120), ("math", 40), ("web", 240)]
    hist = rows(db_url, "SELECT source, count(*) FROM wq_history WHERE queue = 'e' AND kind = 'done' "
                        "GROUP BY source ORDER BY source")
    assert [tuple(r) for r in hist] == [("code", 120), ("math", 40), ("web", 240)]


def test_unweighted_queues_have_no_source(db_url: str) -> None:
    with WorkQueue(["a", "b", "c"], url=db_url, name="plain", seed=1) as q:
        assert sorted(q) == ["a", "b", "c"]
    assert rows(db_url, "SELECT DISTINCT source FROM wq_audit WHERE queue = 'plain'") == [(None,)]
    with pytest.raises(QueueNotFound, match="no weighted sources"):
        wq_sql.set_mix("plain", {"a": 1}, url=db_url)


def test_shares_over_10000_deliveries_by_8_worker_processes(db_url: str, tmp_path: Path) -> None:
    """0.6 / 0.3 / 0.1 over 10,000 deliveries by 8 processes: each source within 2 points of
    its weight overall, and within 1 point in every window of 200 deliveries of the hand-out
    order; every row delivered once, and what the workers received is what the audit says."""
    logs = [tmp_path / f"w{i}.log" for i in range(8)]
    go = tmp_path / "go"
    procs = [start(db_url, "mix8", f"w{i}", logs[i], "--go", str(go)) for i in range(8)]
    time.sleep(0.5)
    go.touch()
    finish(procs)
    got = [w for log in logs for _, w in received(log)]
    assert len(got) == sum(SIZES.values()) == 10_000
    assert collections.Counter(got) == collections.Counter(
        r.work for r in rows(db_url, "SELECT work FROM wq_audit WHERE queue = 'mix8' AND state = 'done'"))
    total = collections.Counter(source_of(w) for w in got)
    for s, w in SHARES.items():
        assert abs(total[s] / len(got) - w) <= 0.02, (s, total)
    order = in_order(db_url, "mix8")
    assert len(order) == 10_000
    for k, win in enumerate(windows(order, 200)[1:], start=1):
        for s, w in SHARES.items():
            assert abs(win[s] - w) <= 0.01, (k, win)
    assert max(len(received(log)) for log in logs) > 0  # every worker took part (or most did)
    assert sum(1 for log in logs if received(log)) >= 6


# ---------------------------------------------------------------- a change while it runs


def test_a_mix_change_reaches_every_worker_within_a_round_and_survives_a_restart(db_url: str, tmp_path: Path
                                                                                 ) -> None:
    """Four slow workers (lease_ahead 8); the mix changes to web=0 while they run: once the
    change committed, each worker receives at most what it had claimed ahead of web (the
    bound: 8, plus the item in hand), then none; code and math share the rest half and half. Then every worker
    is SIGKILLed and restarted with the original weights in its code: the stored mix stays in
    force (no web item beyond the killed workers' claimed ones)."""
    name = "steer"
    logs = [tmp_path / f"w{i}.log" for i in range(4)]
    args = ("--lease-ahead", "8", "--step", "0.004", "--epochs", "2")
    procs = [start(db_url, name, f"w{i}", logs[i], *args) for i in range(4)]
    deadline = time.monotonic() + 120
    while sum(len(received(log)) for log in logs) < 1500:
        assert time.monotonic() < deadline, "workers too slow to start"
        assert all(p.poll() is None for p in procs), [p.stderr.read().decode()[-2000:]
                                                      for p in procs if p.stderr]
        time.sleep(0.05)
    out = wq_sql.set_mix(name, {"web": 0, "code": 1, "math": 1}, url=db_url, by="test")
    changed_at = time.monotonic_ns()  # committed: what a worker claims from now on is redrawn
    assert out.redrawn > 0 and out.epoch == 0
    assert out.weights == {"web": 0.0, "code": 0.5, "math": 0.5}
    time.sleep(1.5)  # every worker makes several rounds under the new mix
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)
    for log in logs:
        after = [w for t, w in received(log) if t > changed_at]
        web = [w for w in after if source_of(w) == "web"]
        assert len(after) > 20, log  # the worker kept going
        assert len(web) <= 9, (log, len(web))
        assert all(source_of(w) != "web" for w in after[9:]), (log, [k for k, w in enumerate(after)
                                                                     if source_of(w) == "web"])
    killed_at = time.monotonic_ns()
    # Restart with the weights of the code (0.6 / 0.3 / 0.1): the mix in force stays.
    procs = [start(db_url, name, f"w{i}", logs[i], "--epochs", "2") for i in range(4)]
    finish(procs)
    later = [w for log in logs for t, w in received(log) if t > killed_at]
    assert later
    web_later = sum(1 for w in later if source_of(w) == "web")
    assert web_later <= 4 * 9, web_later  # only the killed workers' claimed-ahead items
    c = collections.Counter(source_of(w) for w in later)
    assert abs(c["code"] - c["math"]) <= 0.02 * len(later) + 40, c
    # The change is on record, with who and where it took effect.
    mixes = rows(db_url, "SELECT m.by, m.weights, m.epoch, m.seq, m.redrawn FROM wq_mixes m "
                         "JOIN wq_queues q ON q.id = m.queue_id WHERE q.name = :q ORDER BY m.id", q=name)
    assert len(mixes) == 2
    assert json.loads(mixes[0].weights) == WEIGHTS
    assert mixes[1].by == "test" and json.loads(mixes[1].weights) == {"web": 0.0, "code": 0.5, "math": 0.5}
    assert mixes[1].redrawn == out.redrawn
    # Nothing lost, nothing twice: each row of both epochs is done once.
    states = rows(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state", q=name)
    assert dict((r[0], r[1]) for r in states) == {"done": 20_000}
    # Epoch 1 was drawn again at the new mix: no web row in it.
    web1 = rows(db_url, "SELECT seq, state, attempts, claimed_at FROM wq_audit WHERE queue = :q "
                        "AND epoch = 1 AND source = 'web' ORDER BY seq", q=name)
    assert web1 == [], (len(web1), web1[:5], rows(db_url, "SELECT * FROM wq_mixes"))


def test_a_change_below_rows_it_keeps_never_gives_one_stream_position_twice(db_url: str) -> None:
    """A never-claimed row below claimed ones (what a claim in flight leaves) is redrawn with
    the tail: its source's stream restarts at that row's position and must skip the positions
    the claimed rows above it hold, also when the change leaves that source out (weight 0) and a
    later one brings it back. No two rows of a source ever hold the same position, and the skip
    list is gone once the stream passed it."""
    works = sources({"web": 7, "code": 5, "math": 3})
    with WorkQueue(works, weights=SHARES, num_epochs=4, seed=2, url=db_url, name="h", lease_ahead=1,
                   claim_ahead=False) as q:  # no refill thread to claim the hole first
        got = [q.take() for _ in range(8)]
        # A fresh hole at seq 1 (claimed rows above it): as if a claim had skipped it.
        engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        with engine.begin() as c:
            qid = c.execute(sa.text("SELECT id FROM wq_queues WHERE name = 'h'")).scalar_one()
            c.execute(sa.text("UPDATE wq_items SET state = 'pending', claimed_at = NULL, worker_id = NULL, "
                              "token = NULL, lease_until = NULL "
                              "WHERE queue_id = :q AND epoch = 0 AND seq = 1"), {"q": qid})
        engine.dispose()
        hole = source_of(got[1])
        assert sum(source_of(w) == hole for w in got[2:]) >= 1  # positions held above the hole's
        out = wq_sql.set_mix("h", {s: (0.0 if s == hole else 1.0) for s in SHARES}, url=db_url)
        assert out.epoch == 0 and out.seq == 1
        skips = ("SELECT s.name, s.skip FROM wq_sources s JOIN wq_queues q ON q.id = s.queue_id "
                 "WHERE q.name = 'h' AND s.skip IS NOT NULL")
        assert [r.name for r in rows(db_url, skips)] == [hole]
        rest = [q.take() for _ in range(10)]
        wq_sql.set_mix("h", SHARES, url=db_url)
        rest += list(q)
    assert len(rest) == 15 * 4 - 8 + 1  # every row not taken before, the hole among them
    dup = rows(db_url, "SELECT i.source, i.draw, count(*) FROM wq_items i JOIN wq_queues q ON q.id = "
                       "i.queue_id WHERE q.name = 'h' GROUP BY i.source, i.draw HAVING count(*) > 1")
    assert dup == []
    assert rows(db_url, skips) == []


def test_mix_cli_shows_the_weights_changes_and_shares(db_url: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    works = sources({"web": 40, "code": 40, "math": 20})
    with WorkQueue(works, weights=SHARES, seed=5, url=db_url, name="c", lease_ahead=4) as q:
        for _ in range(20):
            q.take()
        assert cli(["mix", "c", "--url", db_url, "--set", "web=0.2,code=0.2,math=0.6"]) == 0
        assert "80 undelivered items redrawn from epoch 0 seq 20" in capsys.readouterr().out
        rest = list(q)
    c = collections.Counter(source_of(w) for w in rest[4:])  # the 4 claimed ahead: old mix
    assert c == {"web": 15, "code": 15, "math": 46} or abs(c["math"] - 0.6 * sum(c.values())) <= 2, c
    assert cli(["mix", "c", "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  math +0\.6000 +\(20 items\)$", out, re.M), out
    assert "from epoch 0 seq 20, 80 redrawn" in out
    assert "    0  math" in out


def test_create_with_sources_from_the_cli(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for d, n in (("web", 6), ("code", 2)):
        (tmp_path / d).mkdir()
        for i in range(n):
            (tmp_path / d / f"{i}.txt").touch()
    args = ["create", "pre", "--url", db_url, "--source", "web=web/*.txt", "--source", "code=code/*.txt",
            "--weights", "web=0.75,code=0.25", "--seed", "1"]
    assert cli(args) == 0
    assert cli(["status", "pre", "--url", db_url]) == 0
    out = capsys.readouterr().out
    assert "weighted sources (wq-sql mix to see or change them): web=0.75, code=0.25" in out
    with WorkQueue({"web": [f"web/{i}.txt" for i in range(6)], "code": ["code/0.txt", "code/1.txt"]},
                   url=db_url, name="pre") as q:
        got = list(q)
    assert collections.Counter(w.split("/")[0] for w in got) == {"web": 6, "code": 2}
    assert cli(["create", "x", "--url", db_url, "--source", "web"]) == 1
    assert "NAME=WORK" in capsys.readouterr().err
    assert cli(["create", "x", "--url", db_url, "--works", "a", "--weights", "a=1"]) == 1
    assert "--weights needs named sources" in capsys.readouterr().err
    assert cli(["create", "x", "--url", db_url, "--source", "web=nothing*"]) == 1
    assert "--source web='nothing*' matches no file" in capsys.readouterr().err
    assert [q["name"] for q in wq_sql.list_queues(db_url)] == ["pre"]


# ---------------------------------------------------------------- bad input changes nothing


@pytest.mark.parametrize("weights, message", [
    ("web=0.5,code", "NAME=WEIGHT pairs"),
    ("web=0.5,code=x,math=1", "not a number"),
    ("web=-1,code=1,math=1", "finite number >= 0"),
    ("web=0,code=0,math=0", "all zero"),
    ("web=1,code=1,math=1,art=1", "'art', which the queue does not have"),
    ("web=1,code=1", "no weight to 'math'"),
    ("web=1,web=2,code=1,math=1", "twice"),
    ("web=nan,code=1,math=1", "finite number"),
])
def test_bad_weights_are_refused_and_change_nothing(db_url: str, weights: str, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    works = sources({"web": 5, "code": 5, "math": 5})
    with WorkQueue(works, weights=SHARES, url=db_url, name="b", seed=1) as q:
        q.take()
        audit = "SELECT item_id, epoch, seq, work, state, source FROM wq_audit ORDER BY item_id"
        before = rows(db_url, audit)
        mixes = rows(db_url, "SELECT * FROM wq_mixes")
        srcs = rows(db_url, "SELECT * FROM wq_sources")
        assert cli(["mix", "b", "--url", db_url, "--set", weights]) == 1
        assert message in capsys.readouterr().err
        assert rows(db_url, audit) == before
        assert rows(db_url, "SELECT * FROM wq_mixes") == mixes
        assert rows(db_url, "SELECT * FROM wq_sources") == srcs


def test_bad_sources_are_refused(db_url: str) -> None:
    with pytest.raises(InvalidInput, match="needs named sources"):
        WorkQueue(["a"], weights={"a": 1}, url=db_url, name="x")
    with pytest.raises(InvalidInput, match="source 'web'"):
        WorkQueue({"web": [], "code": ["c"]}, url=db_url, name="x")
    with pytest.raises(InvalidInput, match="source name"):
        WorkQueue({"we b": ["a"]}, url=db_url, name="x")
    with pytest.raises(InvalidInput, match="no weight to 'code'"):
        WorkQueue({"web": ["a"], "code": ["c"]}, weights={"web": 1}, url=db_url, name="x")
    assert wq_sql.list_queues(db_url) == []
    # Joining a weighted queue with a list (or other sources) says what differs.
    with WorkQueue({"web": ["a"], "code": ["c"]}, url=db_url, name="j", seed=1):
        with pytest.raises(QueueConfigMismatch, match="has named sources"):
            WorkQueue(["a", "c"], url=db_url, name="j", worker="other")
        with pytest.raises(QueueConfigMismatch, match="sources differ"):
            WorkQueue({"web": ["a"], "art": ["c"]}, url=db_url, name="j", worker="other")


# ---------------------------------------------------------------- the shims


@pytest.mark.parametrize("shim", ["tf", "torch"])
def test_shims_take_weighted_sources(db_url: str, tmp_path: Path, shim: str) -> None:
    """``wq_sql.tf.WorkQueue`` and ``wq_sql.torch.QueueDataset`` take the same dict and
    ``weights=``: two processes each, shares within 2 points, every row delivered once."""
    logs = [tmp_path / f"{shim}{i}.log" for i in range(2)]
    procs = [start(db_url, "shim", f"{shim}{i}", logs[i], "--shim", shim) for i in range(2)]
    finish(procs, timeout=600)
    got = [w for log in logs for _, w in received(log)]
    assert len(got) == 10_000 and len(set(got)) == 10_000 - 1000  # web: 1,000 repeats of 5,000
    c = collections.Counter(source_of(w) for w in got)
    for s, w in SHARES.items():
        assert abs(c[s] / len(got) - w) <= 0.02, c
    order = in_order(db_url, "shim")
    for win in windows(order, 200)[1:]:
        for s, w in SHARES.items():
            assert abs(win[s] - w) <= 0.01, win
