"""Same-run A/B of two source trees: an older commit ("before") against the working tree ("after").

Each tree runs its own copy of a benchmark script with its own ``wq_sql`` on ``PYTHONPATH``,
alternating before/after (and swapping which goes first each round), so that machine drift hits
both alike. Two benchmarks are understood:

* ``claim``: ``bench/claim_throughput.py`` (pass its options after ``--``); reported per
  (backend, processes, lease-ahead, variant): the median items/s of each tree and after/before.
* ``textline``: ``bench/tf_textline.py``; reported per lease-ahead: the median of each tree's
  ratio to a plain ``TextLineDataset`` measured in the same process, and after/before.

    .venv/bin/python bench/ab_trees.py 61776ba claim --rounds 3 -- --backends sqlite,postgresql \\
        --procs 1,4 --lease-ahead 1,32 --seconds 2 --repeats 1 --variants wq_sql,raw
    .venv/bin/python bench/ab_trees.py 61776ba textline --rounds 3 -- --files 300 --runs 3

The older tree is extracted with ``git archive`` into a temporary directory (no worktree left).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"claim": "bench/claim_throughput.py", "textline": "bench/tf_textline.py"}


def extract(rev: str, into: Path) -> Path:
    tar = into / "tree.tar"
    with tar.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=f, check=True)
    tree = into / "before"
    tree.mkdir()
    with tarfile.open(tar) as t:
        t.extractall(tree, filter="data")
    return tree


def run(tree: Path, bench: str, args: list[str], out: Path) -> dict[tuple[Any, ...], float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / SCRIPTS[bench]), *args]
    if bench == "claim":
        cmd += ["--json", str(out)]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{tree.name}: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    if bench == "claim":
        by: dict[tuple[Any, ...], list[float]] = {}
        for r in json.loads(out.read_text()):
            by.setdefault((r["backend"], r["procs"], r["lease_ahead"], r["variant"]), []).append(r["rate"])
        return {k: statistics.median(v) for k, v in by.items()}
    # Per lease-ahead ("default" or a number): the ratio, and the ms per pass inside the shim's
    # hand-outs where the script prints them (the part of the gap that is wq_sql's for certain).
    found = re.findall(r"lease_ahead=(\w+)\s.*?ratio ([\d.]+)x(?:.*?inside hand-outs ([\d.]+) ms)?", p.stdout)
    if not found:
        raise SystemExit(f"no ratio in the output of {tree.name}:\n{p.stdout[-2000:]}")
    got = {("textline", la, "ratio"): float(x) for la, x, _ in found}
    got.update({("textline", la, "handout_ms"): float(ms) for la, _, ms in found if ms})
    return got


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="the older commit (e.g. the one before a refactor)")
    ap.add_argument("bench", choices=sorted(SCRIPTS))
    ap.add_argument("--rounds", type=int, default=3)
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]  # after --: the benchmark's own options
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    print(f"# A/B {a.bench}: before {a.before}, after the working tree (HEAD {rev}), {a.rounds} rounds; "
          f"options {' '.join(bench_args)}", flush=True)
    results: dict[str, list[dict[tuple[Any, ...], float]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="wq_ab_") as tmp:
        trees = {"before": extract(a.before, Path(tmp)), "after": ROOT}
        for rnd in range(a.rounds):
            for side in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
                got = run(trees[side], a.bench, bench_args, Path(tmp) / f"{side}{rnd}.json")
                results[side].append(got)
                print(f"  round {rnd} {side}: " + ", ".join(f"{k}: {v:,.2f}" for k, v in sorted(got.items())),
                      flush=True)
    print("\nmedians over rounds (after / before):")
    for key in sorted(results["after"][0]):
        b = statistics.median(r[key] for r in results["before"] if key in r)
        x = statistics.median(r[key] for r in results["after"] if key in r)
        label = " ".join(map(str, key))
        print(f"  {label:40s} before {b:12,.2f}  after {x:12,.2f}  after/before {x / b:.3f}")
    if a.bench == "claim":
        # Each run's wq_sql rate against the raw driver measured beside it: drift of the machine
        # between the two trees' runs cancels out of this one.
        print("\nwq_sql / raw within each run, medians over rounds:")
        for key in sorted({k[:3] for k in results["after"][0]}):
            r = {side: statistics.median(d[(*key, "wq_sql")] / d[(*key, "raw")] for d in results[side]
                                         if (*key, "wq_sql") in d and (*key, "raw") in d)
                 for side in ("before", "after")}
            print(f"  {' '.join(map(str, key)):40s} before {r['before']:.2f}  after {r['after']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
