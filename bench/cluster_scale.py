"""A cluster's worth of workers on one machine: N workers at one queue through PgBouncer in
transaction mode, on a throwaway PostgreSQL cluster with ``max_connections = 100``.

Each worker is a distinct ``WorkQueue`` (its own worker identity, engine and heartbeat thread) in a
thread; processes of ``--per-proc`` threads make up N (2 cores cannot run 2,000 processes). All
workers use the defaults a user gets (``lease_seconds=60``, heartbeat every 5 s, ``poll_seconds=1``,
``lease_ahead=1``) and a plain ``postgresql://`` URL of PgBouncer.

``scale``: for each N (default 100, 500, 2000), in the same run:

* **busy**: the workers ask for ``--rate`` items/s together (400: each item is N * 1000 / rate
  ms of work, 250 ms at N = 100, 5 s at N = 2,000: the same load from 20x the workers, as a
  fleet of trainers spending seconds per item does; ``--rate 0 --item-ms 0``: every worker takes
  as fast as it can, which measures the harness's GIL at N >= 500) for ``--seconds``: items/s, ``take()`` p50/p99, server connections in use (``pg_stat_activity``,
  sampled), PgBouncer's waiting clients, Postgres server CPU (``/proc`` of the cluster's
  processes), the harness's own CPU (the worker processes), errors and refused connections.
* **idle**: the end of an epoch: a holder takes every item of a second queue (all handed out,
  none buffered: buffered items would go back to the queue at its second heartbeat, and every
  waiter would wake and claim) and keeps them; all N workers wait in ``take()``. After
  ``--idle-warmup`` seconds (their polls back off), for ``--idle-seconds``: what the server
  received from the workers, counted by ``pg_stat_statements`` (read from another database, so
  the bench's own statements are not counted; divided by the wall time from the reset to the
  read): wq_sql transactions (each begins with its one ``set_config``), and of them polls (the
  poll's statement, on its own or riding on a heartbeat), heartbeats (renewals), looks for lost
  items (sampled: about 4 workers per host per heartbeat period), and every statement
  (``BEGIN``/``COMMIT`` included), per worker per ``poll_seconds``.

Reported as ratios against N = 100. Targets (issue 17): at N = 2,000 throughput >= 0.8x and p99
<= 5x of N = 100, no error, no refused connection; idle workers <= 1 transaction (a poll, a
heartbeat, or a look: all counted) per worker per ``poll_seconds``.

``tail``: the long tail at scale: ``--workers`` (200) workers, ``--slow-frac`` (10%) of them
``--slow-factor`` (4x) slower, each item a sleep of ``--fast-ms``; makespan against the ideal
(total work / total speed) and static sharding (``works[i::W]``, computed from the same speeds).
Target: makespan <= 1.10x ideal. ``--trace-slow MS``: where the time goes: the stacks of takes
that run longer than MS ms (sampled every 10 ms; ``[over]`` once the queue ended), when slow takes
began, the worker processes' garbage collections, PgBouncer's queue, and when workers saw the end.
``--listen-direct`` (both commands): each worker process's doorbell listener connects to the
server directly (``$WQ_SQL_LISTEN_URL``), so waiting workers are woken by the end instead of
finding it by a poll; without it the bell is off behind PgBouncer.

    .venv/bin/python bench/cluster_scale.py scale                  # N = 100, 500, 2000 (~10 min)
    .venv/bin/python bench/cluster_scale.py scale --rate 0 --n 20,60 # no work per item: saturation
    .venv/bin/python bench/cluster_scale.py tail                   # 200 workers, 10% 4x slow
    .venv/bin/python bench/cluster_scale.py tail --trace-slow 200  # ... and where slow takes wait
    make bench-cluster                                             # both, as in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import heapq
import logging
import math
import multiprocessing as mp
import os
import queue
import random
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, dump, git_rev, machine, pct  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "support"))
from pgbouncer import PgBouncer  # noqa: E402
from pgcluster import PgCluster  # noqa: E402

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402
from wq_sql.store.hot.claim import ClaimRound  # noqa: E402

DB = "scale"
SERVER_CPUS, HARNESS_CPUS = {0}, {1}  # --split-cores
POLL_SECONDS = 1.0


# ---------------------------------------------------------------- /proc


def _cpu_of(pids: list[int]) -> dict[int, float]:
    """utime + stime (seconds) of each pid still alive."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _children(ppid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    kids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


class CpuMeter:
    """CPU seconds used by a process tree (the postmaster and its children, or one process)
    between :meth:`start` and :meth:`stop`; processes that exit meanwhile are lost (PgBouncer
    keeps its server connections, so few do)."""

    def __init__(self, root: int, tree: bool) -> None:
        self.root, self.tree = root, tree

    def _pids(self) -> list[int]:
        return [self.root, *(_children(self.root) if self.tree else [])]

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), _cpu_of(self._pids())

    def stop(self) -> tuple[float, float]:
        """(CPU seconds, wall seconds)."""
        c1 = _cpu_of(self._pids())
        cpu = sum(v - self.c0.get(pid, 0.0) for pid, v in c1.items())
        return cpu, time.monotonic() - self.t0


def _runqueue_of(pids: list[int]) -> dict[int, float]:
    """Seconds each pid's threads have waited on a run queue, runnable but not running
    (``/proc/<pid>/task/*/schedstat``, second field), summed over its threads."""
    out: dict[int, float] = {}
    for pid in pids:
        total = 0
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    total += int((task / "schedstat").read_text().split()[1])
        except OSError:
            continue
        out[pid] = total / 1e9
    return out


class RunQueueMeter(CpuMeter):
    """Like :class:`CpuMeter`, the seconds a process tree waited for a CPU while runnable: a
    process on a crowded machine that is ready to answer but not running (PgBouncer's one
    thread, a Postgres backend) delays every client it serves by that much."""

    def start(self) -> None:
        self.t0, self.c0 = time.monotonic(), _runqueue_of(self._pids())

    def stop(self) -> tuple[float, float]:
        c1 = _runqueue_of(self._pids())
        return sum(v - self.c0.get(pid, 0.0) for pid, v in c1.items()), time.monotonic() - self.t0


