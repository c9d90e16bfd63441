"""Where the CPU of a ``wq_sql.torch`` DataLoader pass goes, by process and thread, and when each
part happens (issue 18): the DataLoader of ``torch_loader.py throughput`` (``num_workers=2``,
1,000 x 100-record files by default), static and wq_sql alternating in the same run.

    .venv/bin/python bench/torch_threads.py --backend sqlite --runs 5
    .venv/bin/python bench/torch_threads.py --backend postgresql --lines 1000 --runs 3
    .venv/bin/python bench/torch_threads.py --profile /tmp/prof     # + cProfile of the main thread, both sides

Per process (the main one, and each DataLoader worker) the CPU of every thread (``Thread.run``
timed with ``time.thread_time``, and the threads alive at both ends by
``/proc/self/task/<tid>/schedstat``), so a figure is the thread's own CPU whatever the load;
minor page faults; and, on one time line (``time.monotonic``, common to the processes),
milliseconds from ``iter(loader)`` to: each worker's start and its first and last record, the
main process's first and last batch, and the end of the pass. Medians over the runs.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import multiprocessing.util
import os
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_ADMIN, git_rev, machine, scratch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch_loader import StaticFiles, lease_ahead, read_lines, write_files  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql.torch import DataLoader, QueueDataset  # noqa: E402

_ended: dict[str, list[float]] = {}  # thread kind -> [CPU, run-queue wait] seconds of ended threads
_lock = threading.Lock()
_gc: dict[str, float] = {}  # "gc gen<N>" -> seconds of this process's collections (gc.callbacks)
_gc_at: list[float] = [0.0]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc_at[0] = time.thread_time()
    else:
        k = f"(gc gen{info['generation']}, ms / count)"
        _gc[k] = _gc.get(k, 0.0) + time.thread_time() - _gc_at[0]
        _gc[k + "#"] = _gc.get(k + "#", 0.0) + 1


def _count_rounds() -> None:
    """Count this process's claim rounds: how many, the items they claimed, their thread CPU."""
    from wq_sql import handout

    claim = handout.Dispenser._claim

    def counted(self: Any, acks: Any, limit: int) -> int:
        c = time.thread_time()
        n = claim(self, acks, limit)
        with _lock:
            for k, v in (("(claim rounds #)", 1), ("(claim rounds: items #)", n),
                         ("(claim rounds: acks #)", len(acks)),
                         ("(claim rounds, ms)", (time.thread_time() - c))):
                _gc[k] = _gc.get(k, 0.0) + v
        return n

    handout.Dispenser._claim = counted  # type: ignore[method-assign]

    from wq_sql.torch import handoff

    flush = handoff.Acks.flush

    def timed_flush(self: Any) -> None:
        t = time.monotonic()
        _main_marks["flush start"] = t
        try:
            flush(self)
        finally:
            _main_marks["flush end"] = time.monotonic()

    handoff.Acks.flush = timed_flush  # type: ignore[method-assign]


_main_marks: dict[str, float] = {}


def _kind(name: str) -> str:
    """A thread's name without what differs per object or per thread (queue name, counter)."""
    for prefix in ("wq_sql-refill", "wq_sql-next-epoch", "wq_sql-heartbeat", "wq_sql-acks", "wq_sql-bell",
                   "QueueFeederThread", "Thread"):
        if name.startswith(prefix):
            return prefix
    return name


def _schedstat(tid: Any) -> tuple[float, float]:
    """(CPU, run-queue wait) seconds of thread ``tid`` of this process so far."""
    run, wait = Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[:2]
    return int(run) / 1e9, int(wait) / 1e9


