"""The long form of tests/contract/test_chaos.py: the SIGKILL-and-restart drain, bigger and repeated.

    .venv/bin/python bench/chaos_soak.py --rounds 5 --works 1000 --kills 60

Each round runs the chaos test (both backends unless ``-k`` narrows it) with ``--works`` works per
epoch and up to ``--kills`` kills, asserting the same invariants: every (epoch, seq) done exactly
once, re-deliveries exactly the items killed workers held, no lingering idle-in-transaction
session (Postgres), no "database is locked" (SQLite). Postgres: ``$WQ_SQL_TEST_PG`` as for the tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--works", type=int, default=600)
    ap.add_argument("--kills", type=int, default=40)
    ap.add_argument("-k", default="sigkill", help="pytest -k expression (default: the SIGKILL drain)")
    a = ap.parse_args(argv)
    env = {**os.environ, "WQ_SQL_CHAOS_WORKS": str(a.works), "WQ_SQL_CHAOS_KILLS": str(a.kills)}
    for r in range(a.rounds):
        print(f"== round {r + 1}/{a.rounds}: {a.works} works x 2 epochs, up to {a.kills} kills", flush=True)
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              str(ROOT / "tests" / "contract" / "test_chaos.py"), "-k", a.k], cwd=ROOT, env=env)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