def _each_thread(root: int, tree: bool, do: Any) -> None:
    """Apply ``do(tid)`` to every thread of a process tree (one level of children: the
    postmaster's backends) that exists now; processes it forks later inherit the setting."""
    for pid in [root, *(_children(root) if tree else [])]:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    do(int(task.name))


def _renice(root: int, tree: bool, value: int) -> None:
    """``--server-nice``: set the scheduling priority of a process tree."""
    _each_thread(root, tree, lambda tid: os.setpriority(os.PRIO_PROCESS, tid, value))


def _pin(root: int, tree: bool, cpus: set[int]) -> None:
    """``--split-cores``: keep a process tree on these CPUs."""
    _each_thread(root, tree, lambda tid: os.sched_setaffinity(tid, cpus))


# ---------------------------------------------------------------- the worker processes


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:200])


def _proc(url: str, first: int, n: int, item_ms: float, busy: str, idle: Optional[str], ready: Any,
          go: Any, stop: Any, idle_ready: Any, out: Any, slow: Optional[list[float]] = None,
          options: Optional[dict[str, Any]] = None, trace_ms: float = 0.0, jitter: float = 0.0) -> None:
    """``n`` worker threads. Busy phase: take until ``stop`` (or the queue ends); idle phase: join
    queue ``idle`` and take until it ends. Puts one dict of results."""
    warn = _Count()
    logging.getLogger("wq_sql").addHandler(warn)
    # Each claim round's time as its caller sees it (the driver call: through PgBouncer's queue,
    # the server's work, and this process waking its thread), apart from the take() around it,
    # which may also wait for a round already under way in the refill thread.
    rounds: list[float] = []
    run = ClaimRound.run

    def timed_run(self: ClaimRound, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return run(self, *args, **kw)
        finally:
            if go.is_set() and not stop.is_set():
                rounds.append(time.perf_counter() - t)
    ClaimRound.run = timed_run  # type: ignore[method-assign]
    cpu0 = time.process_time()
    lat: list[list[float]] = [[] for _ in range(n)]
    counts = [0] * n
    finished = [0.0] * n
    errors: list[str] = []
    ready_b = threading.Barrier(n + 1)
    idle_b = threading.Barrier(n + 1)
    t_go = [0.0]
    in_take = [0.0] * n  # perf_counter at the start of the take in flight, 0: none
    idents = [0] * n
    last_wait = [0.0] * n  # the take() that raised QueueExhausted
    slow_takes: list[tuple[float, float]] = []  # --trace-slow: (start after go, seconds)

    def worker(k: int) -> None:
        idents[k] = threading.get_ident()
        name = f"w{first + k}"
        ms = slow[k] if slow is not None else item_ms
        wq = None
        try:
            wq = WorkQueue.attach(busy, url=url, worker=name, **(options or {}))
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(f"{name} join: {type(e).__name__}: {e}"[:300])
        ready_b.wait()
        go.wait()
        try:
            while wq is not None and not stop.is_set():
                t = in_take[k] = time.perf_counter()
                wq.take()
                in_take[k] = 0.0
                lat[k].append(time.perf_counter() - t)
                if trace_ms and lat[k][-1] * 1e3 > trace_ms:
                    slow_takes.append((t - t_go[0], lat[k][-1]))
                if not stop.is_set():
                    counts[k] += 1
                if ms:
                    time.sleep(ms / 1e3 * (1 + jitter * (2 * random.random() - 1)))
        except QueueExhausted:
            finished[k] = time.perf_counter()
            last_wait[k] = finished[k] - in_take[k]
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(f"{name} take: {type(e).__name__}: {e}"[:300])
        finally:
            if wq is not None:
                try:
                    wq.close()
                except BaseException as e:  # noqa: BLE001 - reported
                    errors.append(f"{name} close: {type(e).__name__}: {e}"[:300])
        if idle is None:
            return
        wq2 = None
        try:
            wq2 = WorkQueue.attach(idle, url=url, worker=name)
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(f"{name} join idle: {type(e).__name__}: {e}"[:300])
        idle_b.wait()
        try:
            while wq2 is not None:
                wq2.take()
        except QueueExhausted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(f"{name} idle take: {type(e).__name__}: {e}"[:300])
        finally:
            if wq2 is not None:
                wq2.close()

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    slow_stacks: dict[str, int] = {}
    tracing = threading.Event()
    # How late this process wakes a sleeping thread during the busy phase (a 50 ms sleep,
    # measured): what a take waits for on a crowded machine before it can even run, the queue's
    # work aside (the harness's own scheduling: N threads in N / per_proc processes on 2 cores).
    lateness: list[float] = []

    def pulse() -> None:
        go.wait()
        while not tracing.is_set() and not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.05)
            lateness.append(time.perf_counter() - t - 0.05)
    threading.Thread(target=pulse, daemon=True).start()
    gc_pauses: list[tuple[float, int, float]] = []  # --trace-slow: (when after go, generation, seconds)
    if trace_ms:
        gc_start = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_start[0] = time.perf_counter()
            elif t_go[0]:
                gc_pauses.append((gc_start[0] - t_go[0], info["generation"], time.perf_counter() - gc_start[0]))
        gc.callbacks.append(on_gc)
        threading.Thread(target=_trace_slow_takes, args=(in_take, idents, trace_ms / 1e3, slow_stacks, tracing,
                                                            finished),
                         daemon=True).start()
    ready_b.wait()
    ready.set()
    go.wait()
    t_go[0] = time.perf_counter()
    cpu_go = time.process_time()
    if idle is None:  # the long tail: the workers end with the queue
        for t in threads:
            t.join()
    else:
        stop.wait()
    tracing.set()
    cpu_busy = time.process_time() - cpu_go
    cpu_idle0 = time.process_time()
    if idle is not None:
        idle_b.wait()
        idle_ready.set()
        for t in threads:
            t.join()
    out.put({"lat": [x for ls in lat for x in ls], "first": [ls[0] for ls in lat if ls],
             "later": [x for ls in lat for x in ls[1:]], "items": sum(counts), "errors": errors,
             "warnings": warn.messages, "cpu_busy": cpu_busy, "cpu_idle": time.process_time() - cpu_idle0,
             "cpu_total": time.process_time() - cpu0, "t_go": t_go[0],
             "finished": [f - t_go[0] for f in finished if f], "slow_stacks": slow_stacks,
             "slow_takes": slow_takes, "gc_pauses": gc_pauses, "lateness": lateness, "rounds": rounds,
             "enders": [(f - t_go[0], slow[k] if slow else item_ms, last_wait[k])
                        for k, f in enumerate(finished) if f]})


