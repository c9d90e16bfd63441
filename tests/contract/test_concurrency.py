"""Real concurrency: worker processes, threads and forked children sharing one queue.

Every test checks exactly-once twice: from what the workers *received* (their own logs, or the
lists the threads and children kept) and by SQL over the whole table (``wq_audit``,
``wq_history``). The fork cases run in a subprocess of their own (never fork pytest itself),
started in a new session so that a hung grandchild is killed with it.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from worker_proc import ROOT, Proc, make_works, query, received_multiset

from wq_sql import QueueExhausted, WorkItem, WorkQueue


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Worker processes started by the test; whatever is still running at the end is killed."""
    started: list[Proc] = []
    yield started
    for p in started:
        p.cleanup()


def popen_script(code: str, *args: str, interactive: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], text=True,
                            stdin=subprocess.PIPE if interactive else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def read_line(p: subprocess.Popen[str], timeout: float = 60) -> str:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, f"no output from the script within {timeout}s"
    return p.stdout.readline()


def reap(p: subprocess.Popen[str]) -> None:
    """Kill what is left of the script's session (a hung forked child too)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=30)


def run_script(code: str, *args: str) -> str:
    """Run a forking script to its end (2 minutes at most); returns its stderr."""
    p = popen_script(code, *args)
    try:
        _, stderr = p.communicate(timeout=120)
    finally:
        reap(p)
    assert p.returncode == 0, stderr
    return stderr


def assert_done_exactly_once(url: str, name: str, total: int) -> None:
    """Every item of the queue is ``done``, once, with exactly one claim and one done event."""
    rows = query(url, "SELECT state, count(*) FROM wq_audit WHERE queue = :q GROUP BY state", q=name)
    assert dict(rows) == {"done": total}
    dup = query(url, "SELECT epoch, seq, count(*) FROM wq_audit WHERE queue = :q "
                     "GROUP BY epoch, seq HAVING count(*) <> 1", q=name)
    assert dup == []
    bad = query(url, """
        SELECT item_id, sum(CASE WHEN kind = 'claim' THEN 1 ELSE 0 END) AS claims,
               sum(CASE WHEN kind = 'done' THEN 1 ELSE 0 END) AS dones, count(*) AS events
        FROM wq_history WHERE queue = :q GROUP BY item_id
        HAVING sum(CASE WHEN kind = 'claim' THEN 1 ELSE 0 END) <> 1
            OR sum(CASE WHEN kind = 'done' THEN 1 ELSE 0 END) <> 1 OR count(*) <> 2""", q=name)
    assert bad == []
    n_items = query(url, "SELECT count(DISTINCT item_id) FROM wq_history WHERE queue = :q", q=name)
    assert n_items[0][0] == total


def assert_received_exactly_once(received: list[tuple[int, int, str]], works: list[str],
                                 num_epochs: int) -> None:
    """The hand-outs are every (epoch, seq) once, and each epoch is a permutation of the works."""
    keys = [(e, s) for e, s, _ in received]
    dup = [k for k, n in collections.Counter(keys).items() if n > 1]
    assert dup == [], f"handed out more than once: {dup[:10]}"
    assert sorted(keys) == [(e, s) for e in range(num_epochs) for s in range(len(works))]
    assert collections.Counter(w for _, _, w in received) == collections.Counter(works * num_epochs)
    for e in range(num_epochs):
        assert sorted(w for ep, _, w in received if ep == e) == sorted(works)


# ---------------------------------------------------------------- processes draining a queue


def test_processes_drain_two_epochs_exactly_once(db_url: str, backend: str, tmp_path: Path,
                                                 procs: list[Proc]) -> None:
    n_procs = 4 if backend == "sqlite" else 8
    n_works, distinct, epochs = 2000, 1500, 2  # duplicate works are distinct items
    works = make_works(n_works, distinct)
    barrier = tmp_path / "go"
    for i in range(n_procs):
        procs.append(Proc(db_url, "drain", f"w{i}", tmp_path / f"w{i}.log", n_works,
                          distinct=distinct, num_epochs=epochs, lease_ahead=1 if i % 2 else 8,
                          barrier=barrier, item_ms=0.5))  # work per item: no process drains alone
    for p in procs:
        p.expect("READY", timeout=60)
    barrier.touch()
    for p in procs:
        assert p.finish(timeout=120) == 0, p.stderr()
        assert p.lines[-1].startswith("EXHAUSTED"), p.lines
        assert "Traceback" not in p.stderr()

    # What the workers received, from their own logs.
    assert received_multiset(procs) == collections.Counter(works * epochs)
    received = [r for p in procs for r in p.received()]
    assert_received_exactly_once(received, works, epochs)
    # The processes really ran side by side (not one after the other).
    assert sum(1 for p in procs if p.received()) >= 2

    # What the table says.
    assert_done_exactly_once(db_url, "drain", n_works * epochs)
    audit = {(r.epoch, r.seq): (r.work, r.worker)
             for r in query(db_url, "SELECT epoch, seq, work, worker FROM wq_audit WHERE queue = 'drain'")}
    for p in procs:
        for e, s, w in p.received():
            assert audit[(e, s)] == (w, p.worker)
    done_by = dict(query(db_url, "SELECT worker, count(*) FROM wq_audit WHERE queue = 'drain' "
                                 "AND state = 'done' GROUP BY worker"))
    assert done_by == {p.worker: len(p.received()) for p in procs if p.received()}


# ---------------------------------------------------------------- concurrent construction


def test_concurrent_construction_on_an_empty_database(empty_db_url: str, tmp_path: Path,
                                                      procs: list[Proc]) -> None:
    """8 processes construct the same WorkQueue at the same instant on a database without the
    schema: one schema (migrated once), one queue, one copy of each item, and all of them work."""
    n_works = 200
    barrier = tmp_path / "go"
    for i in range(8):
        procs.append(Proc(empty_db_url, "born", f"c{i}", tmp_path / f"c{i}.log", n_works,
                          max_items=3, barrier=barrier))
    for p in procs:
        p.expect("READY", timeout=60)
    barrier.touch()
    for p in procs:
        assert p.finish(timeout=120) == 0, p.stderr()
        assert any(line.startswith("STARTED") for line in p.lines), p.lines
        assert p.lines[-1] == "STOPPED", p.lines
        assert "Traceback" not in p.stderr() and "Error" not in p.stderr(), p.stderr()
        assert len(p.received()) == 3

    logs = "".join(p.stderr() for p in procs)
    assert logs.count("Running upgrade  -> ") == 1, logs  # the schema was created once
    assert logs.count("created queue 'born'") == 1, logs

    from wq_sql.store.migrate import head_revision

    assert query(empty_db_url, "SELECT version_num FROM alembic_version") == [(head_revision(),)]
    assert query(empty_db_url, "SELECT count(*) FROM wq_queues") == [(1,)]
    assert query(empty_db_url, "SELECT count(*), count(DISTINCT idx) FROM wq_works") == [(n_works, n_works)]
    assert query(empty_db_url, "SELECT count(*), count(DISTINCT seq), min(epoch), max(epoch) "
                               "FROM wq_items") == [(n_works, n_works, 0, 0)]
    received = [(e, s) for p in procs for e, s, _ in p.received()]
    assert len(set(received)) == len(received) == 24
    done = query(empty_db_url, "SELECT epoch, seq FROM wq_audit WHERE state = 'done'")
    assert sorted(received) == sorted((r.epoch, r.seq) for r in done)
    assert query(empty_db_url, "SELECT count(*) FROM wq_audit WHERE state = 'claimed'") == [(0,)]


# ---------------------------------------------------------------- threads and fork


def test_threads_share_one_queue(db_url: str) -> None:
    """8 threads call take() on one WorkQueue until it is exhausted: every item once."""
    works = make_works(600, 500)
    wq = WorkQueue(works, num_epochs=2, url=db_url, worker="threads", name="th", lease_ahead=4)
    start = threading.Barrier(8)
    got: list[list[tuple[int, int, str]]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait(timeout=30)
            while True:
                try:
                    item = wq.take()
                except QueueExhausted:
                    return
                assert isinstance(item, WorkItem) and item == item.work
                got[i].append((item.epoch, item.seq, item.work))
        except BaseException as e:  # reported below with the thread's number
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is still taking after 120s"
    assert errors == []
    wq.close()
    assert_received_exactly_once([r for g in got for r in g], works, 2)
    assert sum(1 for g in got if g) >= 2
    assert_done_exactly_once(db_url, "th", len(works) * 2)


FORK_SCRIPT = r"""
import json, os, sys, traceback
from wq_sql import QueueExhausted, WorkItem, WorkQueue

