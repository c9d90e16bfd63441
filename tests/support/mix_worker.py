"""A worker of a weighted queue, for the mixing tests: run as a script, it opens the queue with
the weighted sources of :func:`sources` (core ``WorkQueue``, the TF pipeline or a PyTorch
DataLoader, by ``--shim``), takes items until the queue ends (or ``--max-items``) and appends
each one it receives to ``--log`` as ``<monotonic ns> <work>`` (flushed per item), so a test can
compare what each worker got, and when, with the audit. ``--step`` sleeps after each item."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
SIZES = {"web": 5000, "code": 3000, "math": 2000}
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def sources(sizes: dict[str, int] = SIZES) -> dict[str, list[str]]:
    """``{"web": ["web/00000", ...], ...}``: a work's source is the part before the ``/``."""
    return {name: [f"{name}/{i:05d}" for i in range(n)] for name, n in sizes.items()}


def source_of(work: str) -> str:
    return work.split("/", 1)[0]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--shim", choices=["core", "tf", "torch"], default="core")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lease-ahead", type=int, default=None)
    p.add_argument("--step", type=float, default=0.0)
    p.add_argument("--max-items", type=int, default=0)
    p.add_argument("--go", help="wait until this file exists before the first take")
    a = p.parse_args(argv)
    kw = dict(num_epochs=a.epochs, seed=11, name=a.name, url=a.url, worker=a.worker,
              lease_ahead=a.lease_ahead, weights=WEIGHTS)
    log = open(a.log, "a", buffering=1)
    n = 0

    def got(work: str) -> bool:
        nonlocal n
        log.write(f"{time.monotonic_ns()} {work}\n")
        n += 1
        if a.step:
            time.sleep(a.step)
        return bool(a.max_items) and n >= a.max_items

    def wait_go() -> None:
        while a.go and not os.path.exists(a.go):
            time.sleep(0.01)

    if a.shim == "core":
        from wq_sql import WorkQueue

        with WorkQueue(sources(), **kw) as q:
            wait_go()
            for w in q:
                if got(w):
                    break
    elif a.shim == "tf":
        import wq_sql.tf as wtf

        q = wtf.WorkQueue(sources(), **kw)
        wait_go()
        for w in q.input_dataset():
            if got(w.numpy().decode()):
                break
        q.close()
    else:
        import wq_sql.torch as wt

        kw.pop("worker")
        ds = wt.QueueDataset(sources(), worker=a.worker, **kw)
        wait_go()
        for work in wt.DataLoader(ds, batch_size=None, num_workers=2):
            if got(work):
                break
        ds.close()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
