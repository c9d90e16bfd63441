"""The long tail, and how a shared work queue removes it.

Several worker processes of different speeds (one or two stragglers several times slower; an
item costs a sleep) each run a plain ``WorkQueue(...)`` loop over the same works, with
``claim_ahead=True`` (the next item is claimed while the current one is worked on: the setting
for items that take milliseconds or more, see BENCHMARKS.md section 4). Fast workers take more
items, so the job ends close to the ideal bound instead of waiting for the slowest worker's
fixed shard, as static sharding (``works[i::n]``, what ``dataset.shard`` does) would.

Afterwards it reads, with plain SQL:
  * items done per worker and epoch, from the ``wq_audit`` view;
  * the measured makespan (first claim to last done), next to static sharding and the ideal
    bound, both computed from the workers' speeds;
  * a check that every (epoch, seq) was done exactly once (``wq_audit`` and ``wq_history``),
    compared with what the workers themselves logged.

Run ``make demo`` (or ``python examples/long_tail_demo.py``): it replaces ./long_tail_demo.db.
``--url postgresql://...`` runs it on PostgreSQL instead (the queue ``long_tail_demo`` there is
dropped and recreated). Exits non-zero if the exactly-once check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Optional

QUEUE = "long_tail_demo"
DEFAULT_DB = "long_tail_demo.db"
SEED = 2024
# --quick (for tests): a few seconds on a loaded machine. Explicit flags still win.
QUICK = {"workers": 4, "stragglers": 1, "items": 24, "epochs": 2, "fast_ms": 15.0, "slow_factor": 5.0}
NORMAL = {"workers": 6, "stragglers": 2, "items": 80, "epochs": 2, "fast_ms": 40.0, "slow_factor": 5.0}


def works(n: int) -> list[str]:
    return [f"part-{i:05d}.parquet" for i in range(n)]


def worker(name: str, ms: float, url: str, n_items: int, epochs: int, ready: Any, go: Any,
           out: Any) -> None:
    """One worker process: every worker constructs the same queue; the first one creates it."""
    from wq_sql import WorkQueue

    got = []
    with WorkQueue(works(n_items), num_epochs=epochs, seed=SEED, name=QUEUE, url=url, worker=name,
                   claim_ahead=True) as wq:
        ready.put(name)
        go.wait()  # start together, so that start-up time does not decide who takes more
        for item in wq:
            time.sleep(ms / 1000.0)  # the work
            got.append((item.epoch, item.seq))
    out.put((name, got))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help=f"database URL (default: a fresh sqlite:///{DEFAULT_DB} here)")
    p.add_argument("--workers", type=int, help=f"worker processes (default {NORMAL['workers']})")
    p.add_argument("--stragglers", type=int, help=f"how many are slow (default {NORMAL['stragglers']})")
    p.add_argument("--items", type=int, help=f"items per epoch (default {NORMAL['items']})")
    p.add_argument("--epochs", type=int, help=f"epochs (default {NORMAL['epochs']})")
    p.add_argument("--fast-ms", type=float, help=f"ms per item, fast worker (default {NORMAL['fast_ms']:g})")
    p.add_argument("--slow-factor", type=float,
                   help=f"a straggler is this many times slower (default {NORMAL['slow_factor']:g})")
    p.add_argument("--quick", action="store_true", help="a smaller run, for tests")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else NORMAL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.workers < 2:
        p.error("--workers must be at least 2")
    if not 1 <= args.stragglers < args.workers:
        p.error("--stragglers must be at least 1 and fewer than --workers")
    if args.items < args.workers or args.epochs < 1:
        p.error("--items must be at least --workers, --epochs at least 1")
    if args.fast_ms <= 0 or args.slow_factor < 1:
        p.error("--fast-ms must be positive, --slow-factor at least 1")
    return args


def prepare(url: Optional[str]) -> str:
    """A database with the schema and without the demo queue; returns its URL."""
    import wq_sql

    if url is None:
        for suffix in ("", "-wal", "-shm"):
            Path(DEFAULT_DB + suffix).unlink(missing_ok=True)
        url = f"sqlite:///{DEFAULT_DB}"
    wq_sql.upgrade(url)
    wq_sql.drop_queue(QUEUE, url)
    return url


def run_workers(url: str, speeds: dict[str, float], n_items: int, epochs: int) -> dict[str, list[Any]]:
    """Start one process per worker, release them together, return what each one logged."""
    ctx = mp.get_context()
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(name, ms, url, n_items, epochs, ready, go, out), name=name)
             for name, ms in speeds.items()]
    for p in procs:
        p.start()
    logs: dict[str, list[Any]] = {}
    try:
        for _ in procs:
            _get(ready, procs, "start")
        go.set()
        for _ in procs:
            name, got = _get(out, procs, "finish")
            logs[name] = got
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return logs


def _get(q: Any, procs: list[Any], what: str) -> Any:
    import queue

    deadline = time.monotonic() + 120
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"worker {dead[0].name} failed (exit code {dead[0].exitcode}) "
                                 f"before it could {what}; see its traceback above") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"workers did not {what} within 120 s") from None


def _ts(value: Any) -> dt.datetime:
    """A timestamp from a view: a datetime on Postgres, text on SQLite."""
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value.replace(tzinfo=None) if value.tzinfo is None else value.astimezone(dt.timezone.utc)


def report(url: str, speeds: dict[str, float], n_items: int, epochs: int,
           logs: dict[str, list[Any]], wall: float) -> bool:
    from sqlalchemy import create_engine, text

    from wq_sql.store.engine import resolve_url

    names = list(speeds)
    n = len(names)
    total = n_items * epochs
    engine = create_engine(resolve_url(url))
    with engine.connect() as c:
        per = c.execute(text(
            "SELECT worker, epoch, count(*) FROM wq_audit WHERE queue = :q AND state = 'done' "
            "GROUP BY worker, epoch"), {"q": QUEUE}).all()
        first, last = c.execute(text(
            "SELECT min(claimed_at), max(done_at) FROM wq_audit WHERE queue = :q"), {"q": QUEUE}).one()
        items, done = c.execute(text(
            "SELECT count(*), sum(CASE WHEN state = 'done' THEN 1 ELSE 0 END) FROM wq_audit "
            "WHERE queue = :q"), {"q": QUEUE}).one()
        pairs, once = c.execute(text(
            "SELECT count(*), sum(CASE WHEN n = 1 THEN 1 ELSE 0 END) FROM ("
            " SELECT epoch, seq, count(*) AS n FROM wq_history WHERE queue = :q AND kind = 'done'"
            " GROUP BY epoch, seq) AS d"), {"q": QUEUE}).one()
    engine.dispose()

    counts = {(w, e): k for w, e, k in per}
    shard = [len(range(i, n_items, n)) * epochs for i in range(n)]  # works[i::n], every epoch
    print(f"items done per worker and epoch (SELECT worker, epoch, count(*) FROM wq_audit\n"
          f"  WHERE queue = '{QUEUE}' AND state = 'done' GROUP BY worker, epoch):")
    header = f"  {'worker':<8} {'ms/item':>7}" + "".join(f" {'epoch ' + str(e):>8}" for e in range(epochs))
    print(header + f" {'total':>6} {'static shard':>13}")
    for i, w in enumerate(names):
        row = [counts.get((w, e), 0) for e in range(epochs)]
        cells = "".join(f" {k:>8}" for k in row)
        print(f"  {w:<8} {speeds[w]:>7g}{cells} {sum(row):>6} {shard[i]:>13}")

    measured = (_ts(last) - _ts(first)).total_seconds()
    static = max(k * speeds[w] for k, w in zip(shard, names)) / 1000.0
    ideal = total / sum(1000.0 / ms for ms in speeds.values())
    rows = [("work queue (measured: first claim to last done)", measured),
            (f"static sharding, works[i::{n}] (computed)", static),
            ("ideal: total work / total speed (computed)", ideal)]
    width = max(len(label) for label, _ in rows)
    print(f"\n  {'makespan':<{width}}  seconds")
    for label, seconds in rows:
        print(f"  {label:<{width}}  {seconds:7.2f}")

    took = {w: sum(counts.get((w, e), 0) for e in range(epochs)) for w in names}
    fast = [took[w] for w in names if w.startswith("fast")]
    slow = [took[w] for w in names if w.startswith("slow")]
    more = min(fast) > max(slow)
    print(f"\nfast workers took {_span(fast)} items each, stragglers {_span(slow)}: "
          f"fast workers took more: {'yes' if more else 'NO'}")
    print(f"the work queue finished {static / measured:.1f}x sooner than static sharding, "
          f"within {measured / ideal:.2f}x of the ideal")

    logged = sorted(pair for got in logs.values() for pair in got)
    expected = [(e, s) for e in range(epochs) for s in range(n_items)]
    ok = items == total and done == total and pairs == total and once == total and logged == expected
    print(f"\nexactly once: {'OK' if ok else 'FAILED'}")
    print(f"  wq_history: {once} of {total} (epoch, seq) have exactly one 'done' event"
          + (f", {pairs - once} more than one" if pairs != once else ""))
    print(f"  wq_audit:   {done} of {items} items are done; the workers' own logs "
          f"{'agree' if logged == expected else 'DISAGREE'} ({len(logged)} items received)")
    cli, shown = _cli(), shlex.quote(_shown(url))
    print(f"\n{n} processes, {wall:.1f} s wall clock including start-up. Look closer with:\n"
          f"  {cli} status {QUEUE} --url {shown}\n"
          f"  {cli} report {QUEUE} --url {shown} --out {QUEUE}.html")
    return ok


def _cli() -> str:
    """The ``wq-sql`` command of the Python running this demo, as a path that works from here
    (``.venv/bin/wq-sql`` after ``make demo``): it runs as printed, with no venv activated."""
    bindir = Path(sys.executable).parent
    script = bindir / "wq-sql"
    if not script.exists():  # not installed as a script (Windows, a checkout on PYTHONPATH)
        return f"{_here(Path(sys.executable))} -m wq_sql"
    return _here(script)


def _here(path: Path) -> str:
    """``path`` relative to the current folder when it is inside it, else absolute; quoted for a shell."""
    try:
        rel = path.relative_to(Path.cwd())
    except ValueError:
        return shlex.quote(str(path))
    # Never a bare name, which the shell would look up in $PATH.
    return shlex.quote(str(rel) if rel.parent != Path(".") else f"./{rel}")


def _span(values: list[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def _shown(url: str) -> str:
    """The URL as given, its password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    url = prepare(args.url)
    slow_ms = args.fast_ms * args.slow_factor
    n_fast = args.workers - args.stragglers
    speeds = {f"fast-{i}": args.fast_ms for i in range(n_fast)}
    speeds.update({f"slow-{i}": slow_ms for i in range(n_fast, args.workers)})
    print(f"{args.workers} worker processes drain {args.epochs} epochs of {args.items} items from "
          f"{_shown(url)}:\n  {n_fast} fast ({args.fast_ms:g} ms per item), {args.stragglers} "
          f"straggler{'s' if args.stragglers > 1 else ''} ({slow_ms:g} ms per item)\n")
    t0 = time.monotonic()
    logs = run_workers(url, speeds, args.items, args.epochs)
    wall = time.monotonic() - t0
    return 0 if report(url, speeds, args.items, args.epochs, logs, wall) else 1


if __name__ == "__main__":
    sys.exit(main())
