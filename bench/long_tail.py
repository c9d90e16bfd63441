"""The long tail: makespan of 8 worker processes with a shared wq_sql queue versus static sharding
(``works[i::8]``, what ``dataset.shard`` does) versus the ideal bound, measured in the same run.

Every item costs a sleep. Two scenarios:

* ``slow``    one worker of 8 is ``--slow-factor`` (4x) slower than the rest: a fast item costs
              ``--fast-ms`` (20 ms), a slow one 80 ms. Ideal = total work / total speed
              = N * fast_ms / (7 + 1/4).
* ``random``  every worker has the same speed, but each item a worker runs is, with probability
              ``--p-straggle`` (0.1), a 4x straggler (a GC pause, a noisy neighbour): the same
              seeded random stream per worker in both modes. Ideal = total sleep actually done /
              8 (the realised work, spread perfectly).

Static sharding is measured too: real processes doing the same sleeps over ``works[i::8]``.
Makespan = from the moment every worker is ready (queue joined) to the last worker's last item.
Medians of ``--repeats`` runs; ``--svg`` writes a timeline picture of the last wq_sql and static
runs of the ``slow`` scenario.

    .venv/bin/python bench/long_tail.py                       # SQLite, 8 x 200 items
    .venv/bin/python bench/long_tail.py --backend postgresql --items 1600
    .venv/bin/python bench/long_tail.py --scenarios slow --defaults   # the library's default settings
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_ADMIN, dump, git_rev, machine, median, pct, scratch  # noqa: E402

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402

MODES = ["wq_sql", "memory", "static"]


def _costs(scenario: str, worker: int, slow_worker: int, fast_ms: float, slow_factor: float,
           p: float, seed: int) -> Any:
    """The sleep of each successive item this worker runs, in seconds (a generator)."""
    rng = random.Random(seed * 1000 + worker)
    while True:
        if scenario == "slow":
            yield fast_ms / 1e3 * (slow_factor if worker == slow_worker else 1.0)
        else:
            yield fast_ms / 1e3 * (slow_factor if rng.random() < p else 1.0)


def _worker(mode: str, url: str, queue: str, works: list[str], i: int, n_workers: int, a: dict[str, Any],
            seed: int, ready: Any, go: Any, out: Any) -> None:
    costs = _costs(a["scenario"], i, 0, a["fast_ms"], a["slow_factor"], a["p_straggle"], seed)
    spans: list[tuple[float, float]] = []
    takes: list[float] = []
    slept = 0.0
    try:
        if mode == "wq_sql_nobell":  # --bell-ab: the same, the doorbell off (waits poll)
            os.environ["WQ_SQL_BELL"] = "0"
        if mode in ("wq_sql", "wq_sql_nobell"):
            # --defaults: the library's own settings (issue 16's target), nothing passed
            knobs: dict[str, Any] = {} if a["defaults"] else {"lease_ahead": a["lease_ahead"], "claim_ahead": a["claim_ahead"]}
            wq = WorkQueue.attach(queue, url=url, worker=f"w{i}", **knobs)
            ready.set()
            go.wait()
            t0 = go_time(a)
            while True:
                t = time.time()
                try:
                    wq.take()
                except QueueExhausted:
                    break
                s = time.time()
                takes.append(s - t)
                c = next(costs)
                time.sleep(c)
                slept += c
                spans.append((s - t0, time.time() - t0))
            wq.close()
        elif mode == "memory":  # DeepRec's design: one counter in shared memory, no database
            counter = a["counter"]
            ready.set()
            go.wait()
            t0 = go_time(a)
            while True:
                with counter.get_lock():
                    k = counter.value
                    counter.value = k + 1
                if k >= len(works):
                    break
                s = time.time()
                c = next(costs)
                time.sleep(c)
                slept += c
                spans.append((s - t0, time.time() - t0))
        else:
            ready.set()
            go.wait()
            t0 = go_time(a)
            for _w in works[i::n_workers]:
                s = time.time()
                c = next(costs)
                time.sleep(c)
                slept += c
                spans.append((s - t0, time.time() - t0))
        out.put((i, spans, slept, time.time() - t0, takes))
    except BaseException as e:
        ready.set()
        out.put((i, e, 0.0, 0.0, []))
        raise


def go_time(a: dict[str, Any]) -> float:
    return float(a["go_at"].value)


def run_once(backend: str, mode: str, a: dict[str, Any], seed: int, admin: str) -> dict[str, Any]:
    n_workers, n = a["workers"], a["items"]
    works = [f"part-{k:05d}" for k in range(n)]
    ctx = mp.get_context("fork")
    with scratch(backend, admin, tag="tail") as url:
        queue = f"tail_{uuid.uuid4().hex[:6]}"
        if mode.startswith("wq_sql"):
            WorkQueue(works, num_epochs=1, shuffle=False, seed=1, name=queue, url=url, worker="creator").close()
        go = ctx.Event()
        out = ctx.Queue()
        shared = dict(a)
        shared["go_at"] = ctx.Value("d", 0.0)
        shared["counter"] = ctx.Value("q", 0)
        readies, ps = [], []
        for i in range(n_workers):
            r = ctx.Event()
            p = ctx.Process(target=_worker, args=(mode, url, queue, works, i, n_workers, shared, seed, r, go, out))
            p.start()
            readies.append(r)
            ps.append(p)
        for r in readies:
            r.wait(120)
        shared["go_at"].value = time.time()
        go.set()
        res = [out.get(timeout=600) for _ in ps]
        for p in ps:
            p.join(60)
        for _, spans, _, _, _ in res:
            if isinstance(spans, BaseException):
                raise spans
    res.sort(key=lambda r: r[0])
    makespan = max(r[3] for r in res)
    last_done = max((r[1][-1][1] for r in res if r[1]), default=0.0)
    first_start = min((r[1][0][0] for r in res if r[1]), default=0.0)
    slow_takes = sorted((round(s0, 3), round(d, 4)) for r in res for (s0, _), d in zip(r[1], r[4]) if d > 0.01)
    slept = sum(r[2] for r in res)
    counts = [len(r[1]) for r in res]
    assert sum(counts) == n, (mode, counts)
    takes = [x for r in res for x in r[4]]
    # Each worker's time inside take() over the drain, and that of its first two takes (the
    # join's claims, before the worker's pace is known): the part of the makespan that waits
    # for the database.
    in_take = [sum(r[4]) for r in res if r[4]]
    first_two = [sum(r[4][:2]) for r in res if r[4]]
    return {"mode": mode, "makespan": makespan, "slept": slept, "counts": counts, "last_done": last_done,
            "first_start": first_start, "slow_takes": slow_takes,
            "take_p50_ms": pct(takes, 50) * 1e3, "take_p99_ms": pct(takes, 99) * 1e3,
            "in_take_ms": median(in_take) * 1e3 if in_take else 0.0,
            "first_two_ms": median(first_two) * 1e3 if first_two else 0.0,
            "spans": [r[1] for r in res]}


def ideal(a: dict[str, Any], slept_wq: float) -> float:
    if a["scenario"] == "slow":
        speed = (a["workers"] - 1) + 1.0 / a["slow_factor"]
        return a["items"] * a["fast_ms"] / 1e3 / speed
    return slept_wq / a["workers"]


def svg(path: str, runs: list[dict[str, Any]], title: str) -> None:
    """One row per worker and mode: a bar per item."""
    width, row, pad = 900, 14, 130
    tmax = max(r["makespan"] for r in runs)
    n_rows = sum(len(r["spans"]) for r in runs) + len(runs)
    h = 30 + n_rows * row
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + pad + 20}" height="{h}" '
           'font-family="monospace" font-size="11">', f'<text x="4" y="16">{title}</text>']
    y = 26
    for r in runs:
        out.append(f'<text x="4" y="{y + 10}">{r["mode"]} {r["makespan"]:.2f}s</text>')
        y += row
        for w, spans in enumerate(r["spans"]):
            out.append(f'<text x="14" y="{y + 10}">w{w} ({len(spans)})</text>')
            for k, (s, e) in enumerate(spans):
                x = pad + s / tmax * width
                wd = max(0.5, (e - s) / tmax * width - 0.3)
                out.append(f'<rect x="{x:.1f}" y="{y + 1}" width="{wd:.1f}" height="{row - 3}" '
                           f'fill="{"#4a7" if k % 2 else "#27a"}"/>')
            y += row
    out.append("</svg>")
    Path(path).write_text("\n".join(out))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql"])
    ap.add_argument("--scenarios", default="slow,random")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--items", type=int, default=1600, help="total items (static: items/workers each)")
    ap.add_argument("--fast-ms", type=float, default=20.0)
    ap.add_argument("--slow-factor", type=float, default=4.0)
    ap.add_argument("--p-straggle", type=float, default=0.1)
    ap.add_argument("--lease-ahead", type=int, default=1)
    ap.add_argument("--claim-ahead", action="store_true",
                    help="WorkQueue(claim_ahead=True): claim the next item just in time, in the background")
    ap.add_argument("--defaults", action="store_true",
                    help="WorkQueue.attach(name, url=, worker=) with the library's default settings: "
                         "--lease-ahead and --claim-ahead are not passed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bell-ab", action="store_true",
                    help="also run wq_sql with the doorbell off (WQ_SQL_BELL=0) in each repeat")
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--svg", default=None, help="write a timeline picture of the last 'slow' runs here")
    ap.add_argument("--json", default=None)
    ns = ap.parse_args(argv)
    print("#", machine(), "rev", git_rev(), flush=True)
    summary = []
    for scenario in ns.scenarios.split(","):
        a = {"scenario": scenario, "workers": ns.workers, "items": ns.items, "fast_ms": ns.fast_ms,
             "slow_factor": ns.slow_factor, "p_straggle": ns.p_straggle, "lease_ahead": ns.lease_ahead,
             "claim_ahead": ns.claim_ahead, "defaults": ns.defaults}
        rows = []
        last: list[dict[str, Any]] = []
        for rep in range(ns.repeats):
            seed = 100 + rep
            modes = MODES + (["wq_sql_nobell"] if ns.bell_ab else [])
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            got = {m: run_once(ns.backend, m, a, seed, ns.pg) for m in order}
            b = ideal(a, got["wq_sql"]["slept"])
            row = {"rep": rep, "ideal": b, "counts": got["wq_sql"]["counts"], "load": os.getloadavg()[0],
                   "wq_sql_last_done": got["wq_sql"]["last_done"],
                   **{m: got[m]["makespan"] for m in modes}}
            rows.append(row)
            last = [got["wq_sql"], got["memory"], got["static"]]
            print(f"  {ns.backend} {scenario} rep {rep}: wq_sql {row['wq_sql']:.3f}s (last item done "
                  f"{row['wq_sql_last_done']:.3f}s)  memory {row['memory']:.3f}s  static {row['static']:.3f}s  "
                  f"ideal {b:.3f}s  wq_sql/ideal {row['wq_sql'] / b:.3f}  take() p50 "
                  f"{got['wq_sql']['take_p50_ms']:.2f} ms p99 {got['wq_sql']['take_p99_ms']:.2f} ms, "
                  f"per worker {got['wq_sql']['in_take_ms']:.0f} ms in take() (first two "
                  f"{got['wq_sql']['first_two_ms']:.0f} ms)  "
                  f"items per worker {row['counts']}"
                  + (f"  bell off: wq_sql/ideal {row['wq_sql_nobell'] / b:.3f}" if ns.bell_ab else ""),
                  flush=True)
        med = {k: median([r[k] for r in rows]) for k in (*MODES, "ideal", "wq_sql_last_done")}
        ratios = {k: median([r[k] / r["ideal"] for r in rows]) for k in (*MODES, "wq_sql_last_done")}
        vs_mem = median([r["wq_sql"] / r["memory"] for r in rows])
        if ns.bell_ab:
            ratios["wq_sql_nobell"] = median([r["wq_sql_nobell"] / r["ideal"] for r in rows])
        summary.append({"scenario": scenario, "backend": ns.backend, "settings": a, "median": med,
                        "ratio_to_ideal": ratios, "wq_sql_vs_memory": vs_mem,
                        "load": [r["load"] for r in rows]})
        if ns.svg and scenario == "slow":
            svg(ns.svg, last, f"{ns.backend}, {ns.workers} workers, worker 0 {ns.slow_factor:g}x slower, "
                f"{ns.items} items of {ns.fast_ms:g} ms")
    knobs = ("the library's default settings" if ns.defaults
             else f"lease-ahead {ns.lease_ahead}, claim-ahead {ns.claim_ahead}")
    print(f"\n## long tail on {ns.backend}: {ns.workers} workers, {ns.items} items, {knobs}, "
          f"medians of {ns.repeats} runs\n")
    print("| scenario | ideal s | wq_sql s (/ideal) | wq_sql last item done s (/ideal) | in-memory queue s (/ideal) "
          "| static s (/ideal) | wq_sql / in-memory | target wq_sql/ideal | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in summary:
        m, r = x["median"], x["ratio_to_ideal"]
        print(f"| {x['scenario']} | {m['ideal']:.3f} | {m['wq_sql']:.3f} ({r['wq_sql']:.3f}) "
              f"| {m['wq_sql_last_done']:.3f} ({r['wq_sql_last_done']:.3f}) | {m['memory']:.3f} ({r['memory']:.3f}) "
              f"| {m['static']:.3f} ({r['static']:.2f}) | {x['wq_sql_vs_memory']:.3f} | <= 1.05 "
              f"| {'met' if r['wq_sql'] <= 1.05 else 'MISSED'} |")
        if "wq_sql_nobell" in r:
            print(f"|   (doorbell off, same runs) | | wq_sql/ideal {r['wq_sql_nobell']:.3f} | | | | | | |")
    dump(ns.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
