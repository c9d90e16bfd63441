"""Slicing: a few big inputs become many items, so fast workers can still take more of them.

    python examples/sliced_sources.py                      # a throwaway SQLite file
    python examples/sliced_sources.py --url postgresql://user@host/db

One SQL table (``table:<name>``, in the queue's own database) and one text file
(``lines:<path>``), cut into 24 items in all when the queue is created; three worker processes
read the records of the items they take with ``wq.read(item)``. The check at the end compares
the multiset of records read with the table's rows and the file's lines. On a given database
the table and the queue have names of their own and are dropped at the end, also after an error.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import sqlalchemy as sa  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql import WorkQueue  # noqa: E402

N_ROWS, N_LINES = 5_000, 20_000


def worker(url: str, queue: str, works: list[str], name: str, delay: float, out: mp.Queue) -> None:
    seen = []
    with WorkQueue(works, num_slices=24, name=queue, url=url, worker=name) as wq:
        for item in wq:
            records = list(wq.read(item))
            seen.extend(repr(r) for r in records)
            time.sleep(delay)  # "training" on the item
            print(f"{name}: {item} -> {len(records)} records", flush=True)
    out.put((name, seen))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="database URL (default: a SQLite file in a temporary folder)")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="wq_sql_sliced_")
    url = args.url or f"sqlite:///{tmp}/wq.db"
    run = uuid.uuid4().hex[:8]  # names of this run's own, in a database that may be shared
    queue = f"sliced_sources_{run}"
    events = sa.Table(f"events_{run}", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                      sa.Column("kind", sa.Text))
    engine = sa.create_engine(url)
    try:
        with engine.begin() as c:
            events.create(c)
            c.execute(events.insert(), [{"id": i, "kind": f"kind{i % 7}"} for i in range(N_ROWS)])
        path = os.path.join(tmp, "big.txt")
        with open(path, "w") as f:
            f.writelines(f"line {i}\n" for i in range(N_LINES))
        ok = run_workers(url, queue, [f"table:{events.name}", f"lines:{path}"])
    finally:
        wq_sql.drop_queue(queue, url)
        events.drop(engine, checkfirst=True)
        engine.dispose()
        shutil.rmtree(tmp)
    return 0 if ok else 1


def run_workers(url: str, queue: str, works: list[str]) -> bool:
    """Three workers, one of them a straggler; prints what each read and whether every row and
    line was read exactly once."""
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=worker, args=(url, queue, works, f"w{i}", d, out))
             for i, d in enumerate([0.02, 0.02, 0.1])]  # w2 is a straggler
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()

    got = collections.Counter(r for seen in results.values() for r in seen)
    expected = collections.Counter(repr((i, f"kind{i % 7}")) for i in range(N_ROWS))
    expected.update(repr(f"line {i}".encode()) for i in range(N_LINES))
    for name, seen in sorted(results.items()):
        print(f"{name} read {len(seen)} records")
    print(f"every row and line exactly once: {got == expected}")
    return got == expected


if __name__ == "__main__":
    sys.exit(main())