url, out = sys.argv[1], sys.argv[2]
works = [f"w{i:05d}" for i in range(300)]
wq = WorkQueue(works, shuffle=False, name="fork", url=url, worker="parent", lease_ahead=2)
first = wq.take()   # handed out before the fork; one more item sits in the buffer
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        os.close(r)
        got = []
        for item in wq:
            got.append([item.epoch, item.seq, item.work])
            if len(got) == 1:
                os.write(w, b"1")          # let the parent go on only once the child took one
        wq.close()
        with open(out + ".child", "w") as f:
            json.dump({"worker": wq.worker, "got": got}, f)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)
os.close(w)
assert os.read(r, 1) == b"1", "the child took nothing"
got = [[first.epoch, first.seq, first.work]]
for item in wq:
    got.append([item.epoch, item.seq, item.work])
wq.close()
_, status = os.waitpid(pid, 0)
with open(out + ".parent", "w") as f:
    json.dump({"worker": wq.worker, "got": got, "child_status": status}, f)
"""


def test_forked_child_takes_its_own_items(db_url: str, tmp_path: Path) -> None:
    """A child forked after the parent took an item opens its own connections under its own
    identity; parent and child never receive the same item."""
    out = tmp_path / "fork"
    stderr = run_script(FORK_SCRIPT, db_url, str(out))
    parent = json.loads(out.with_suffix(".parent").read_text())
    child = json.loads(out.with_suffix(".child").read_text())
    assert parent["child_status"] == 0, stderr
    assert parent["worker"] == "parent"
    assert child["worker"].startswith("parent+") and child["worker"] != "parent"
    pk = [tuple(x[:2]) for x in parent["got"]]
    ck = [tuple(x[:2]) for x in child["got"]]
    assert ck and pk
    assert pk[0] == (0, 0) and (0, 0) not in ck
    assert (0, 1) not in ck  # claimed ahead by the parent before the fork
    assert not set(pk) & set(ck)
    assert sorted(pk + ck) == [(0, s) for s in range(300)]
    assert_done_exactly_once(db_url, "fork", 300)
    by_worker = dict(query(db_url, "SELECT worker, count(*) FROM wq_audit WHERE queue = 'fork' "
                                   "GROUP BY worker"))
    assert by_worker == {"parent": len(pk), child["worker"]: len(ck)}


KEPT_ENGINE_SCRIPT = r"""
import json, os, sys, traceback
from wq_sql import WorkQueue
from wq_sql.store import engine as engines
from wq_sql.queue import prepare_children

