"""Where the time of ``TextLineDataset(wq.input_dataset())`` goes, run by run (issue 16's TF gap).

    .venv/bin/python bench/tf_probe.py --runs 15                  # SQLite, 1,000 x 100-line files
    .venv/bin/python bench/tf_probe.py --lines 1000 --runs 15 --url postgresql://...

Alternates plain ``TextLineDataset(files).batch(256)`` and the wq_sql pipeline (default settings)
as ``bench/tf_textline.py`` does, and prints each run's seconds with, for wq_sql: claim rounds
(in the pipeline's thread / the refill thread), their sizes, the hand-outs (``_next_many`` calls)
and the time the pipeline's thread spent inside them, and the process' CPU (user + system) over
the run. ``--no-autotune`` turns tf.data's autotuner off on both sides. Instruments by wrapping
methods of the tree it runs from; the wrapping adds ~1 us per round or hand-out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tensorflow as tf  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql import handout  # noqa: E402
from wq_sql import tf as wq_tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tf_textline import write_files  # noqa: E402

STATS: dict[str, Any] = {}


def reset() -> None:
    STATS.update(round_cpu=0.0, trace=[], rounds_fg=0, rounds_bg=0, sizes=[], calls=0, call_s=0.0, items=0, sizer=[])


_claim = handout.Dispenser._claim


def claim(self: Any, acks: Any, limit: int) -> int:
    t, c = time.perf_counter(), time.thread_time()
    n = _claim(self, acks, limit)
    c = time.thread_time() - c
    STATS["round_cpu"] = STATS.get("round_cpu", 0.0) + c
    STATS.setdefault("trace", []).append(("round", t, time.perf_counter() - t, threading.current_thread().name[:10],
                                          f"limit {limit} got {n} acks {len(acks)} cpu {c * 1e3:.2f} ms"))
    if limit:
        bg = threading.current_thread().name.startswith("wq_sql-refill")
        STATS["rounds_bg" if bg else "rounds_fg"] += 1
        STATS["sizes"].append(n)
    return n


handout.Dispenser._claim = claim  # type: ignore[method-assign]
_next_many = wq_tf.WorkQueue._next_many


def next_many(self: Any) -> Any:
    t = time.perf_counter()
    buffered = len(self.queue._d.book.buffer)
    got = _next_many(self)
    STATS.setdefault("trace", []).append(("call", t, time.perf_counter() - t, "pipeline",
                                          f"buffered {buffered} got {len(got)} size {self.queue.lease_ahead}"))
    STATS["call_s"] += time.perf_counter() - t
    STATS["calls"] += 1
    STATS["items"] += len(got)
    STATS["sizer"].append(self.queue.lease_ahead)
    return got


wq_tf.WorkQueue._next_many = next_many  # type: ignore[method-assign]


def threads_cpu() -> dict[str, float]:
    """Seconds on CPU per thread of this process (schedstat), keyed by Python thread name or
    the kernel's thread name, threads of one name summed."""
    py = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/schedstat").read().split()
            ns, waited = int(fields[0]), int(fields[1])
            name = py.get(int(tid)) or open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:
            continue
        name = name.split("-")[0] if name.startswith("wq_sql") else name
        out[name] = out.get(name, 0.0) + ns / 1e9
        key = "runqueue wait " + ("Dummy" if name.startswith("Dummy") else name)
        out[key] = out.get(key, 0.0) + waited / 1e9
    return out


PG_DB: list[str] = []  # the Postgres database whose server processes' CPU is counted


def server_cpu() -> float:
    """Seconds on CPU of the server processes connected to PG_DB (schedstat; 0 on SQLite)."""
    if not PG_DB:
        return 0.0
    import psycopg2
    with psycopg2.connect(PG_DB[0]) as conn, conn.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()")
        pids = [r[0] for r in cur.fetchall()]
    conn.close()
    total = 0.0
    for pid in pids:
        try:
            total += int(open(f"/proc/{pid}/schedstat").read().split()[0]) / 1e9
        except OSError:
            pass
    return total


