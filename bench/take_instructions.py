"""Instructions per item of SQLite's ``take()`` and of the bare claim round it wraps (issue 16):
counts, not times, so a figure holds on a busy machine. Each variant runs under
``valgrind --tool=callgrind`` twice, K items and none (the same start-up), and the difference over
K is printed, with the functions that take the most of it (``--top``).

* ``take``   ``WorkQueue.take()`` in a loop (``lease_ahead`` fixed, no claim-ahead thread);
* ``round``  ``claim.ClaimRound`` in ``BEGIN IMMEDIATE`` / ``COMMIT`` on one ``sqlite3`` connection
             (WAL, ``synchronous=NORMAL``, foreign keys on, no automatic checkpoint: as wq_sql's);
* ``buffered`` a ``take()`` of an item already in the buffer (one round claimed them all before).

System calls and cache misses are not counted: a take's wall time is not proportional. Needs
valgrind (Debian: ``apt-get install valgrind``); ~30 s per run.

    .venv/bin/python bench/take_instructions.py --lease-ahead 1,32
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from wq_sql import WorkQueue
from wq_sql.claim import ClaimRound
from wq_sql.dialects import Dialect


def child(variant: str, n: int, k: int, base: str) -> None:
    """The measured process: open a copy of ``base``, warm up, then ``k`` items of ``variant``."""
    path = f"{base}.{os.getpid()}"
    shutil.copy(base, path)
    if variant == "round":
        conn = sqlite3.connect(path, isolation_level=None)
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "wal_autocheckpoint=0", "foreign_keys=ON"):
            conn.execute(f"PRAGMA {pragma}")
        qid = conn.execute("SELECT id FROM wq_queues").fetchone()[0]
        wid = conn.execute("SELECT id FROM wq_workers").fetchone()[0]
        rnd = ClaimRound(Dialect("sqlite"), n, 60.0)
        acks: list[tuple[int, int]] = []
        for _ in range(2 + k // n):
            conn.execute("BEGIN IMMEDIATE")
            _, got, _ = rnd.run(conn, qid, wid, acks)
            conn.execute("COMMIT")
            acks = [(g.id, g.token) for g in got]
        os._exit(0)
    buffered = variant == "buffered"  # n is then more than k: one round claims every item taken
    wq = WorkQueue.attach("q", url=f"sqlite:///{path}", worker="creator", lease_ahead=n, claim_ahead=False,
                          heartbeat_seconds=3600, lease_seconds=7200)
    for _ in range(1 if buffered else 2 * n):
        wq.take()
    for _ in range(k):
        wq.take()
    os._exit(0)  # no close(): its work is not the loop's


def functions(out: str) -> dict[str, int]:
    """Instructions by function (exclusive) from a callgrind output file."""
    text = subprocess.run(["callgrind_annotate", "--threshold=100", out], capture_output=True, text=True,
                          check=True).stdout
    got: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(\S.*?)(?:\s\[.*)?$", line)
        if m and "PROGRAM TOTALS" not in line:
            name = m.group(2).rsplit(":", 1)[-1]
            got[name] = got.get(name, 0) + int(m.group(1).replace(",", ""))
    return got


def measure(variant: str, n: int, k: int, base: str, tmp: Path) -> dict[str, int]:
    if variant == "buffered":
        n = k + 1
    runs = []
    for count in (0, k):
        out = tmp / f"cg.{variant}.{n}.{count}"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                        "--child", variant, str(n), str(count), base], check=True, capture_output=True)
        runs.append(functions(str(out)))
    return {f: runs[1].get(f, 0) - runs[0].get(f, 0) for f in set(runs[0]) | set(runs[1])}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lease-ahead", default="1,32")
    ap.add_argument("--variants", default="round,take,buffered")
    ap.add_argument("--items", type=int, default=20_000, help="items in the queue")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("needs valgrind: apt-get install valgrind")
    with tempfile.TemporaryDirectory(prefix="wq_take_ir_") as tmp:
        base = str(Path(tmp) / "base.db")
        WorkQueue([f"part-{i:07d}" for i in range(a.items)], num_epochs=1, shuffle=False, seed=1, name="q",
                  url=f"sqlite:///{base}", worker="creator").close()
        print("| variant | lease_ahead | instructions per item | most of it |")
        print("|---|---|---|---|")
        for n in (int(x) for x in a.lease_ahead.split(",")):
            k = 1000 if n == 1 else min(100 * n, a.items // 2)
            for variant in a.variants.split(","):
                if variant == "buffered" and n == 1:
                    continue
                d = measure(variant, n, k, base, Path(tmp))
                top = sorted(d.items(), key=lambda x: -x[1])[:a.top]
                print(f"| {variant} | {n} | {sum(d.values()) / k:,.0f} | "
                      + ", ".join(f"{f} {c / k:,.0f}" for f, c in top) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