url, out = sys.argv[1], sys.argv[2]
wq = WorkQueue([f"w{i:04d}" for i in range(200)], shuffle=False, name="kept", url=url, worker="parent",
               lease_ahead=4)
prepare_children(url)
(kept,) = [engine for _, engine in engines._spares.values()]
assert kept.pool.checkedin() == 0 and kept.pool.checkedout() == 0, "a kept engine holds a connection"
first = wq.take()
pids = []
for k in range(2):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            inherited = kept.pool.checkedin() + kept.pool.checkedout()  # connections from the parent
            child = WorkQueue.attach("kept", url=url, worker=f"child{k}", lease_ahead=4)
            again = WorkQueue.attach("kept", url=url, worker=f"child{k}b", lease_ahead=4)
            got = [[i.epoch, i.seq] for i in child]
            with open(f"{out}.{k}", "w") as f:
                json.dump({"kept": child.engine is kept, "inherited": inherited,
                           "again_kept": again.engine is kept, "got": got}, f)
            again.close()
            child.close()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    pids.append(pid)
got = [[first.epoch, first.seq]] + [[i.epoch, i.seq] for i in wq]
wq.close()
statuses = [os.waitpid(pid, 0)[1] for pid in pids]
later = WorkQueue.attach("kept", url=url, worker="parent2")
with open(out + ".parent", "w") as f:
    json.dump({"got": got, "statuses": statuses, "later_kept": later.engine is kept,
               "still_kept": any(e is kept for _, e in engines._spares.values())}, f)
later.close()
"""


def test_forked_children_open_on_the_engine_the_parent_kept(db_url: str, tmp_path: Path) -> None:
    """``prepare_children`` makes the children's engine in the parent, with no connection: each
    forked child's first queue object takes it, with no connection in its pool (its second makes
    its own engine), the parent keeps it for later children and never uses it; every item once."""
    out = tmp_path / "kept"
    stderr = run_script(KEPT_ENGINE_SCRIPT, db_url, str(out))
    parent = json.loads(out.with_suffix(".parent").read_text())
    assert parent["statuses"] == [0, 0], stderr
    assert parent["later_kept"] is False and parent["still_kept"] is True
    children = [json.loads(Path(f"{out}.{k}").read_text()) for k in range(2)]
    for child in children:
        assert child["kept"] is True and child["inherited"] == 0 and child["again_kept"] is False
    keys = [tuple(x) for x in parent["got"]] + [tuple(x) for c in children for x in c["got"]]
    assert sorted(keys) == [(0, s) for s in range(200)]
    assert_done_exactly_once(db_url, "kept", 200)


FORK_WHILE_TAKING_SCRIPT = r"""
import faulthandler, json, os, sys, threading, time, traceback
from wq_sql import WorkQueue

