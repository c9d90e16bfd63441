"""Acceptance: the operator's day, with the real ``python -m wq_sql`` command and real worker
processes, on both backends: create a queue, drain it, ``status``, ``audit`` (and its
exactly-once check failing on an injected duplicate completion), ``requeue`` after a SIGKILLed
worker and after failures, and the ``report`` timeline checked for content."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli import ok, table, wq
from worker_proc import Proc, make_works, query, query_commit

SVG = "{http://www.w3.org/2000/svg}"


def svg_of(html_file: Path) -> ET.Element:
    """The inline SVG of a report page, parsed (the page must carry it whole, no external file)."""
    text = html_file.read_text(encoding="utf-8")
    assert "<script" not in text and "src=" not in text and "href=" not in text
    start, end = text.index("<svg"), text.index("</svg>") + len("</svg>")
    return ET.fromstring(text[start:end])


def readme_sql() -> list[str]:
    """Each statement of the ``sql`` blocks of the README and of the audit guide (the SQL for
    auditors)."""
    import re

    from test_cli import ROOT

    text = "".join((ROOT / page).read_text(encoding="utf-8") for page in ("docs/guide/audit.md", "README.md"))
    out = []
    for block in re.findall(r"```sql\n(.*?)```", text, re.S):
        body = "\n".join(ln for ln in block.splitlines() if not ln.lstrip().startswith("--"))
        out += [st.strip() for st in body.split(";") if st.strip()]
    return out


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.cleanup()


def start(procs: list[Proc], url: str, worker: str, tmp_path: Path, n_works: int, **opts: Any) -> Proc:
    p = Proc(url, "train", worker, tmp_path / f"{worker}.log", n_works, **opts)
    procs.append(p)
    return p


def exhausted(p: Proc) -> tuple[int, int]:
    _, done, failed = p.expect("EXHAUSTED", timeout=60).split()
    assert p.finish() == 0, p.stderr()
    return int(done), int(failed)


def test_sigkilled_worker_requeue_drain_audit(db_url: str, tmp_path: Path, procs: list[Proc]) -> None:
    n, epochs = 12, 2
    listing = tmp_path / "works.txt"
    listing.write_text("".join(w + "\n" for w in make_works(n)))
    out = ok(wq("create", "train", "--works-from", str(listing), "--epochs", str(epochs), "--seed", "7",
                "--url", db_url, cwd=tmp_path))
    assert "created queue 'train'" in out
    assert f"{n} items per epoch, {epochs} epoch(s), shuffled with seed 7" in out

    # The workers join the queue the command created (same works, epochs, shuffle and seed).
    opts = {"num_epochs": epochs, "shuffle": 1, "seed": 7, "lease": 60}
    alice = start(procs, db_url, "alice", tmp_path, n, hold=2, **opts)
    _, e, s, work = alice.expect("HOLDING").split()
    alice.kill()  # SIGKILL: its second item stays claimed, with a 60 s lease

    # Its lease has 60 s to run, but the operator knows alice is gone.
    out = ok(wq("requeue", "train", "--worker", "alice", "--url", db_url, cwd=tmp_path))
    assert "requeued 1 item(s)" in out and "held by worker 'alice'" in out

    # Claimable at once: the new workers finish long before alice's 60 s lease would expire.
    bob = start(procs, db_url, "bob", tmp_path, n, **opts)
    carol = start(procs, db_url, "carol", tmp_path, n, **opts)
    assert exhausted(bob) == (n * epochs, 0) and exhausted(carol) == (n * epochs, 0)
    holders = [r.worker for r in query(
        db_url, "SELECT kind, worker FROM wq_history WHERE queue = 'train' AND epoch = :e AND seq = :s "
                "ORDER BY event_id", e=int(e), s=int(s))]
    assert holders[:2] == ["alice", "alice"] and holders[-1] in ("bob", "carol")

    out = ok(wq("status", "train", "--url", db_url, cwd=tmp_path))
    assert table(out, "EPOCH")["total"] == ["0", "0", str(n * epochs), "0"]
    assert f"finished: {n * epochs} of {n * epochs}" in out

    a = json.loads(ok(wq("audit", "train", "--format", "json", "--url", db_url, cwd=tmp_path)))
    assert a["exactly_once"] == {"ok": True, "violations": [], "counter_mismatches": [],
                                 "unchecked_epochs": []}
    assert sum(c["done"] for c in a["consumed"]) == n * epochs
    assert "alice" in {c["worker"] for c in a["consumed"]} <= {"alice", "bob", "carol"}
    assert [(r["epoch"], r["seq"], r["work"]) for r in a["redeliveries"]] == [(int(e), int(s), work)]
    kinds = [(ev["kind"], ev["worker"]) for ev in a["redeliveries"][0]["events"]]
    assert kinds[:2] == [("claim", "alice"), ("requeue", "alice")] and kinds[2][0] == "claim"
    assert a["redeliveries"][0]["holders"][0] == "alice" and a["failed"] == []

    # The SQL for auditors (audit guide, README) runs as printed and agrees with the command.
    sql = readme_sql()
    assert len(sql) >= 3
    per_worker = query(db_url, sql[0].replace("'work_queue'", "'train'"))
    assert sum(r[2] for r in per_worker) == n * epochs
    assert query(db_url, sql[1].replace("'work_queue'", "'train'")) == []  # exactly once
    for extra in sql[2:]:
        query(db_url, extra.replace("'work_queue'", "'train'"))

    # The timeline: a lane per worker, a bar per delivery, a mark per re-delivery.
    out = ok(wq("report", "train", "--out", str(tmp_path / "t.html"), "--url", db_url, cwd=tmp_path))
    svg = svg_of(tmp_path / "t.html")
    deliveries = query(db_url, "SELECT epoch, seq FROM wq_history WHERE queue = 'train' "
                               "AND kind IN ('claim', 'recover')")
    workers = [r.name for r in query(db_url, "SELECT name FROM wq_workers ORDER BY name")]
    lanes = svg.findall(f"{SVG}g[@class='lane']")
    assert [g.get("data-worker") for g in lanes] == workers == ["alice", "bob", "carol"]
    bars = svg.findall(f".//{SVG}rect[@class='bar']")
    assert len(bars) == len(deliveries) == n * epochs + 1
    assert sorted((int(b.get("data-epoch", "")), int(b.get("data-seq", ""))) for b in bars) == sorted(
        (r.epoch, r.seq) for r in deliveries)
    marks = svg.findall(f".//{SVG}path[@class='redelivery']")
    assert len(marks) == len(deliveries) - len(set(deliveries)) == 1
    assert (marks[0].get("data-epoch"), marks[0].get("data-seq")) == (e, s)
    ended = [b.get("data-end") for b in lanes[0].findall(f"{SVG}rect[@class='bar']")]
    assert ended == ["done", "requeue"]  # alice: her first item done, the second taken away
    assert f"{len(deliveries)} deliveries" in out and "1 re-deliveries" in out

    # A duplicate completion, injected behind wq_sql's back, fails the check and names the item.
    query_commit(db_url, "INSERT INTO wq_events (queue_id, item_id, epoch, seq, kind, worker_id, token, at) "
                         "SELECT queue_id, item_id, epoch, seq, kind, worker_id, token, at FROM wq_events "
                         "WHERE kind = 'done' AND epoch = 1 AND seq = 5")
    p = wq("audit", "train", "--url", db_url, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "exactly-once: FAILED" in p.stdout
    assert "epoch 1 seq 5" in p.stderr and "2 done event(s)" in p.stderr


FAILING_WORKER = """
import sys
from wq_sql import QueueExhausted, WorkQueue
wq = WorkQueue([f"w{i}" for i in range(8)], num_epochs=1, shuffle=False, name="train",
               url=sys.argv[1], worker=sys.argv[2], max_attempts=2, lease_seconds=60)
