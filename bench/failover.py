"""The failover drill (``make failover``): long drains on a real Patroni + etcd pair, each hit by
a primary crash, a planned switchover and a lost standby, with the checks of
``tests/postgres/test_failover.py`` (the short form, in CI).

    .venv/bin/python bench/failover.py                        # 2 rounds, 16 workers, about 3 minutes
    .venv/bin/python bench/failover.py --rounds 3 --works 2000 --procs 16

Each round is one drain of ``--works`` x ``--epochs`` items of ``--item-ms`` each by ``--procs``
worker processes (half of them acknowledging with explicit ``complete()``), on a fresh database
of one pair (``scripts/ha_cluster.py``: installs ``patroni`` and ``etcd-server`` when missing, as
root). The faults come in the order of ``--faults`` at the fractions given; each waits until the
pair is healthy again (the previous victim rejoined as synchronous standby). Printed per fault:
seconds from the fault until a write commits through the multi-host URL, until every worker
received an item again, and the longest time no worker received one; per round: deliveries
abandoned across a fault (claims whose reply was lost, re-delivered once), items received
twice, acknowledgements rejected, explicit acknowledgements checked, wq_sql's warnings. Any
failed check ends the drill with exit code 1. Everything it started is stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "scripts"))


def _faults(text: str) -> list[tuple[str, float]]:
    out = []
    for part in text.split(","):
        kind, _, at = part.partition(":")
        if kind not in ("kill", "switchover", "standby") or not at:
            raise argparse.ArgumentTypeError(f"{part!r}: expected kill|switchover|standby:FRACTION")
        out.append((kind, float(at)))
    return out


def _versions() -> str:
    def first(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "?"
    from ha_cluster import PG_BINDIR

    return (f"{first(['patroni', '--version'])}, {first(['etcd', '--version'])}, "
            f"{first([str(PG_BINDIR / 'postgres'), '--version'])}")


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}" if xs else "-"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--works", type=int, default=1200, help="items per epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--procs", type=int, default=16, help="worker processes")
    ap.add_argument("--item-ms", type=float, default=100.0)
    ap.add_argument("--faults", type=_faults, default=_faults("kill:0.15,switchover:0.45,standby:0.7"))
    a = ap.parse_args(argv)

    from ha_cluster import HACluster, HAClusterError
    from test_failover import drill

    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    per: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    totals: collections.Counter[str] = collections.Counter()
    warnings: collections.Counter[str] = collections.Counter()
    failed = 0
    t_start = time.monotonic()
    try:
        ha = HACluster()
        ha.start()
    except HAClusterError as e:
        print(f"cannot make the Patroni pair: {e}", file=sys.stderr)
        return 1
    print(_versions())
    try:
        for r in range(a.rounds):
            print(f"== round {r + 1}/{a.rounds}: {a.works} x {a.epochs} items of {a.item_ms:.0f} ms, "
                  f"{a.procs} workers, faults {a.faults}", flush=True)
            t0 = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="wq_sql_failover.") as tmp:
                try:
                    out: dict[str, Any] = drill(ha, Path(tmp), a.faults, n_works=a.works, epochs=a.epochs,
                                                item_ms=a.item_ms, n_procs=a.procs, timeout=180.0)
                except AssertionError as e:
                    failed += 1
                    print(f"   FAILED: {e}", flush=True)
                    continue
            for f in out["faults"]:
                print(f"   {f['fault']:>10} at {f['at']:.0%} ({f['leader']}): write after "
                      f"{f['fault_to_write_s']:.2f} s, every worker again after {f['all_workers_resumed_s']:.2f} s, "
                      f"longest stall {f['longest_stall_s']:.2f} s", flush=True)
                for k in ("fault_to_write_s", "all_workers_resumed_s", "longest_stall_s"):
                    per[f["fault"]][k].append(f[k])
            print(f"   checks passed in {time.monotonic() - t0:.0f} s: {out['items']} items done once, "
                  f"{out['abandoned']} abandoned deliveries, {out['received_twice']} received twice, "
                  f"{out['rejected_acks']} acks rejected, {out['explicit_acks']} explicit acks kept; "
                  f"warnings {out['warnings']}", flush=True)
            for k in ("items", "abandoned", "received_twice", "rejected_acks", "explicit_acks"):
                totals[k] += out[k]
            warnings.update(out["warnings"])
    finally:
        left = ha.close()
    print(f"\nsummary: {a.rounds - failed} of {a.rounds} rounds passed in {time.monotonic() - t_start:.0f} s; "
          f"processes left after teardown: {left or 'none'}")
    print("fault        n   write after (s)      every worker again (s)   longest stall (s)   [min / median / max]")
    for kind, m in per.items():
        print(f"{kind:<10} {len(m['fault_to_write_s']):>3}   {_spread(m['fault_to_write_s']):<20} "
              f"{_spread(m['all_workers_resumed_s']):<24} {_spread(m['longest_stall_s'])}")
    print(f"items {totals['items']}, abandoned deliveries {totals['abandoned']}, received twice "
          f"{totals['received_twice']}, acks rejected {totals['rejected_acks']}, explicit acks kept "
          f"{totals['explicit_acks']}; worker warnings {dict(warnings)}")
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
