"""Slicing: a few big inputs become many items, so fast workers can still take more of them.

    python examples/sliced_sources.py

One SQL table (``table:events``, in the queue's own database) and one text file
(``lines:<path>``), cut into 24 items in all when the queue is created; three worker processes
read the records of the items they take with ``wq.read(item)``. The check at the end compares
the multiset of records read with the table's rows and the file's lines.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import shutil
import sqlite3
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from wq_sql import WorkQueue  # noqa: E402

N_ROWS, N_LINES = 5_000, 20_000


def worker(url: str, works: list[str], name: str, delay: float, out: mp.Queue) -> None:
    seen = []
    with WorkQueue(works, num_slices=24, url=url, worker=name) as wq:
        for item in wq:
            records = list(wq.read(item))
            seen.extend(repr(r) for r in records)
            time.sleep(delay)  # "training" on the item
            print(f"{name}: {item} -> {len(records)} records", flush=True)
    out.put((name, seen))


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="wq_sql_sliced_")
    url = f"sqlite:///{tmp}/wq.db"
    with sqlite3.connect(f"{tmp}/wq.db") as db:
        db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY, kind TEXT)")
        db.executemany("INSERT INTO events VALUES (?, ?)", [(i, f"kind{i % 7}") for i in range(N_ROWS)])
    path = os.path.join(tmp, "big.txt")
    with open(path, "w") as f:
        f.writelines(f"line {i}\n" for i in range(N_LINES))
    works = ["table:events", f"lines:{path}"]

    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=worker, args=(url, works, f"w{i}", d, out))
             for i, d in enumerate([0.02, 0.02, 0.1])]  # w2 is a straggler
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join()

    got = collections.Counter(r for seen in results.values() for r in seen)
    expected = collections.Counter(repr((i, f"kind{i % 7}")) for i in range(N_ROWS))
    expected.update(repr(f"line {i}".encode()) for i in range(N_LINES))
    for name, seen in sorted(results.items()):
        print(f"{name} read {len(seen)} records")
    print(f"every row and line exactly once: {got == expected}")
    shutil.rmtree(tmp)
    if got != expected:
        sys.exit(1)


if __name__ == "__main__":
    main()