def _trace_slow_takes(in_take: list[float], idents: list[int], after: float, stacks: dict[str, int],
                      halt: threading.Event, finished: list[float]) -> None:
    """``--trace-slow``: every 10 ms, the stack of each worker thread whose take() has run for
    longer than ``after`` seconds, counted by its wq_sql frames (where slow takes wait); marked
    ``[over]`` once another worker of the process saw the queue end."""
    while not halt.wait(0.01):
        now = time.perf_counter()
        frames = sys._current_frames()
        for k, t in enumerate(in_take):
            f = frames.get(idents[k]) if t and now - t > after else None
            parts = []
            while f is not None:
                code = f.f_code
                if "wq_sql" in code.co_filename or "sqlalchemy" in code.co_filename or not parts:
                    parts.append(f"{Path(code.co_filename).name}:{f.f_lineno}:{code.co_name}")
                f = f.f_back
            if parts:
                wq = [p for p in parts[1:] if not p.startswith(("base.py", "default.py", "util.py", "attr.py",
                                                                "elements.py"))]
                key = ("[over] " if any(finished) else "") + " < ".join([parts[0], *wq[:8]])
                stacks[key] = stacks.get(key, 0) + 1


# ---------------------------------------------------------------- the cluster


class Rig:
    """A throwaway cluster (max_connections 100, pg_stat_statements) and PgBouncer in front."""

    def __init__(self, a: argparse.Namespace) -> None:
        settings: dict[str, Any] = {"max_connections": 100,
                                    "shared_preload_libraries": "pg_stat_statements"}
        settings.update(kv.split("=", 1) for kv in a.pg_set)
        self.pg = PgCluster(settings, base_dir=os.environ.get("WQ_SQL_BENCH_TMP"))
        self.pg.start()
        self.pg.sql(f'CREATE DATABASE "{DB}"')
        self.pg.sql("CREATE EXTENSION pg_stat_statements", DB)
        self.pg.sql("CREATE EXTENSION pg_stat_statements")  # read from there: not counted in DB
        self.bouncer = PgBouncer("127.0.0.1", self.pg.port, pool_size=a.pool_size, max_client_conn=20_000,
                                 settings={"max_db_connections": a.pool_size,
                                           "stats_period": 1}).start()  # SHOW STATS totals each second
        self.url = self.bouncer.url(DB)
        if a.listen_direct:  # the doorbell's listeners connect directly (one per worker process)
            os.environ["WQ_SQL_LISTEN_URL"] = self.pg.url(DB)
        print(f"# cluster {self.pg.url(DB)} (max_connections 100{', ' + ', '.join(a.pg_set) if a.pg_set else ''}), "
              f"PgBouncer {self.url} (transaction pooling, pool {a.pool_size})", flush=True)

    def sql(self, q: str) -> list[Any]:
        return self.pg.sql(q, DB)

    def close(self) -> None:
        self.bouncer.close()
        self.pg.close()

    def server_connections(self) -> int:
        return int(self.sql("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                            "AND backend_type = 'client backend' AND pid <> pg_backend_pid()")[0][0])

    def xacts(self) -> int:
        """Transactions of DB (``pg_stat_database``: each backend reports its counts up to a
        second late, so short windows are off by up to a second of traffic)."""
        return int(self.pg.sql(f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{DB}'")
                   [0][0])

    def statements(self) -> list[Any]:
        """(calls, text) of every statement DB ran since the last reset, read from the postgres
        database (so this read and the bench's other ones are not among them)."""
        return self.pg.sql("SELECT calls, query FROM pg_stat_statements WHERE dbid = "
                           f"(SELECT oid FROM pg_database WHERE datname = '{DB}') ORDER BY calls DESC")

    def bouncer_totals(self) -> tuple[int, int, int]:
        """(transactions, microseconds its clients waited for a server connection, microseconds
        transactions held a server connection) of DB so far:
        PgBouncer's ``SHOW STATS`` totals (updated every ``stats_period``: 1 s in this rig)."""
        rows = [x for x in self.bouncer.show("stats") if x["database"] == DB]
        return (sum(int(x["total_xact_count"]) for x in rows), sum(int(x["total_wait_time"]) for x in rows),
                sum(int(x["total_xact_time"]) for x in rows))

    def refused(self) -> int:
        """Clients PgBouncer turned away (its log), and server connections Postgres refused."""
        assert self.bouncer.dir is not None
        log = (self.bouncer.dir / "pgbouncer.log").read_text(errors="replace")
        return sum(log.count(m) for m in ("no more connections allowed", "too many clients",
                                         "remaining connection slots"))


class Sampler(threading.Thread):
    """Samples server connections and PgBouncer's waiting clients every 0.5 s."""

    def __init__(self, rig: Rig) -> None:
        super().__init__(daemon=True)
        self.rig, self.halt = rig, threading.Event()
        self.conns: list[int] = []
        self.waiting: list[int] = []
        self.maxwait: list[float] = []  # seconds the oldest client waiting in PgBouncer waited
        self.states: dict[str, int] = {}  # server connections by pg_stat_activity state, summed

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                self.conns.append(self.rig.server_connections())
                pools = [p for p in self.rig.bouncer.show("pools") if p["database"] == DB]
                self.waiting.append(sum(int(p["cl_waiting"]) for p in pools))
                self.maxwait.append(max((int(p["maxwait"]) + int(p["maxwait_us"]) / 1e6 for p in pools),
                                        default=0.0))
                for state, c in self.rig.sql(
                        "SELECT coalesce(state, '-'), count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
                        "GROUP BY 1"):
                    self.states[state] = self.states.get(state, 0) + int(c)
            except Exception:  # noqa: BLE001 - a sample lost under load is not a result
                pass


def _create(url: str, name: str, n_items: int) -> None:
    WorkQueue([f"item-{i:07d}" for i in range(n_items)], name=name, url=url, shuffle=False,
              worker=f"creator-{name}").close()


def _start_procs(rig: Rig, n: int, per_proc: int, item_ms: float, busy: str, idle: Optional[str],
                 slow: Optional[list[float]] = None,
                 options: Optional[dict[str, Any]] = None, trace_ms: float = 0.0,
                 jitter: float = 0.0) -> tuple[list[Any], dict[str, Any]]:
    ctx = mp.get_context("fork")
    ev = {"go": ctx.Event(), "stop": ctx.Event(), "out": ctx.Queue()}
    procs, readies, idles = [], [], []
    for first in range(0, n, per_proc):
        k = min(per_proc, n - first)
        r, i = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_proc, args=(rig.url, first, k, item_ms, busy, idle, r, ev["go"], ev["stop"],
                                            i, ev["out"], slow[first:first + k] if slow else None, options,
                                            trace_ms, jitter))
        p.start()
        procs.append(p)
        readies.append(r)
        idles.append(i)
    ev["readies"], ev["idles"] = readies, idles
    return procs, ev


def _wait_all(events: list[Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for e in events:
        if not e.wait(max(0.1, deadline - time.monotonic())):
            raise RuntimeError(f"{what}: not every worker process got ready within {timeout:.0f}s")


def run_scale(rig: Rig, n: int, a: argparse.Namespace) -> dict[str, Any]:
    busy, idle = f"busy{n}", f"idle{n}"
    _create(rig.url, busy, a.items)
    _create(rig.url, idle, a.idle_items)
    t0 = time.monotonic()
    item_ms = n * 1e3 / a.rate if a.rate else a.item_ms
    procs, ev = _start_procs(rig, n, a.per_proc, item_ms, busy, idle, trace_ms=a.trace_slow, jitter=a.jitter)
    _wait_all(ev["readies"], 600, "join")
    join_s = time.monotonic() - t0
    harness = [CpuMeter(p.pid, False) for p in procs]
    server, bouncer = CpuMeter(rig.pg.postmaster_pid(), True), CpuMeter(rig.bouncer.pid or 0, False)
    waits = {"server": RunQueueMeter(rig.pg.postmaster_pid(), True),
             "bouncer": RunQueueMeter(rig.bouncer.pid or 0, False),
             "harness": [RunQueueMeter(p.pid, False) for p in procs]}
    if a.server_nice is not None:  # the database and its pooler ahead of the workers
        _renice(rig.pg.postmaster_pid(), True, a.server_nice)
        _renice(rig.bouncer.pid or 0, False, a.server_nice)
    if a.split_cores:  # as if the database and its pooler had a machine of their own
        _pin(rig.pg.postmaster_pid(), True, SERVER_CPUS)
        _pin(rig.bouncer.pid or 0, False, SERVER_CPUS)
        for p in procs:
            _pin(p.pid or 0, False, HARNESS_CPUS)
    sampler = Sampler(rig)
    x0 = rig.xacts()
    bouncer0 = rig.bouncer_totals()
    rig.pg.sql("SELECT pg_stat_statements_reset()")
    for m in (server, bouncer, *harness, waits["server"], waits["bouncer"], *waits["harness"]):
        m.start()
    sampler.start()
    ev["go"].set()
    time.sleep(a.seconds)
    ev["stop"].set()
    server_cpu, wall = server.stop()
    bouncer_cpu, _ = bouncer.stop()
    harness_cpu = sum(m.stop()[0] for m in harness)
    server_rq, _ = waits["server"].stop()
    bouncer_rq, _ = waits["bouncer"].stop()
    harness_rq = sum(m.stop()[0] for m in waits["harness"])
    busy_xacts = rig.xacts() - x0
    bouncer1 = rig.bouncer_totals()
    rounds_server = rig.pg.sql(
        "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0), coalesce(max(max_exec_time), 0) "
        f"FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = '{DB}') "
        "AND query ILIKE '%wq_claim_round(%'")[0]
    bouncer_xacts = bouncer1[0] - bouncer0[0]
    busy_kinds: dict[str, int] = {}
    for calls, q in rig.statements():
        busy_kinds[_kind(q)] = busy_kinds.get(_kind(q), 0) + int(calls)
    sampler.halt.set()
    sampler.join()

    # Idle: a holder claims every item of the idle queue; the N workers wait in take().
    holder = WorkQueue.attach(idle, url=rig.url, worker="holder", lease_ahead=a.idle_items)
    # All of them handed out, none buffered: buffered items go back at the holder's second
    # heartbeat (Dispenser.give_back_idle), and every waiter would wake, claim and back off anew.
    assert len(holder.take_many(a.idle_items)) == a.idle_items
    _wait_all(ev["idles"], 600, "idle join")
    time.sleep(a.idle_warmup)  # the waits back off to poll_seconds
    x0 = rig.xacts()
    rig.pg.sql("SELECT pg_stat_statements_reset()")
    t_reset = time.monotonic()
    server.start()
    for m in harness:
        m.start()
    time.sleep(a.idle_seconds)
    idle_server_cpu, _ = server.stop()
    idle_harness_cpu = sum(m.stop()[0] for m in harness)
    idle_wall = time.monotonic() - t_reset  # the statements' window: from the reset to this read
    stmts = rig.statements()
    idle_xacts = rig.xacts() - x0
    holder.close()  # acknowledges the items: the workers' polls see the queue end
    results = [ev["out"].get(timeout=600) for _ in procs]
    if a.trace_slow:
        print(f"\n### N = {n}, busy phase", end="")
        print_trace(results, a.trace_slow)
    for p in procs:
        p.join(60)
    lat = [x for r in results for x in r["lat"]]
    first = [x for r in results for x in r.get("first", ())]
    late = [x for r in results for x in r.get("lateness", ())]
    later = [x for r in results for x in r.get("later", ())]
    rounds = [x for r in results for x in r.get("rounds", ())]
    n_rounds_server = int(rounds_server[0])
    items = sum(r["items"] for r in results)
    errors = [e for r in results for e in r["errors"]]
    warnings = [w for r in results for w in r["warnings"]]
    by_kind: dict[str, int] = {}
    for calls, q in stmts:
        by_kind[_kind(q)] = by_kind.get(_kind(q), 0) + int(calls)
    polls = idle_wall / POLL_SECONDS
    top = [(int(c), " ".join(q.split())[:90]) for c, q in stmts[:6]]
    return {"n": n, "procs": len(procs), "join_s": join_s, "item_ms": item_ms, "rate": items / wall, "items": items,
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, "takes": len(lat),
            # Every worker's first take starts at the same instant (the go): N claims at once. At
            # N = 2,000 with 5 s items a worker takes ~3 items in 12 s, so those first takes are a
            # third of all takes (1/50 at N = 100) and the p99 is theirs; shown apart.
            "first_share": len(first) / max(1, len(lat)),
            "p99_first_ms": pct(first, 99) * 1e3 if first else 0.0,
            "p50_later_ms": pct(later, 50) * 1e3 if later else 0.0,
            "p99_later_ms": pct(later, 99) * 1e3 if later else 0.0,
            "late_p50_ms": pct(late, 50) * 1e3 if late else 0.0,
            "late_p99_ms": pct(late, 99) * 1e3 if late else 0.0,
            # A claim round as its caller saw it, the server's time for it (pg_stat_statements),
            # and what PgBouncer says its clients waited for a server connection, per transaction.
            "rounds": len(rounds), "round_p50_ms": pct(rounds, 50) * 1e3 if rounds else 0.0,
            "round_p99_ms": pct(rounds, 99) * 1e3 if rounds else 0.0,
            "round_server_mean_ms": float(rounds_server[1]) / max(1, n_rounds_server),
            "round_server_max_ms": float(rounds_server[2]),
            "bouncer_wait_ms_per_xact": (bouncer1[1] - bouncer0[1]) / 1e3 / max(1, bouncer_xacts),
            "bouncer_held_ms_per_xact": (bouncer1[2] - bouncer0[2]) / 1e3 / max(1, bouncer_xacts),
            "bouncer_xacts_per_s": bouncer_xacts / wall,
            "busy_per_s": {k: round(v / wall) for k, v in sorted(busy_kinds.items(), key=lambda kv: -kv[1])},
            # Seconds spent runnable but not running, per second: the machine's queue for its CPUs.
            "rq_server": server_rq / wall, "rq_bouncer": bouncer_rq / wall, "rq_harness": harness_rq / wall,
            "rq_harness_per_proc": harness_rq / wall / max(1, len(procs)),
            "conns_max": max(sampler.conns or [0]), "conns_median": statistics.median(sampler.conns or [0]),
            "bouncer_waiting_max": max(sampler.waiting or [0]),
            "server_cpu": server_cpu / wall, "bouncer_cpu": bouncer_cpu / wall, "harness_cpu": harness_cpu / wall,
            "server_cpu_ms_per_item": server_cpu / max(1, items) * 1e3,
            "harness_cpu_ms_per_item": harness_cpu / max(1, items) * 1e3,
            "busy_xacts_per_s": busy_xacts / wall,
            "idle_wall": idle_wall,
            # Transactions: each wq_sql transaction sends one set_config (its timeouts) first.
            "idle_tx_per_worker_per_poll": by_kind.get("timeouts", 0) / n / polls,
            "idle_xacts_per_worker_per_poll": idle_xacts / n / polls,  # pg_stat_database: lags
            "idle_polls_per_worker_per_poll": (by_kind.get("poll", 0) + by_kind.get("heartbeat+poll", 0)) / n / polls,
            "idle_beats_per_worker_per_poll": (by_kind.get("heartbeat", 0) + by_kind.get("heartbeat+poll", 0))
            / n / polls,
            "idle_looks_per_worker_per_poll": by_kind.get("look", 0) / n / polls,
            "idle_stmts_per_worker_per_poll": sum(by_kind.values()) / n / polls,
            "idle_by_kind": by_kind, "idle_top": top,
            "idle_server_cpu": idle_server_cpu / idle_wall, "idle_harness_cpu": idle_harness_cpu / idle_wall,
            "errors": errors[:10], "n_errors": len(errors), "warnings": warnings[:5], "n_warnings": len(warnings),
            "refused": rig.refused()}


def _kind(q: str) -> str:
    """What a statement of the idle window is (pg_stat_statements' normalised text)."""
    ql = " ".join(q.lower().split())
    if ql in ("begin", "commit", "rollback"):
        return "begin/commit"
    if "set_config" in ql:
        return "timeouts"  # the first statement of every wq_sql transaction
    if "wq_claim_round(" in ql:
        return "claim"
    if ql.startswith("with w as (update wq_workers set heartbeat_at"):  # renewal.Renewal
        return "heartbeat+poll" if "epochs_created" in ql else "heartbeat"  # a waiting take's poll rode on it
    if "epochs_created" in ql and "exists" in ql:
        return "poll"  # poll.Poll, by a waiting take (or riding on its heartbeat, on SQLite)
    if ql.startswith("update wq_workers set heartbeat_at") or ql.startswith("update wq_items set lease_until"):
        return "heartbeat"  # the renewal of code before renewal.Renewal
    if "wq_workers" in ql or "lease_until < clock_timestamp()" in ql:
        return "look"  # ops.holders_to_check, live_on_host, expire: the sampled look for lost items
    return "other"


def scale(a: argparse.Namespace) -> int:
    ns = [int(x) for x in a.n.split(",")]
    rig = Rig(a)
    runs = []
    try:
        for n in ns:
            r = run_scale(rig, n, a)
            runs.append(r)
            print(f"  N={n:5d} ({r['procs']} procs, joined in {r['join_s']:.0f}s): {r['rate']:7.0f} items/s, "
                  f"take p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms, server conns max {r['conns_max']}, "
                  f"bouncer waiting max {r['bouncer_waiting_max']}, CPU server {r['server_cpu']:.2f} "
                  f"bouncer {r['bouncer_cpu']:.2f} harness {r['harness_cpu']:.2f} cores; idle "
                  f"({r['idle_wall']:.2f} s): {r['idle_tx_per_worker_per_poll']:.3f} tx, "
                  f"{r['idle_polls_per_worker_per_poll']:.3f} polls, {r['idle_beats_per_worker_per_poll']:.3f} "
                  f"renewals, {r['idle_looks_per_worker_per_poll']:.3f} look statements, "
                  f"{r['idle_stmts_per_worker_per_poll']:.2f} statements per worker per poll_seconds "
                  f"{r['idle_by_kind']}; errors {r['n_errors']}, "
                  f"warnings {r['n_warnings']}, refused {r['refused']}", flush=True)
            for e in r["errors"][:3] + r["warnings"][:3]:
                print("    ", e, flush=True)
    finally:
        rig.close()
    report_scale(runs, a)
    dump(a.json, runs)
    return 0


def report_scale(runs: list[dict[str, Any]], a: argparse.Namespace) -> None:
    ref = runs[0]
    load = (f"the workers ask for {a.rate:g} items/s together (item = N * 1000 / {a.rate:g} ms of work)"
            if a.rate else f"item {a.item_ms:g} ms") + (f", each item's work +-{a.jitter:.0%}" if a.jitter else "")
    print(f"\n## {len(runs)} sizes, {a.seconds:.0f} s busy and {a.idle_seconds:.0f} s idle each, "
          f"{a.per_proc} workers per process, {load}, PgBouncer pool {a.pool_size}\n")
    print("| N | procs | item ms | items/s | x N=100 | take p50 / p99 ms | p99 x N=100 | server conns (max) "
          "| clients waiting in PgBouncer (max) | server CPU cores | x N=100 | PgBouncer CPU | harness CPU "
          "| server / harness CPU ms per item | idle, per worker per poll_seconds: tx / polls / statements "
          "| idle server CPU "
          "| errors / refused |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['n']} | {r['procs']} | {r['item_ms']:g} | {r['rate']:.0f} | {r['rate'] / ref['rate']:.2f} "
              f"| {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | {r['p99_ms'] / ref['p99_ms']:.2f} | {r['conns_max']} "
              f"| {r['bouncer_waiting_max']} | {r['server_cpu']:.2f} | {r['server_cpu'] / ref['server_cpu']:.2f} "
              f"| {r['bouncer_cpu']:.2f} | {r['harness_cpu']:.2f} "
              f"| {r['server_cpu_ms_per_item']:.2f} / {r['harness_cpu_ms_per_item']:.2f} "
              f"| {r['idle_tx_per_worker_per_poll']:.3f} / {r['idle_polls_per_worker_per_poll']:.3f} "
              f"/ {r['idle_stmts_per_worker_per_poll']:.2f} "
              f"| {r['idle_server_cpu']:.2f} | {r['n_errors']} / {r['refused']} |")
    last = runs[-1]
    checks = [(f"throughput >= 0.8x of N={ref['n']}", last["rate"] / ref["rate"] >= 0.8),
              (f"p99 <= 5x of N={ref['n']}", last["p99_ms"] / ref["p99_ms"] <= 5.0),
              ("no error", all(r["n_errors"] == 0 for r in runs)),
              ("no refused connection", all(r["refused"] == 0 for r in runs)),
              ("idle: <= 1 transaction (polls, heartbeats, looks) per worker per poll_seconds",
               all(r["idle_tx_per_worker_per_poll"] <= 1.0 for r in runs))]
    print(f"\nat N={last['n']}: " + "; ".join(f"{c}: {'met' if ok else 'MISSED'}" for c, ok in checks))
    print("\ntake() apart (not the target's figure): every worker's first take starts at the go, all N at "
          "once; the later takes are the steady state")
    print("| N | first takes / all | first takes p99 ms | later takes p50 / p99 ms | later p99 x N=100 "
          "| a 50 ms sleep wakes late by, p50 / p99 ms (the machine, not the queue) |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['n']} | {r['first_share']:.3f} | {r['p99_first_ms']:.1f} | {r['p50_later_ms']:.1f} / "
              f"{r['p99_later_ms']:.1f} | {r['p99_later_ms'] / max(1e-9, ref['p99_later_ms']):.2f} "
              f"| {r['late_p50_ms']:.1f} / {r['late_p99_ms']:.1f} |")
    print("\nwhere a later take's time goes: a claim round as the worker saw it, the server's time for the same "
          "rounds, PgBouncer's wait for a server connection, and the seconds per second each part of the "
          "machine spent runnable but not running (the 2 cores' queue)")
    print("| N | claim rounds | round p50 / p99 ms (worker) | round mean / max ms (server) "
          "| PgBouncer: transactions/s, a server connection held ms / waited for ms per transaction "
          "| run-queue s/s: server / PgBouncer / harness (per process) |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['n']} | {r['rounds']} | {r['round_p50_ms']:.1f} / {r['round_p99_ms']:.1f} "
              f"| {r['round_server_mean_ms']:.2f} / {r['round_server_max_ms']:.1f} "
              f"| {r['bouncer_xacts_per_s']:.0f}, {r['bouncer_held_ms_per_xact']:.2f} / "
              f"{r['bouncer_wait_ms_per_xact']:.2f} | {r['rq_server']:.2f} / {r['rq_bouncer']:.3f} / "
              f"{r['rq_harness']:.2f} ({r['rq_harness_per_proc']:.3f}) |")
    print("\nbusy window, statements per second by kind (pg_stat_statements):")
    for r in runs:
        print(f"  N={r['n']}: {r['busy_per_s']}")
    print("\nidle window, statements by kind (pg_stat_statements):")
    for r in runs:
        print(f"  N={r['n']}: {r['idle_by_kind']}; top: {r['idle_top'][:3]}")
    print(flush=True)


# ---------------------------------------------------------------- the long tail at scale


def _greedy_makespan(ms: list[float], items: int) -> float:
    """The makespan of a work queue that costs nothing: items are whole, so the last ones end up
    to one item's time after the fluid ideal, more when a slow worker takes one near the end."""
    free = [(0.0, i) for i in range(len(ms))]
    end = 0.0
    for _ in range(items):
        t, i = heapq.heappop(free)
        end = max(end, t + ms[i] / 1e3)
        heapq.heappush(free, (t + ms[i] / 1e3, i))
    return end


def tail(a: argparse.Namespace) -> int:
    rig = Rig(a)
    w = a.workers
    n_slow = max(1, round(w * a.slow_frac))
    # Slow workers spread over the processes (every k-th), not all in one.
    step = w / n_slow
    slow_idx = {int(i * step) for i in range(n_slow)}
    ms = [a.fast_ms * (a.slow_factor if i in slow_idx else 1.0) for i in range(w)]
    items = a.items_per_worker * w
    speed = sum(1e3 / m for m in ms)
    ideal = items / speed
    static = max(len(range(i, items, w)) * ms[i] / 1e3 for i in range(w))
    greedy = _greedy_makespan(ms, items)
    try:
        name = "tail"
        _create(rig.url, name, items)
        procs, ev = _start_procs(rig, w, a.per_proc, 0.0, name, None, ms,
                                 {"claim_ahead": True} if a.claim_ahead else None, a.trace_slow)
        _wait_all(ev["readies"], 600, "join")
        server = CpuMeter(rig.pg.postmaster_pid(), True)
        server.start()
        sampler = Sampler(rig)
        sampler.start()
        ev["go"].set()
        # The workers end by themselves (QueueExhausted), each process once its threads did.
        deadline = time.monotonic() + ideal * 3 + 120
        results = []
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(ev["out"].get(timeout=1))
            except queue.Empty:
                continue
        server_cpu, wall = server.stop()
        sampler.halt.set()
        sampler.join()
        stats = [x for x in rig.bouncer.show("stats") if x["database"] == DB]
        for p in procs:
            p.join(60)
        # Where the time beyond the zero-overhead queue goes: the drain itself (first claim to
        # last item done, by the database clock) or the workers' noticing that it is over.
        drain, start = (float(x) for x in rig.sql(
            "SELECT extract(epoch FROM max(done_at) - min(claimed_at)), "
            f"extract(epoch FROM (SELECT claimed_at FROM wq_items ORDER BY claimed_at OFFSET {w - 1} LIMIT 1) "
            "- min(claimed_at)) FROM wq_items")[0])
        top = rig.sql("SELECT calls, round(mean_exec_time::numeric, 2), round(max_exec_time::numeric, 1), "
                      "left(regexp_replace(query, '\\s+', ' ', 'g'), 90) FROM pg_stat_statements "
                      "ORDER BY total_exec_time DESC LIMIT 6")
    finally:
        rig.close()
    finished = [f for r in results for f in r["finished"]]
    errors = [e for r in results for e in r["errors"]]
    makespan = max(finished) if finished else math.nan
    print(f"\n## long tail at scale: {w} workers ({n_slow} of them {a.slow_factor:g}x slow), {items} items of "
          f"{a.fast_ms:g} ms (slow: {a.fast_ms * a.slow_factor:g} ms), through PgBouncer"
          f"{', claim_ahead=True' if a.claim_ahead else ''}\n")
    print("| | seconds | x ideal |")
    print("|---|---|---|")
    print(f"| work queue (measured: go to the last worker's end) | {makespan:.2f} | {makespan / ideal:.3f} |")
    print(f"| work queue with zero overhead: each worker takes the next item when free (computed) "
          f"| {greedy:.2f} | {greedy / ideal:.3f} |")
    print(f"| static sharding, works[i::{w}] (computed) | {static:.2f} | {static / ideal:.3f} |")
    print(f"| ideal: total work / total speed (computed) | {ideal:.2f} | 1.000 |")
    print(f"| drain: first claim to last item done (database clock) | {drain:.2f} | {drain / ideal:.3f} |")
    print(f"| start: first claim to every worker's first (the {w}th claim) | {start:.2f} | |")
    lat = sorted(x for r in results for x in r["lat"])
    if lat:
        per_worker = sum(lat) / w
        print(f"| take(): p50 {lat[len(lat) // 2] * 1e3:.1f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms; "
              f"time in take() per worker | {per_worker:.2f} | {per_worker / ideal:.3f} |")
    print("\nthe server's top statements by total time: calls, mean ms, max ms, text")
    for row in top:
        print("  ", " | ".join(str(x) for x in row))
    samples = max(1, len(sampler.conns))
    print(f"\nPgBouncer: clients waiting for a server connection, median {statistics.median(sampler.waiting or [0])}"
          f" max {max(sampler.waiting or [0])}; longest wait, median {statistics.median(sampler.maxwait or [0]):.3f} s"
          f" max {max(sampler.maxwait or [0]):.3f} s; server connections by state (mean): "
          + ", ".join(f"{k} {v / samples:.1f}" for k, v in sorted(sampler.states.items())))
    for x in stats:
        print("  SHOW STATS:", {k: x[k] for k in ("total_xact_count", "total_query_count", "total_xact_time",
                                                 "total_query_time", "total_wait_time", "avg_xact_time",
                                                 "avg_query_time", "avg_wait_time") if k in x})
    if a.trace_slow:
        enders = sorted((e for r in results for e in r["enders"]), reverse=True)
        ends = sorted(e[0] for e in enders)
        if ends:
            print(f"\nworkers seeing the end, after go: first {ends[0]:.2f} s, median {ends[len(ends) // 2]:.2f} s, "
                  f"last {ends[-1]:.2f} s (the last item was done {drain:.2f} s after the first claim)")
        print("the last workers to see the end (after go s, item ms, the take() that said so, ms): "
              + ", ".join(f"{t:.2f}/{ms:g}/{d * 1e3:.0f}" for t, ms, d in enders[:12]))
        print_trace(results, a.trace_slow)
    cpu = sum(r["cpu_total"] for r in results)
    print(f"| worker processes' CPU, all of them (cores over the drain) | {cpu / drain:.2f} | |")
    print(f"\nworkers that ended: {len(finished)} of {w}; errors {len(errors)} {errors[:3]}; "
          f"server CPU {server_cpu / wall:.2f} cores; target makespan <= 1.10x ideal: "
          f"{'met' if makespan / ideal <= 1.10 and not errors and len(finished) == w else 'MISSED'}", flush=True)
    dump(a.json, {"makespan": makespan, "ideal": ideal, "static": static, "greedy": greedy, "errors": errors,
                  "ended": len(finished), "workers": w})
    return 0 if not errors else 1


def print_trace(results: list[dict[str, Any]], trace_ms: float) -> None:
    """``--trace-slow``: when slow takes began, the worker processes' garbage collections, and
    where slow takes waited (their stacks, the most sampled first)."""
    stacks: dict[str, int] = {}
    for r in results:
        for key, c in r["slow_stacks"].items():
            stacks[key] = stacks.get(key, 0) + c
    total = sum(stacks.values())
    per_s: dict[int, list[float]] = {}
    for r in results:
        for t0, d in r["slow_takes"]:
            per_s.setdefault(int(t0), []).append(d)
    print(f"\ntakes longer than {trace_ms:g} ms by the second they began (count, longest ms): "
          + ", ".join(f"{s}s: {len(v)}/{max(v) * 1e3:.0f}" for s, v in sorted(per_s.items())))
    pauses = [p for r in results for p in r["gc_pauses"]]
    long_ones = sorted((p for p in pauses if p[2] > 0.02), key=lambda p: p[0])
    print(f"garbage collections in the worker processes: {len(pauses)}, "
          f"{sum(p[2] for p in pauses):.2f} s in all; over 20 ms (after go s, generation, ms): "
          + ", ".join(f"{w:.1f}/{g}/{d * 1e3:.0f}" for w, g, d in long_ones[:20]))
    print(f"\nwhere takes longer than {trace_ms:g} ms were (samples every 10 ms, {total} in all; "
          "innermost frame first):")
    for key, c in sorted(stacks.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {c:6d} ({c / max(1, total):.0%})  {key}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("scale", "tail"):
        p = sub.add_parser(name)
        p.add_argument("--per-proc", type=int, default=250, help="worker threads per process")
        p.add_argument("--pool-size", type=int, default=20,
                       help="PgBouncer's server connections for the database (default_pool_size and "
                            "max_db_connections)")
        p.add_argument("--pg-set", action="append", default=[], metavar="NAME=VALUE",
                       help="a postgresql.conf setting of the throwaway cluster (repeatable)")
        p.add_argument("--json", default=None)
        p.add_argument("--listen-direct", action="store_true",
                       help="$WQ_SQL_LISTEN_URL = the server's direct URL: each worker process's "
                            "doorbell listener bypasses PgBouncer (without it, waits poll)")
        p.add_argument("--trace-slow", type=float, default=0.0, metavar="MS",
                       help="sample the stacks of takes running longer than MS ms, and print where they wait")
    s = sub.choices["scale"]
    s.add_argument("--n", default="100,500,2000")
    s.add_argument("--seconds", type=float, default=20.0)
    s.add_argument("--rate", type=float, default=400.0,
                   help="items/s the N workers ask for together: each item is N * 1000 / rate ms of work, "
                        "so every N offers the same load (0: --item-ms)")
    s.add_argument("--item-ms", type=float, default=0.0, help="with --rate 0: work per item (0: none)")
    s.add_argument("--jitter", type=float, default=0.0,
                   help="each item's work drawn from (1 +- JITTER) x its mean: workers that started together "
                        "drift apart, as real trainers do (0: every item the same, so all N take at once, "
                        "every item)")
    s.add_argument("--items", type=int, default=500_000, help="items of the busy queue (never runs out)")
    s.add_argument("--idle-items", type=int, default=4)
    s.add_argument("--idle-warmup", type=float, default=5.0)
    s.add_argument("--idle-seconds", type=float, default=10.0)
    s.add_argument("--split-cores", action="store_true",
                   help="Postgres and PgBouncer on CPU 0, the worker processes on CPU 1: as if the database "
                        "had a machine of its own (the N = 100 reference runs the same way)")
    s.add_argument("--server-nice", type=int, default=None, metavar="NICE",
                   help="run Postgres and PgBouncer at this nice value (root: -10 puts them ahead of the "
                        "harness's worker processes, as if they had machines of their own)")
    t = sub.choices["tail"]
    t.add_argument("--workers", type=int, default=200)
    t.add_argument("--slow-frac", type=float, default=0.1)
    t.add_argument("--slow-factor", type=float, default=4.0)
    t.add_argument("--fast-ms", type=float, default=500.0)
    t.add_argument("--items-per-worker", type=int, default=50)
    t.add_argument("--claim-ahead", action="store_true",
                   help="workers claim their next item while they work on one (WorkQueue(claim_ahead=True))")
    a = ap.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    print("#", machine(), "rev", git_rev(), flush=True)
    return scale(a) if a.cmd == "scale" else tail(a)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
