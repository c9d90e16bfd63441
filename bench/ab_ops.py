"""Same-run A/B of two versions of ``wq_sql/ops.py`` on SQLite: the SQLite claim round
(``ClaimRound``, in ``wq_sql/claim.py`` since the structure step: pass that file's older version
as ``--claim``) and the bulk insert of queue creation (``_insert_chunked``), swapped in one process.

    git show 039d4dd:wq_sql/ops.py > /tmp/ops_before.py
    .venv/bin/python bench/ab_ops.py /tmp/ops_before.py

One process, 1.5 s of ``take()`` per measurement on a 1M-item queue (lease-ahead 1 and 32), and
the creation of a 200k-work queue; before/after alternate, medians of ``--repeats``.

Both versions must take the same connection in ``ClaimRound.run``: before commit "Claim round on the
driver's connection" it was a SQLAlchemy ``Connection``, since then the driver's own connection.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import scratch  # noqa: E402

import wq_sql  # noqa: E402
import wq_sql.claim as new_claim  # noqa: E402
import wq_sql.ops as new_ops  # noqa: E402
from wq_sql import WorkQueue  # noqa: E402


def _load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="path of the older ops.py")
    ap.add_argument("--claim", help="path of the older claim.py (where ClaimRound lives since the "
                                    "structure step); default: ClaimRound of the older ops.py")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    old = _load("ops_before", a.before)
    old_round = _load("claim_before", a.claim).ClaimRound if a.claim else old.ClaimRound
    rounds = {"before": old_round, "after": new_claim.ClaimRound}
    inserts = {"before": old._insert_chunked, "after": new_ops._insert_chunked}
    res: dict[tuple[str, str], list[float]] = {}
    with scratch("sqlite", tag="ab") as url:
        WorkQueue([f"p{i:07d}" for i in range(1_000_000)], shuffle=False, url=url, worker="c").close()
        for rep in range(a.repeats):
            for la in (1, 32):
                for v in (("before", "after") if rep % 2 == 0 else ("after", "before")):
                    new_claim.ClaimRound = rounds[v]  # type: ignore[misc]
                    wq = WorkQueue.attach(url=url, worker=f"{v}{la}-{rep}", lease_ahead=la)
                    n, t = 0, time.perf_counter()
                    while time.perf_counter() - t < 1.5:
                        wq.take()
                        n += 1
                    res.setdefault((f"take lease_ahead={la}", v), []).append(n / (time.perf_counter() - t))
                    wq.close()
    new_claim.ClaimRound = rounds["after"]  # type: ignore[misc]
    works = [f"s3://bucket/dataset/part-{i:07d}.parquet" for i in range(200_000)]
    for rep in range(a.repeats):
        for v in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            new_ops._insert_chunked = inserts[v]
            with scratch("sqlite", tag="abc") as url:
                wq_sql.upgrade(url)
                t = time.perf_counter()
                WorkQueue(works, num_epochs=2, seed=7, url=url, worker="c").close()
                res.setdefault(("create 200k works, seconds", v), []).append(time.perf_counter() - t)
    new_ops._insert_chunked = inserts["after"]
    print("| measure | before | after | after / before |\n|---|---|---|---|")
    for what in dict.fromkeys(k for k, _ in res):
        b, f = res[(what, "before")], res[(what, "after")]
        print(f"| {what} | {statistics.median(b):.2f} | {statistics.median(f):.2f} "
              f"| {statistics.median([x / y for x, y in zip(f, b)]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