url, out = sys.argv[1], sys.argv[2]
wq = WorkQueue([f"w{i:03d}" for i in range(20)], shuffle=False, name="busy", url=url, worker="parent")
print("READY", flush=True)
assert sys.stdin.readline() == "go\n"  # the test now holds the database
got = []
taker = threading.Thread(target=lambda: got.append(wq.take()), daemon=True)
taker.start()
deadline = time.monotonic() + 30
def inside_take() -> bool:
    frame = sys._current_frames().get(taker.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "_fill":  # take()'s round trip, which the test's lock blocks
            return True
        frame = frame.f_back
    return False


while not inside_take():  # the thread is not blocked inside take() yet
    assert time.monotonic() < deadline, "the taking thread never got in"
    time.sleep(0.01)
print("FORKING", flush=True)  # SQLite: fork() waits for the thread's transaction to end
pid = os.fork()
if pid == 0:
    code = 1
    try:
        faulthandler.dump_traceback_later(30, exit=True)
        item = wq.take()
        wq.close()
        with open(out + ".child", "w") as f:
            json.dump({"worker": wq.worker, "got": [item.epoch, item.seq]}, f)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)
taker.join(60)
assert got, "the parent's thread got nothing"
_, status = os.waitpid(pid, 0)
wq.close()
with open(out + ".parent", "w") as f:
    json.dump({"got": [got[0].epoch, got[0].seq], "child_status": status}, f)
"""


def hold_database(url: str) -> Callable[[], None]:
    """Block every writer of the queue tables (from this process); returns the release."""
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.split("///", 1)[1], isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
    else:
        import psycopg2

        con = psycopg2.connect(url.replace("postgresql+psycopg2", "postgresql"))
        con.cursor().execute("LOCK TABLE wq_items IN EXCLUSIVE MODE")

    def release() -> None:
        con.rollback()
        con.close()
    return release


def test_fork_while_another_thread_is_inside_take(db_url: str, tmp_path: Path) -> None:
    """fork() while another thread of the parent is inside take() (blocked in its claim, holding
    the queue's lock): the child must not inherit that lock as held forever (the thread does not
    exist in the child); child and parent each get their own item. On SQLite fork() first waits
    for the thread's transaction to end (the child must inherit no SQLite connection)."""
    out = tmp_path / "fork"
    p = popen_script(FORK_WHILE_TAKING_SCRIPT, db_url, str(out), interactive=True)
    release = None
    try:
        assert p.stdin is not None
        assert read_line(p) == "READY\n"
        release = hold_database(db_url)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert read_line(p) == "FORKING\n"
        time.sleep(0.5)  # let fork() begin while the thread is still blocked (either order is fine)
        release()
        release = None
        _, stderr = p.communicate(timeout=120)
    finally:
        if release is not None:
            release()
        reap(p)
    assert p.returncode == 0, stderr
    parent = json.loads(out.with_suffix(".parent").read_text())
    assert parent["child_status"] == 0, stderr  # not hung on the lock the thread held
    child = json.loads(out.with_suffix(".child").read_text())
    assert sorted([parent["got"], child["got"]]) == [[0, 0], [0, 1]]
    assert child["worker"].startswith("parent+")
    rows = query(db_url, "SELECT seq, state FROM wq_audit WHERE queue = 'busy' ORDER BY seq")
    assert [tuple(r) for r in rows] == [(0, "done"), (1, "done")] + [(s, "pending") for s in range(2, 20)]