def consume(ds: tf.data.Dataset, autotune: bool) -> tuple[int, float, float]:
    if not autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    c0 = sum(os.times()[:2])
    t0 = threads_cpu()
    s0 = server_cpu()
    start = time.perf_counter()
    STATS["start"] = start
    n = 0
    ts = []
    it = iter(ds)
    for batch in it:
        n += int(batch.shape[0])
        ts.append(time.perf_counter())
    end = time.perf_counter()
    t1 = threads_cpu()
    if PG_DB:
        t1["server"] = t0.get("server", 0.0) + server_cpu() - s0
    del it
    STATS["teardown"] = time.perf_counter() - end
    STATS["threads"] = {k: v - t0.get(k, 0.0) for k, v in t1.items() if v - t0.get(k, 0.0) > 0.002}
    gaps = [b - a for a, b in zip([start] + ts[:-1], ts)]
    i = max(range(len(gaps)), key=gaps.__getitem__)
    windows = [0] * (int((end - start) / 0.1) + 1)
    for t in ts:
        windows[int((t - start) / 0.1)] += 1
    late = [g for g in gaps[1:] if g > 0.001]
    for k in range(1, len(gaps)):
        if gaps[k] > 0.001:
            STATS.setdefault("trace", []).append(("GAP", ts[k] - gaps[k], gaps[k], "consumer", f"batch {k}"))
    STATS["timeline"] = (f"first batch {gaps[0] * 1e3:.1f} ms, gaps > 1 ms after it: {len(late)} summing "
                         f"{sum(late) * 1e3:.1f} ms (> 3 ms: {sum(g > 0.003 for g in late)}), "
                         f"maxgap {gaps[i] * 1e3:.1f} ms to {ts[i] - start:.3f}s, batches per 0.1 s: "
                         + " ".join(map(str, windows)))
    return n, end - start, sum(os.times()[:2]) - c0


def fmt(threads: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--trace", action="store_true", help="print every hand-out and round of wq_sql runs")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval(S) first (Python's default 0.005): how much the GIL's hand-off matters")
    ap.add_argument("--refill-nice", type=int, default=None,
                    help="experiment: the refill thread at this nice value (Linux, per thread)")
    ap.add_argument("--only", choices=["plain", "wq"], default=None)
    args = ap.parse_args()
    autotune = not args.no_autotune
    if args.refill_nice is not None:
        from wq_sql import pacer
        loop = pacer._loop

        def niced(*a: Any) -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.refill_nice)
            loop(*a)
        pacer._loop = niced  # type: ignore[assignment]
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    with tempfile.TemporaryDirectory(prefix="wq_sql_probe_tf_") as tmp:
        paths = write_files(Path(tmp), args.files, args.lines)
        url = args.url or f"sqlite:///{tmp}/wq.db"
        if url.startswith("postgresql"):
            PG_DB.append(url.replace("postgresql+psycopg2", "postgresql"))
        print(f"load {os.getloadavg()[0]:.2f}, {url.split(':')[0]}, {args.files} x {args.lines}, "
              f"autotune {'on' if autotune else 'off'}", flush=True)
        consume(tf.data.TextLineDataset(paths).batch(args.batch), autotune)
        plain: list[float] = []
        ours: list[float] = []
        for i in range(args.runs + 1):
            if args.only != "wq":
                n, s, cpu = consume(tf.data.TextLineDataset(paths).batch(args.batch), autotune)
                if i:
                    plain.append(s)
                    print(f"plain {s:.3f}s cpu {cpu:.3f}s teardown {STATS['teardown'] * 1e3:.0f} ms "
                          f"{STATS.get('timeline')}\n      threads {fmt(STATS['threads'])}", flush=True)
            if args.only == "plain":
                continue
            name = f"probe_{uuid.uuid4().hex[:8]}"
            wq = wq_tf.WorkQueue(paths, shuffle=False, name=name, url=url, worker="probe")
            reset()
            try:
                n, s, cpu = consume(tf.data.TextLineDataset(wq.input_dataset()).batch(args.batch), autotune)
            finally:
                wq.close()
                wq_sql.drop_queue(name, url)
            assert n == args.files * args.lines, n
            if i:
                ours.append(s)
                sz = STATS["sizes"]
                print(f"wq    {s:.3f}s cpu {cpu:.3f}s rounds fg {STATS['rounds_fg']} bg {STATS['rounds_bg']} "
                      f"sizes {sz[:12]}{'...' if len(sz) > 12 else ''} calls {STATS['calls']} "
                      f"in-calls {STATS['call_s'] * 1e3:.1f} ms rounds' cpu {STATS['round_cpu'] * 1e3:.1f} ms lease {STATS['sizer'][:10]}..{STATS['sizer'][-1:]}"
                      f" load {os.getloadavg()[0]:.2f} teardown {STATS['teardown'] * 1e3:.0f} ms\n"
                      f"      {STATS.get('timeline')}\n      threads {fmt(STATS['threads'])}", flush=True)
                if args.trace:
                    for kind, t, d, who, what in sorted(STATS["trace"], key=lambda e: e[1]):
                        print(f"        {(t - STATS['start']) * 1e3:8.2f} ms {kind:5s} {d * 1e3:6.2f} ms {who:10s} {what}")
        for label, xs in (("plain", plain), ("wq", ours)):
            if xs:
                print(f"{label}: median {statistics.median(xs):.3f} min {min(xs):.3f} max {max(xs):.3f} "
                      f"sorted {' '.join(f'{x:.2f}' for x in sorted(xs))}")
        if plain and ours:
            print(f"ratio {statistics.median(plain) / statistics.median(ours):.2f}x "
                  f"best {min(plain) / min(ours):.2f}x load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