while True:
    try:
        item = wq.take()
    except QueueExhausted as e:
        print("EXHAUSTED", e.done, e.failed)
        break
    if item.work in sys.argv[3:]:
        wq.fail(item, "bad record in " + item.work)
wq.close()
"""


def test_requeue_failed_lets_the_queue_finish(db_url: str, tmp_path: Path) -> None:
    from backends import run_py

    out = run_py(FAILING_WORKER, db_url, "alice", "w2", "w5").stdout
    assert "EXHAUSTED 6 2" in out  # two attempts each, then failed
    p = wq("audit", "train", "--url", db_url, cwd=tmp_path)
    assert p.returncode == 0, p.stderr  # failed items are not an exactly-once violation
    lines = p.stdout.splitlines()
    i = lines.index("failed items: 2")
    assert lines[i + 1].split()[:6] == ["EPOCH", "SEQ", "WORK", "WORKER", "ATTEMPTS", "LAST"]
    assert [ln.split() for ln in lines[i + 2:i + 4]] == [
        ["0", "2", "w2", "alice", "2", "bad", "record", "in", "w2"],
        ["0", "5", "w5", "alice", "2", "bad", "record", "in", "w5"]]
    assert "re-delivered items: 2" in p.stdout

    out = ok(wq("requeue", "train", "--failed", "--url", db_url, cwd=tmp_path))
    assert "requeued 2 item(s)" in out
    assert "EXHAUSTED 8 0" in run_py(FAILING_WORKER, db_url, "bob").stdout  # the counters were put right
    a = json.loads(ok(wq("audit", "train", "--format", "json", "--url", db_url, cwd=tmp_path)))
    assert a["exactly_once"]["ok"] and a["failed"] == []
    by_worker = {(c["worker"], c["epoch"]): (c["done"], c["failed"]) for c in a["consumed"]}
    assert by_worker == {("alice", 0): (6, 0), ("bob", 0): (2, 0)}
    redelivered = {r["work"]: [ev["kind"] for ev in r["events"]] for r in a["redeliveries"]}
    assert redelivered["w2"] == ["claim", "fail", "claim", "fail", "requeue", "claim", "done"]


SLOW_WORKER = """
import sys, time
from wq_sql import WorkQueue
with WorkQueue([f"w{i}" for i in range(40)], shuffle=False, name="train", url=sys.argv[1],
               worker=sys.argv[2]) as wq:
    for item in wq:
        time.sleep(0.05)
