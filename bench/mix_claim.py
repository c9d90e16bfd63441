"""The claim path of a weighted queue against a plain one, in the same run.

Each round drains two fresh queues of the same size, one after the other, in alternating order:
**one** source (a plain list of works) and **three** weighted sources (0.6 / 0.3 / 0.1, the
usual mix), with ``take()`` in one process at a fixed ``lease_ahead``, each in a fresh database
of its own after a warm-up drain there. Reported: items/s of each and the ratio three / one per round, median
and geometric mean over rounds (half the rounds run each order); the target is >= 0.9x.

A weighted queue claims with the same statement as a plain one (its rows carry their source;
the mix is decided when rows are drawn, not when they are claimed), so the ratio measures what
drawing costs when epochs are made and the audit columns cost on the way.

    .venv/bin/python bench/mix_claim.py                               # both backends
    .venv/bin/python bench/mix_claim.py --backends sqlite --n 20000 --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_ADMIN, dump, machine, median, scratch  # noqa: E402

from wq_sql import WorkQueue  # noqa: E402


def drain(url: str, name: str, works: Any, weights: Any, lease_ahead: int, epochs: int) -> float:
    """Items/s of one ``take()`` loop over every epoch (the queue made before the clock starts)."""
    kw = dict(num_epochs=epochs, seed=1, url=url, name=name, lease_ahead=lease_ahead, worker="b")
    if weights is not None:
        kw["weights"] = weights
    with WorkQueue(works, **kw) as q:
        n = 0
        t = time.perf_counter()
        for _ in q:
            n += 1
        dt = time.perf_counter() - t
    return n / dt


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--n", type=int, default=10_000, help="items per epoch (default 10,000)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--lease-ahead", default="1,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    print(machine())
    n = a.n
    plain = [f"w/{i:06d}" for i in range(n)]
    three = {"web": plain[: n // 2], "code": plain[n // 2: n // 2 + 3 * n // 10], "math": plain[n // 2 + 3 * n // 10:]}
    weights = {"web": 0.6, "code": 0.3, "math": 0.1}
    out: list[dict[str, Any]] = []
    for backend in a.backends.split(","):
        for la in [int(x) for x in a.lease_ahead.split(",")]:
            ratios, ones, threes = [], [], []
            for r in range(a.rounds):
                order = [("one", plain, None), ("three", three, weights)]
                if r % 2:
                    order.reverse()
                got = {}
                for k, w, wt in order:
                    # Each drain in a fresh database of its own, after a warm-up drain there (the
                    # first drain in a new database runs slower: connections, plans, caches).
                    with scratch(backend, a.pg, tag="mix") as url:
                        drain(url, "warm", plain[:2000], None, la, 1)
                        got[k] = drain(url, k, w, wt, la, a.epochs)
                ones.append(got["one"])
                threes.append(got["three"])
                ratios.append(got["three"] / got["one"])
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            row = {"backend": backend, "lease_ahead": la, "one_items_s": median(ones),
                   "three_items_s": median(threes), "ratio": median(ratios), "geomean": geo, "ratios": ratios}
            out.append(row)
            print(f"{backend:<10} lease_ahead {la:>3}: one source {row['one_items_s']:9.0f} items/s, "
                  f"three weighted {row['three_items_s']:9.0f} items/s, three / one {row['ratio']:.3f}x (geometric mean {geo:.3f}x) "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    dump(a.json, {"machine": machine(), "rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
