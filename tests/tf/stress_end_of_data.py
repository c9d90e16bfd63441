"""Stress the end of data: two TF worker processes run the simplest pipeline (``tf_worker.py``'s
``tiny`` mode: 6 works, 3 shuffled epochs) on one queue, beside CPU burners, many times over.

    python tests/tf/stress_end_of_data.py --backend postgresql --runs 60 --burners 2

Each run gets its own queue. A run whose workers have not both ended ``--hang`` seconds after
they passed their start barrier (TensorFlow imported) is a hang: every worker's Python stacks
are dumped (``procwatch``), with the queue's rows that are not done, and the script exits 1.
It also checks that the 18 items were printed exactly once between the two workers.
``make stress`` runs it on both backends; ``tests/tf/test_tf_end_of_data.py`` runs a few rounds
in the test suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "support"), str(HERE.parent.parent)]

from procwatch import Hung, burners, run_all  # noqa: E402

WORDS = ["fast", "fox", "jumps", "over", "lazy", "dog"]


def one_run(url: str, workdir: Path, hang: float) -> float:
    """Two workers drain a fresh queue; returns the wall time; raises Hung or AssertionError."""
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    barrier = workdir / name
    barrier.mkdir()
    jobs = [{"mode": "tiny", "url": url, "name": name, "worker": w, "barrier": str(barrier),
             "n_workers": 2} for w in ("w0", "w1")]
    t = time.monotonic()
    try:
        done = run_all([[sys.executable, str(HERE / "tf_worker.py"), json.dumps(j)] for j in jobs],
                       hang=hang, env={"WQ_SQL_TEST_HANG_DUMP": str(10 * hang)},
                       started=lambda: len(list(barrier.glob("ready-*"))) == 2)
    except Hung as e:
        raise Hung(f"queue {name!r}: {e}\n\nitems not done:\n{not_done(url, name)}") from None
    for f in done:
        assert f.returncode == 0, f"worker failed ({f.returncode}):\n{f.stdout}\n{f.stderr[-5000:]}"
    printed = collections.Counter(line for f in done for line in f.stdout.splitlines()
                                  if line in WORDS)
    assert printed == collections.Counter({w: 3 for w in WORDS}), f"not exactly once: {printed}"
    return time.monotonic() - t


def not_done(url: str, name: str) -> str:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            rows = c.execute(sa.text("SELECT epoch, seq, work, state, worker, claimed_at FROM wq_audit "
                                     "WHERE queue = :q AND state <> 'done' ORDER BY epoch, seq"),
                             {"q": name}).all()
            workers = c.execute(sa.text(
                "SELECT w.name, w.heartbeat_at, w.buffered FROM wq_workers w JOIN wq_queues q "
                "ON q.id = w.queue_id WHERE q.name = :q"), {"q": name}).all()
    finally:
        engine.dispose()
    return "\n".join(map(str, rows)) + "\nworkers:\n" + "\n".join(map(str, workers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/postgres",
                    help="an admin URL; the runs use a database of their own")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--hang", type=float, default=60.0, help="seconds after which a run is a hang")
    args = ap.parse_args(argv)
    from backends import drop_pg_database, new_pg_database

    from wq_sql.store.engine import resolve_url

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        db = None
        if args.backend == "sqlite":
            url = f"sqlite:///{workdir / 'stress.db'}"
        else:
            import os

            os.environ["WQ_SQL_TEST_PG"] = args.pg
            db = new_pg_database(None)
            url = resolve_url(args.pg).set(database=db).render_as_string(hide_password=False)
        try:
            times = []
            with burners(args.burners, seconds=args.runs * (args.hang + 30)):
                for i in range(args.runs):
                    times.append(one_run(url, workdir, args.hang))
                    print(f"run {i + 1}/{args.runs}: {times[-1]:.1f}s", flush=True)
        except Hung as e:
            print(f"HANG in run {len(times) + 1}:\n{e}", flush=True)
            return 1
        finally:
            if db is not None:
                drop_pg_database(db)
    print(f"{args.runs} runs on {args.backend} with {args.burners} burner(s), no hang; "
          f"{min(times):.1f}-{max(times):.1f}s per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