"""


def test_status_watch_until_done(db_url: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from test_cli import ROOT

    ok(wq("create", "train", "--works", *[f"w{i}" for i in range(40)], "--no-shuffle", "--url", db_url,
          cwd=tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WQ_SQL_URL", None)
    watch = subprocess.Popen([sys.executable, "-m", "wq_sql", "status", "train", "--watch", "--interval",
                              "0.3", "--url", db_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=tmp_path)
    worker = subprocess.Popen([sys.executable, "-c", SLOW_WORKER, db_url, "alice"], env=env, cwd=tmp_path)
    try:
        assert worker.wait(timeout=90) == 0
        out, err = watch.communicate(timeout=60)  # exits by itself once the queue is done
    finally:
        for p in (watch, worker):
            if p.poll() is None:
                p.kill()
    assert watch.returncode == 0, err
    bars = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert len(bars) >= 2, out
    assert all(len(b.split("]")[0]) == 41 for b in bars)  # 40 cells
    done = [int(b.split("]")[1].split()[1].split("/")[0]) for b in bars]
    assert done == sorted(done) and done[0] < 40 and done[-1] == 40
    assert bars[-1] == "[" + "#" * 40 + "] 100.0%  40/40  done"
    assert "finished: 40 of 40" in out.rsplit("[", 1)[1]  # the last frame, then the command ended
    # While the worker ran, some frame had a rate and an ETA (from the recent done events).
    assert len(bars) < 4 or any(re.search(r"items/s \(\d+ done in the last minute\)  ETA \d", b)
                                for b in bars[1:-1]), out