FORK_OUTLIVES_SCRIPT = r"""
import json, os, sys
from wq_sql import WorkQueue

url, out = sys.argv[1], sys.argv[2]
wq = WorkQueue([f"w{i:03d}" for i in range(50)], shuffle=False, name="outlive", url=url, worker="p",
               lease_ahead=1, claim_ahead=False)  # nothing claimed ahead: the exact items below
first = wq.take()
r1, w1 = os.pipe()
r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    code = 1
    try:
        got = [wq.take()]
        os.write(w1, b"1")  # the child's own connections are open
        os.read(r2, 1)      # the parent has closed all of its connections
        got += [wq.take() for _ in range(10)]
        wq.close()
        with open(out + ".child", "w") as f:
            json.dump({"worker": wq.worker, "got": [[g.epoch, g.seq] for g in got]}, f)
        code = 0
    finally:
        os._exit(code)
assert os.read(r1, 1) == b"1"
wq.close()
os.write(w2, b"1")
_, status = os.waitpid(pid, 0)
with open(out + ".parent", "w") as f:
    json.dump({"got": [first.epoch, first.seq], "child_status": status}, f)
"""


def test_forked_child_outlives_the_parents_connections(db_url: str, tmp_path: Path) -> None:
    """The parent closes its queue (its last connection) while the forked child goes on: the
    child's claims and completions are all in the database afterwards. (SQLite: a child that
    shared the parent's in-process lock state lost them when the parent's close removed the WAL.)"""
    out = tmp_path / "fork"
    stderr = run_script(FORK_OUTLIVES_SCRIPT, db_url, str(out))
    parent = json.loads(out.with_suffix(".parent").read_text())
    assert parent["child_status"] == 0, stderr
    child = json.loads(out.with_suffix(".child").read_text())
    assert parent["got"] == [0, 0]
    assert child["got"] == [[0, s] for s in range(1, 12)]
    rows = query(db_url, "SELECT seq, state, worker FROM wq_audit WHERE queue = 'outlive' "
                         "AND state <> 'pending' ORDER BY seq")
    expected = [(0, "done", "p")] + [(s, "done", child["worker"]) for s in range(1, 12)]
    assert [tuple(r) for r in rows] == expected
    assert query(db_url, "SELECT kind, count(*) FROM wq_history WHERE queue = 'outlive' GROUP BY kind "
                         "ORDER BY kind") == [("claim", 12), ("done", 12)]


FORK_REPEATEDLY_SCRIPT = r"""
import faulthandler, json, os, sys, threading, traceback
from wq_sql import QueueExhausted, WorkQueue

url, out, forks = sys.argv[1], sys.argv[2], int(sys.argv[3])
wq = WorkQueue([f"w{i:05d}" for i in range(50000)], shuffle=False, name="forks", url=url,
               worker="parent")
stop = threading.Event()
taken = []

def take_all_the_time():
    while not stop.is_set():
        try:
            item = wq.take()
        except QueueExhausted:  # only if a child hung meanwhile; the test fails on its status
            return
        taken.append([item.epoch, item.seq])

taker = threading.Thread(target=take_all_the_time, daemon=True)
taker.start()
while len(taken) < 20:
    stop.wait(0.01)
statuses = []
for k in range(forks):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            faulthandler.dump_traceback_later(20, exit=True)
            item = wq.take()
            wq.close()
            with open(f"{out}.child{k}", "w") as f:
                json.dump({"worker": wq.worker, "got": [item.epoch, item.seq]}, f)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    statuses.append(os.waitpid(pid, 0)[1])
    if statuses[-1]:
        break
stop.set()
taker.join(60)
wq.close()
with open(out + ".parent", "w") as f:
    json.dump({"taken": taken, "statuses": statuses}, f)
"""


def test_fork_repeatedly_while_a_thread_takes(db_url: str, tmp_path: Path) -> None:
    """A thread takes items all the time (so it is inside a transaction at most instants) while
    the main thread forks children that each take an item: every child gets its own item at
    once. (SQLite: a child that inherits a connection in the middle of a write transaction
    inherits its lock too, and waits for it forever.)"""
    out, forks = tmp_path / "fork", 8
    stderr = run_script(FORK_REPEATEDLY_SCRIPT, db_url, str(out), str(forks))
    parent = json.loads(out.with_suffix(".parent").read_text())
    assert parent["statuses"] == [0] * forks, stderr
    children = [json.loads((tmp_path / f"fork.child{k}").read_text()) for k in range(forks)]
    got = [tuple(x) for x in parent["taken"]] + [tuple(c["got"]) for c in children]
    assert len(set(got)) == len(got)
    assert len({c["worker"] for c in children}) == forks
    done = query(db_url, "SELECT epoch, seq FROM wq_audit WHERE queue = 'forks' AND state = 'done'")
    assert sorted(got) == sorted(tuple(r) for r in done)
    claimed = query(db_url, "SELECT count(*) FROM wq_audit WHERE queue = 'forks' AND state = 'claimed'")
    assert claimed == [(0,)]
