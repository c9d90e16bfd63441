"""Where a ``wq_sql.torch`` DataLoader worker's pass spends its CPU (issue 18): the same DataLoader
as ``torch_loader.py throughput`` (``num_workers=2``, 1,000 x 100-record files), with every worker
timing its phases in-process (``time.thread_time`` per call, so the numbers are CPU of the thread
that ran the phase, whatever the load), against the static DataLoader's workers in the same run.

    .venv/bin/python bench/torch_phases.py --backend sqlite --lease-ahead 256 --runs 5
    .venv/bin/python bench/torch_phases.py --backend postgresql --epochs 2     # passes 2+ take over
    .venv/bin/python bench/torch_phases.py --profile /tmp/prof                 # + cProfile of the phases

Per worker process (medians over the runs): its CPU in all threads and in its main thread, minor
page faults (copy-on-write of the inherited heap), and per phase the CPU and wall milliseconds and
calls. Phases nest (``open: register`` is inside ``open``); ``prefetch`` runs in the refill thread.
``--epochs 2``: the second pass's workers (``pass 2+``) take over the identities the first pass's
left. ``--profile DIR``: a cProfile (CPU timer) of the phases' own calls, one file per thread.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import multiprocessing.util
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_ADMIN, git_rev, machine, scratch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch_loader import StaticFiles, lease_ahead, read_lines, write_files  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql import handout, lease, look, ops  # noqa: E402
from wq_sql import queue as wq_queue  # noqa: E402
from wq_sql.torch import DataLoader, QueueDataset, handoff  # noqa: E402

# (owner, attribute, label): what each worker times. Labels with ": " are inside another phase.
PHASES: list[tuple[Any, str, str]] = [
    (handoff.Loader, "__init__", "open"),
    (wq_queue, "worker_engine", "open: worker_engine"),
    (wq_queue, "ensure_schema", "open: ensure_schema"),
    (wq_queue, "open_queue", "open: open_queue"),
    (wq_queue, "register", "open: register"),
    (ops, "insert_worker", "open: register: insert_worker"),
    (ops, "find_worker", "open: register: find_worker"),
    (ops, "take_over_worker", "open: register: take_over_worker"),
    (ops, "recover", "open: register: recover"),
    (wq_queue.WorkQueue, "_start", "open: heartbeat"),
    (handout.Dispenser, "take_many", "take_many (claims inline)"),
    (handout.Dispenser, "prefetch", "prefetch (refill thread)"),
    (handout.Dispenser, "_claim", "claim rounds (any thread)"),
    (look.Look, "read", "pass end: look.read"),
    (handout.Dispenser, "_listen", "pass end: bell subscribe"),
    (handoff.Loader, "drain", "drain (per batch)"),
    (handoff.Loader, "close", "close"),
    (lease.Heartbeat, "beat", "heartbeat beats"),
]


class Phases:
    """The per-process record: phase -> [cpu ms, wall ms, calls], and the optional profilers."""

    def __init__(self, profile: bool) -> None:
        self.acc: dict[str, list[float]] = {}
        self.profile = profile
        self.profilers: dict[int, cProfile.Profile] = {}
        self.depth = threading.local()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            outer = getattr(self.depth, "d", 0) == 0
            self.depth.d = getattr(self.depth, "d", 0) + 1
            prof = None
            if self.profile and outer:
                prof = self.profilers.setdefault(threading.get_ident(), cProfile.Profile(time.thread_time))
                prof.enable()
            c, w = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                e = self.acc.setdefault(label, [0.0, 0.0, 0])
                e[0] += (time.thread_time() - c) * 1000
                e[1] += (time.perf_counter() - w) * 1000
                e[2] += 1
                if prof is not None:
                    prof.disable()
                self.depth.d -= 1

        setattr(owner, attr, timed)


def worker_init(phases: Phases, out: Path, tag: Callable[[], str]) -> Callable[[int], None]:
    """A ``worker_init_fn`` that resets the record and writes it when the worker exits (after the
    shim's own exit hook, which leaves the queue: ``Finalize`` priorities run high to low)."""
    def init(k: int) -> None:
        r0, w0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
        phases.acc.clear()
        phases.profilers.clear()
        name = f"{tag()}-{k}-{os.getpid()}"

        def dump() -> None:
            r = resource.getrusage(resource.RUSAGE_SELF)
            record = {"tag": name.split("-")[0], "cpu": (r.ru_utime + r.ru_stime - r0.ru_utime - r0.ru_stime) * 1000,
                      "main": (time.thread_time() - t0) * 1000, "wall": (time.perf_counter() - w0) * 1000,
                      "minflt": r.ru_minflt - r0.ru_minflt, "phases": phases.acc}
            (out / f"{name}.json").write_text(json.dumps(record))
            for i, prof in enumerate(phases.profilers.values()):
                prof.dump_stats(out / f"{name}-{i}.prof")

        multiprocessing.util.Finalize(None, dump, exitpriority=1)
    return init


def summary(out: Path) -> None:
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    for kind in ("static", "pass1", "pass2+"):
        rs = [r for r in records if r["tag"] == kind]
        if not rs:
            continue
        med = {key: statistics.median(r[key] for r in rs) for key in ("cpu", "main", "wall", "minflt")}
        print(f"{kind}: {len(rs)} worker processes; CPU {med['cpu']:.1f} ms (main thread {med['main']:.1f}), "
              f"wall {med['wall']:.0f} ms, minor faults {med['minflt']:.0f}")
        for _, _, label in PHASES:
            v = [r["phases"].get(label, [0.0, 0.0, 0]) for r in rs]
            if any(x[2] for x in v):
                print(f"    {label:38s} CPU {statistics.median(x[0] for x in v):6.2f} ms   "
                      f"wall {statistics.median(x[1] for x in v):7.2f} ms   "
                      f"calls {statistics.median(x[2] for x in v):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument("--pg", default=PG_ADMIN)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=1, help="passes per run (one queue of that many epochs)")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--lines", type=int, default=100)
    ap.add_argument("--lease-ahead", type=lease_ahead, default=None, help="a number, or auto (the default)")
    ap.add_argument("--profile", type=Path, default=None, help="also write cProfile files of the phases here")
    a = ap.parse_args()
    info = machine()
    print(f"machine: {info['nproc']} cpus, load {info['load1']}, commit {git_rev()}, backend {a.backend}, "
          f"lease_ahead={a.lease_ahead or 'auto'}, {a.runs} runs x {a.epochs} pass(es)")
    phases = Phases(a.profile is not None)
    for owner, attr, label in PHASES:
        phases.wrap(owner, attr, label)
    out = a.profile or Path(tempfile.mkdtemp(prefix="wq_torch_phases_"))
    out.mkdir(parents=True, exist_ok=True)
    tag = ["static"]
    init = worker_init(phases, out, lambda: tag[0])
    files = write_files(Path(tempfile.gettempdir(), f"wq_bench_torch_{a.files}x{a.lines}"), a.files, a.lines)
    loader_args: dict[str, Any] = {"batch_size": 256, "num_workers": 2, "worker_init_fn": init}
    with scratch(a.backend, a.pg, "torchph") as url:
        for _ in range(a.runs):
            tag[0] = "static"
            assert sum(len(b) for b in TorchLoader(StaticFiles(files), **loader_args)) == a.files * a.lines
            name = f"ph_{uuid.uuid4().hex[:8]}"
            ds = QueueDataset(files, num_epochs=a.epochs, name=name, url=url, read=read_lines,
                              lease_ahead=a.lease_ahead, worker="bench")
            loader = DataLoader(ds, **loader_args)
            for epoch in range(a.epochs):
                tag[0] = "pass1" if epoch == 0 else "pass2+"
                assert sum(len(b) for b in loader) == a.files * a.lines
            ds.close()
            wq_sql.drop_queue(name, url)
    summary(out)


if __name__ == "__main__":
    main()