def _timed_run(run: Callable[[threading.Thread], None]) -> Callable[[threading.Thread], None]:
    def timed(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            cpu, wait = _schedstat(threading.get_native_id())
            with _lock:
                e = _ended.setdefault(_kind(self.name), [0.0, 0.0])
                e[0] += cpu
                e[1] += wait
    return timed


def _live() -> dict[int, tuple[str, float, float]]:
    """Native thread id -> (kind, CPU, run-queue wait seconds so far) of the live Python threads."""
    out = {}
    for t in threading.enumerate():
        try:
            cpu, wait = _schedstat(t.native_id)
        except (OSError, TypeError):
            continue
        out[t.native_id] = (_kind(t.name) if t is not threading.main_thread() else "main", cpu, wait)
    return out


class Cpu:
    """Thread CPU (and run-queue wait) of this process between :meth:`start` and :meth:`stop`."""

    def start(self) -> None:
        with _lock:
            self.ended0 = {k: list(v) for k, v in _ended.items()}
            self.gc0 = dict(_gc)
        self.live0 = _live()
        self.r0 = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self) -> dict[str, float]:
        live = _live()
        r = resource.getrusage(resource.RUSAGE_SELF)
        with _lock:
            ended = {k: list(v) for k, v in _ended.items()}
            gcs = dict(_gc)
        out: dict[str, float] = {}

        def add(k: str, cpu: float, wait: float) -> None:
            out[k] = out.get(k, 0.0) + cpu * 1000
            out[k + " (run-queue wait)"] = out.get(k + " (run-queue wait)", 0.0) + wait * 1000

        for k, (c, w) in ended.items():
            c0, w0 = self.ended0.get(k, [0.0, 0.0])
            add(k, c - c0, w - w0)
        for tid, (k, c, w) in live.items():
            _, c0, w0 = self.live0.get(tid, (k, 0.0, 0.0))
            add(k, c - c0, w - w0)
        # Threads alive at the start that ended meanwhile were counted whole by _ended.
        for tid, (k, c, w) in self.live0.items():
            if tid not in live:
                add(k, -c, -w)
        for k, v in gcs.items():
            out[k] = (v - self.gc0.get(k, 0.0)) * (1 if k.endswith("#") or k.endswith("#)") else 1000)
        out["(process, getrusage)"] = (r.ru_utime + r.ru_stime - self.r0.ru_utime - self.r0.ru_stime) * 1000
        out["(minor faults)"] = r.ru_minflt - self.r0.ru_minflt
        return out


def worker_init(out: Path, tag: list[str], profile: bool) -> Callable[[int], None]:
    """A ``worker_init_fn``: the worker's thread CPU and marks, written at its exit (after the
    shim's own exit hook, which leaves the queue: ``Finalize`` priorities run high to low)."""
    def init(k: int) -> None:
        cpu = Cpu()
        cpu.start()
        marks = {"start": time.monotonic()}
        _marks.clear()
        name = f"{tag[0]}-{k}-{os.getpid()}"
        prof = cProfile.Profile(time.thread_time) if profile else None
        if prof is not None:
            prof.enable()

        def dump() -> None:
            if prof is not None:
                prof.disable()
                prof.dump_stats(out / f"{name}.prof")
            record = {"tag": tag[0], "cpu": cpu.stop(), "marks": {**marks, **_marks, "exit": time.monotonic()}}
            (out / f"{name}.json").write_text(json.dumps(record))

        multiprocessing.util.Finalize(None, dump, exitpriority=1)
    return init


_marks: dict[str, float] = {}


def marked(records: Iterator[Any]) -> Iterator[Any]:
    first = True
    for r in records:
        if first:
            _marks["first record"] = time.monotonic()
            first = False
        yield r
    _marks["last record"] = time.monotonic()


class MarkedStatic(StaticFiles):
    def __iter__(self) -> Any:
        return marked(super().__iter__())


class MarkedQueue(QueueDataset):
    def __iter__(self) -> Any:
        return marked(super().__iter__())


def one_pass(loader: Any, expect: int, prof: Any) -> dict[str, Any]:
    cpu = Cpu()
    cpu.start()
    t0 = time.monotonic()
    if prof is not None:
        prof.enable()
    n, first = 0, None
    for batch in loader:
        first = first or time.monotonic()
        n += len(batch)
    last = time.monotonic()
    del loader  # its workers are joined at the pass end already
    if prof is not None:
        prof.disable()
    assert n == expect, (n, expect)
    marks = {k: v for k, v in _main_marks.items() if v >= t0}
    _main_marks.clear()
    return {"t0": t0, "first batch": first, "last batch": last, "cpu": cpu.stop(), **marks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--lease-ahead", type=lease_ahead, default=None, help="a number, or auto (the default)")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile of the main thread: DIR/static.prof, DIR/wq_sql.prof")
    a = ap.parse_args()
    threading.Thread.run = _timed_run(threading.Thread.run)  # type: ignore[method-assign]
    gc.callbacks.append(_on_gc)
    _count_rounds()
    info = machine()
    print(f"machine: {info['nproc']} cpus, load {info['load1']}, commit {git_rev()}, backend {a.backend}, "
          f"{a.files} x {a.lines} records, lease_ahead={a.lease_ahead or 'auto'}, {a.runs} runs")
    out = Path(tempfile.mkdtemp(prefix="wq_torch_threads_"))
    tag = ["static"]
    files = write_files(Path(tempfile.gettempdir(), f"wq_bench_torch_{a.files}x{a.lines}"), a.files, a.lines)
    args: dict[str, Any] = {"batch_size": 256, "num_workers": 2, "worker_init_fn": worker_init(out, tag, a.profile is not None)}
    profs = {k: cProfile.Profile(time.thread_time) if a.profile else None for k in ("static", "wq_sql")}
    mains: dict[str, list[dict[str, Any]]] = {"static": [], "wq_sql": []}
    expect = a.files * a.lines
    with scratch(a.backend, a.pg, "torchth") as url:
        for run in range(a.runs):
            tag[0] = "static"
            mains["static"].append({**one_pass(TorchLoader(MarkedStatic(files), **args), expect, profs["static"]),
                                    "run": run})
            name = f"th_{uuid.uuid4().hex[:8]}"
            ds = MarkedQueue(files, name=name, url=url, read=read_lines, lease_ahead=a.lease_ahead, worker="bench")
            tag[0] = "wq_sql"
            mains["wq_sql"].append({**one_pass(DataLoader(ds, **args), expect, profs["wq_sql"]), "run": run})
            ds.close()
            wq_sql.drop_queue(name, url)
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
        for k, prof in profs.items():
            prof.dump_stats(a.profile / f"{k}.prof")
    workers = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if a.profile:
        for k in ("static", "wq_sql"):
            pstats.Stats(*map(str, out.glob(f"{k}-*.prof"))).dump_stats(a.profile / f"{k}-workers.prof")
    report(mains, workers)


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def report(mains: dict[str, list[dict[str, Any]]], workers: list[dict[str, Any]]) -> None:
    kinds = ["static", "wq_sql"]
    print("\nwall, ms (medians):            " + "  ".join(f"{k:>10}" for k in kinds))
    for label in ("first batch", "flush start", "flush end", "last batch"):
        print(f"  {label:28s}" + "  ".join(f"{_med([m[label] - m['t0'] for m in mains[k] if label in m]) * 1000:10.1f}"
                                           for k in kinds))
    for label in ("start", "first record", "last record", "exit"):
        vals = []
        for k in kinds:
            t0 = {m["run"]: m["t0"] for m in mains[k]}
            ws = [w for w in workers if w["tag"] == k]
            # a worker's run: the pass whose t0 is the latest before its start
            xs = []
            for w in ws:
                if label not in w["marks"]:
                    continue
                start = w["marks"]["start"]
                base = max((t for t in t0.values() if t <= start), default=None)
                if base is not None:
                    xs.append((w["marks"][label] - base) * 1000)
            vals.append(_med(xs))
        print(f"  worker {label:21s}" + "  ".join(f"{v:10.1f}" for v in vals))
    print("\nCPU ms per process and thread (medians; workers: per worker process):")
    for where in ("main process", "each worker"):
        rows: dict[str, list[list[float]]] = {}
        for i, k in enumerate(kinds):
            samples = [m["cpu"] for m in mains[k]] if where == "main process" else \
                [w["cpu"] for w in workers if w["tag"] == k]
            names = sorted({n for s in samples for n in s})
            for n in names:
                rows.setdefault(n, [[], []])[i] = [s.get(n, 0.0) for s in samples]
        print(f"  {where}:")
        for n, (s, q) in sorted(rows.items(), key=lambda x: -_med(x[1][1])):
            print(f"    {n:28s} {_med(s):10.1f} {_med(q):10.1f}   {_med(q) - _med(s):+8.1f}")


if __name__ == "__main__":
    main()
