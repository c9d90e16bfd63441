"""PyTorch's DataLoader fed by wq_sql (issue 18): throughput, and the long tail of torchrun ranks.

    .venv/bin/python bench/torch_loader.py throughput --backend sqlite          # 1,000 files x 100 records
    .venv/bin/python bench/torch_loader.py throughput --backend postgresql --lease-ahead 64 256
    .venv/bin/python bench/torch_loader.py throughput --persistent --epochs 5   # the steady state
    .venv/bin/python bench/torch_loader.py throughput --consumed trained checkpoint  # state_dict() saves
    .venv/bin/python bench/torch_loader.py long-tail --backend postgresql       # 4 ranks, one 4x slower

``throughput``: records/s of ``wq_sql.torch.DataLoader(QueueDataset(files, read=read_lines),
num_workers=2, batch_size=256)`` against the same ``torch.utils.data.DataLoader`` over a static
file list (an ``IterableDataset`` whose worker ``k`` of ``n`` reads ``files[k::n]``), run after
run, alternating, each wq_sql run on a fresh queue (creating it is not timed, as in
``bench/tf_textline.py``). Each run is ``--epochs`` passes, timed from ``iter(loader)`` to the end
of the last pass, so the DataLoader workers' start (and each worker process opening the queue)
is inside the time, as users pay it. Ratio = median(static seconds) / median(wq_sql seconds).
The CPU column: median milliseconds of CPU (user + system) of the main process and of the
DataLoader workers per run (on 2 cores the static loader is CPU-bound, so what wq_sql adds in
CPU, anywhere, is what its time adds).

``--floor N``: a third side, :class:`DurableFloor`, the static loader plus only the durable
statements wq_sql makes per item (claim rounds of N items, each marking the previous round's
done with their history rows), by the raw driver: what any loader that claims and completes
every item durably costs at least, so ``static / floor`` bounds the ratio reachable here.

``long-tail``: ``--ranks`` processes with torchrun's environment (gloo for the start line and
the results), the last one 4x slower per batch (a sleep: its GPU, or its machine, is slower), no
gradient all-reduce (an offline job or asynchronous training: ranks that do not wait for each
other). Each rank reads one file per batch with ``num_workers`` DataLoader workers (persistent),
first through ``DistributedSampler`` (static: every rank the same number of files), then through
an oracle's static split (:class:`SpeedShare`: shares proportional to the ranks' known speeds, a
reference that pays the DataLoader's own start and per-batch costs, shown beside the ideal), then
through wq_sql, ``--epochs`` passes each. Makespan = last rank's end - the common start, measured for
both; ideal = the batches' sleep time shared perfectly (total work / total speed), which leaves
out what both sides pay to start (the slowest rank's first batch, static/wq_sql, is printed: the
DataLoader workers' start and, for wq_sql, each worker opening the queue). "ideal (steps as
run)": the same with each rank's steps as long as its sleeps really took in the wq_sql run (a
loaded machine wakes a sleep late, which is not the loader's doing). The machines here are
shared and have 2 cores: read ratios from the same run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import PG_ADMIN, DurableRounds, floor_queue, git_rev, machine, scratch  # noqa: E402
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402

import wq_sql  # noqa: E402
from wq_sql.torch import DataLoader, QueueDataset  # noqa: E402


def write_files(directory: Path, n_files: int, n_lines: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        path = directory / f"part-{i:05d}.txt"
        if not path.exists():
            path.write_text("".join(f"{i},{j},{(i * 31 + j) % 97},some payload text\n" for j in range(n_lines)))
        paths.append(str(path))
    return paths


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


class StaticFiles(IterableDataset):  # type: ignore[type-arg]
    """The reference: DataLoader worker ``k`` of ``n`` reads ``files[k::n]``."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __iter__(self) -> Any:
        info = get_worker_info()
        mine = self.files if info is None else self.files[info.id::info.num_workers]
        for path in mine:
            yield from read_lines(path)


class DurableFloor(IterableDataset):  # type: ignore[type-arg]
    """A floor under any queue-fed loader with these guarantees (``--floor``): the static
    reference's reading plus only the durable statements wq_sql makes per item, sent by the raw
    driver from each DataLoader worker: claim rounds of ``n`` items (``claim.ClaimRound``, the
    statement wq_sql runs), each also marking the previous round's items done, with their history
    rows and counters. No trainer side, no hand-over of items, no heartbeat, no Python of wq_sql
    but the round's own. The queue and one worker row per DataLoader worker are made beforehand
    (:func:`floor_queue`), outside the time."""

    def __init__(self, url: str, qid: int, worker_ids: list[int], n: int) -> None:
        self.url, self.qid, self.worker_ids, self.n = url, qid, worker_ids, n

    def __iter__(self) -> Any:
        info = get_worker_info()
        rounds = DurableRounds(self.url, self.qid, self.worker_ids[info.id if info is not None else 0], self.n)
        for work in rounds.drain():
            yield from read_lines(work)


def timed_passes(loader: Any, epochs: int, expect: int, save_every: int = 0) -> float:
    """Seconds for ``epochs`` passes; ``save_every``: take ``loader.state_dict()`` every that many
    batches and at each pass end, confirmed at the end (consumed='checkpoint': the saves'
    transactions are inside the time; writing a checkpoint file is not)."""
    t = time.perf_counter()
    for _ in range(epochs):
        n = 0
        for k, batch in enumerate(loader, 1):
            n += len(batch)
            if save_every and k % save_every == 0:
                loader.state_dict()
        assert n == expect, (n, expect)
        if save_every:
            loader.state_dict()
    if save_every:
        loader.checkpoint_saved()
    return time.perf_counter() - t


def throughput(a: argparse.Namespace) -> None:
    data = Path(tempfile.gettempdir(), f"wq_bench_torch_{a.files}x{a.lines}")
    files = write_files(data, a.files, a.lines)
    records = a.files * a.lines
    workers: dict[str, Any] = {"batch_size": a.batch, "num_workers": a.workers}
    if a.persistent:
        workers["persistent_workers"] = True
    print(f"== throughput: {a.files} files x {a.lines} records, {a.epochs} epoch(s) per run, DataLoader("
          f"num_workers={a.workers}, batch_size={a.batch}{', persistent_workers=True' if a.persistent else ''}), "
          f"{a.runs} runs per side, backend {a.backend}, consumed={' and '.join(map(repr, a.consumed))}"
          + (f" (state_dict() every {a.save_every} batches)" if "checkpoint" in a.consumed else ""))
    with scratch(a.backend, a.pg, "torch") as url:
        rows = []
        for la in a.lease_ahead:
            static_s: list[float] = []
            queue_s: dict[str, list[float]] = {c: [] for c in a.consumed}
            cpu: dict[str, list[tuple[float, float]]] = {c: [] for c in ["static", *a.consumed, "floor"]}
            floor_s: list[float] = []
            for run in range(a.runs):  # interleaved: static, then each consumed= in turn, rotated
                with cpu_into(cpu["static"]):
                    static_s.append(timed_passes(TorchLoader(StaticFiles(files), **workers), a.epochs,
                                                 records))
                k = run % len(a.consumed)  # each mode goes first as often: no place in the run favoured
                for consumed in a.consumed[k:] + a.consumed[:k]:
                    name = f"tp_{uuid.uuid4().hex[:8]}"
                    mode, _, extra = consumed.partition("+")
                    ds = QueueDataset(files, num_epochs=a.epochs, name=name, url=url, read=read_lines,
                                      lease_ahead=la, worker="bench", consumed=mode, lineage=extra == "lineage")
                    save_every = a.save_every if mode == "checkpoint" else 0
                    with cpu_into(cpu[consumed]):
                        queue_s[consumed].append(timed_passes(DataLoader(ds, **workers), a.epochs, records,
                                                              save_every))
                    ds.close()
                    wq_sql.drop_queue(name, url)
                if a.floor and a.epochs == 1:
                    name = f"fl_{uuid.uuid4().hex[:8]}"
                    qid, ids = floor_queue(files, url, name, a.workers)
                    with cpu_into(cpu["floor"]):
                        floor_s.append(timed_passes(TorchLoader(DurableFloor(url, qid, ids, a.floor), **workers),
                                                    1, records))
                    wq_sql.drop_queue(name, url)
            ms = statistics.median(static_s)
            if floor_s:
                rows.append((la, f"floor {a.floor}", ms, statistics.median(floor_s), min(static_s), min(floor_s),
                             median_cpu(cpu["static"]), median_cpu(cpu["floor"])))
            for consumed, times in queue_s.items():
                mq = statistics.median(times)
                rows.append((la, consumed, ms, mq, min(static_s), min(times), median_cpu(cpu["static"]),
                             median_cpu(cpu[consumed])))
        print(f"{'lease_ahead':>11}  {'consumed':>10}  {'static (median)':>15}  {'wq_sql (median)':>15}  "
              f"{'ratio':>6}  {'ratio of best runs':>18}  {'records/s wq_sql':>16}  "
              "CPU ms main+workers, static / wq_sql")
        for la, consumed, ms, mq, bs, bq, cs, cq in rows:
            print(f"{la or 'auto':>11}  {consumed:>10}  {ms:>13.3f} s  {mq:>13.3f} s  {ms / mq:>5.2f}x  "
                  f"{bs / bq:>17.2f}x  {records * a.epochs / mq:>16,.0f}  "
                  f"{cs[0]:.0f}+{cs[1]:.0f} / {cq[0]:.0f}+{cq[1]:.0f}")
        for la, consumed, _, mq, _, bq, _, _ in rows:
            base = next((r for r in rows if r[0] == la and r[1] == consumed.partition("+")[0]), None)
            if "+" in consumed and base is not None:
                print(f"{consumed} against {base[1]} (lease_ahead {la or 'auto'}), same run: median "
                      f"{base[3] / mq:.3f}x, best runs {base[5] / bq:.3f}x")
        if a.persistent:
            print("(persistent workers are reaped after the run: their CPU is not in the workers' column)")


@contextlib.contextmanager
def cpu_into(out: list[tuple[float, float]]) -> Iterator[None]:
    """CPU milliseconds (user + system) of this process and of its reaped children (the DataLoader
    workers, joined at the end of a pass unless persistent) during the block: the machine has 2
    cores, so CPU added anywhere shows in the wall time."""
    def children() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    main, kids = time.process_time(), children()
    yield
    out.append(((time.process_time() - main) * 1000, (children() - kids) * 1000))


def median_cpu(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(m for m, _ in samples), statistics.median(k for _, k in samples)


# ---------------------------------------------------------------- long tail


class Files(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> list[str]:
        return read_lines(self.files[i])


class SpeedShare(torch.utils.data.Sampler):  # type: ignore[type-arg]
    """The oracle's static split: each epoch's shuffled indices cut in shares proportional to the
    ranks' known speeds (what a static split could do if it knew them in advance): the same
    DataLoader, the same start and per-batch costs as the queue's run, no queue."""

    def __init__(self, n: int, speeds: list[float], rank: int, seed: int) -> None:
        bounds = [round(n * sum(speeds[:r]) / sum(speeds)) for r in range(len(speeds) + 1)]
        self.lo, self.hi, self.n, self.seed, self.epoch = bounds[rank], bounds[rank + 1], n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g)[self.lo:self.hi].tolist())

    def __len__(self) -> int:
        return self.hi - self.lo


def rank_main(job: dict[str, Any]) -> None:
    """One rank of ``long-tail`` (started by :func:`long_tail` with torchrun's environment)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds = job["seconds"] * (job["slow"] if rank == world - 1 else 1)
    workers = {"num_workers": job["workers"], "persistent_workers": True, "prefetch_factor": job["prefetch"]}
    files = job["files"]

    def run(loader: Any, set_epoch: Any = None) -> tuple[float, float, int, float, float, dict[str, Any]]:
        n, first, slept = 0, 0.0, 0.0
        waits: list[float] = []  # per batch: from the end of the last step (or the pass's start)
        ends: list[float] = []  # per pass: from the end of its last step to the end of the loop
        dist.barrier()
        start = time.time()
        for epoch in range(job["epochs"]):
            if set_epoch is not None:
                set_epoch(epoch)
            mark = time.perf_counter()
            for _ in loader:
                first = first or time.time()
                t = time.perf_counter()
                waits.append(t - mark)
                time.sleep(seconds)
                mark = time.perf_counter()
                slept += mark - t
                n += 1
            ends.append(time.perf_counter() - mark)
        end = time.time()
        ms = sorted(w * 1000 for w in waits[1:])  # the first batch is the start, reported apart
        detail = {"wait p50": statistics.median(ms), "wait p90": ms[int(0.9 * len(ms))], "wait max": ms[-1],
                  "wait sum": sum(ms), "waits > 5 ms": sum(w > 5 for w in ms),
                  "pass ends": [round(e * 1000, 1) for e in ends],
                  "last step ended": end - ends[-1] - start}
        return start, end, n, first - start, slept, detail

    sampler = torch.utils.data.DistributedSampler(Files(files), shuffle=True, seed=1)
    static = run(TorchLoader(Files(files), batch_size=None, sampler=sampler, **workers), sampler.set_epoch)
    speeds = [1 / (job["seconds"] * (job["slow"] if r == world - 1 else 1)) for r in range(world)]
    share = SpeedShare(len(files), speeds, rank, seed=1)
    oracle = run(TorchLoader(Files(files), batch_size=None, sampler=share, **workers), share.set_epoch)
    ds = QueueDataset(files, num_epochs=job["epochs"], name=job["queue"], url=job["url"], read=read_lines,
                      lease_ahead=job["lease_ahead"], seed=1)
    queued = run(DataLoader(ds, batch_size=job["lines"], **workers))
    results: list[Any] = [None] * world
    dist.all_gather_object(results, {"seconds": seconds, "static": static, "queue": queued, "oracle": oracle})
    ds.close()
    dist.barrier()
    if rank == 0:
        print(json.dumps(results))
    dist.destroy_process_group()


def long_tail(a: argparse.Namespace) -> None:
    data = Path(tempfile.gettempdir(), f"wq_bench_torch_{a.files}x{a.lines}")
    files = write_files(data, a.files, a.lines)
    print(f"== long tail: {a.ranks} ranks, rank {a.ranks - 1} {a.slow:g}x slower ({a.seconds * 1000:.0f} ms per "
          f"batch of one file, {a.seconds * a.slow * 1000:.0f} ms on the slow rank), {a.files} files x "
          f"{a.epochs} epochs, DataLoader(num_workers={a.workers}, prefetch_factor={a.prefetch}, persistent), "
          f"lease_ahead={a.lease_ahead or 'auto'}, backend {a.backend}, {a.runs} run(s)")
    print(f"{'run':>3}  {'DistributedSampler':>18}  {'wq_sql':>8}  {'ideal':>6}  {'wq_sql/ideal':>12}  "
          f"{'static/ideal':>12}  {'first batch':>11}  {'ideal (steps as run)':>20}  {'wq_sql/that':>11}  "
          "files per rank (wq_sql)  ms per batch outside the step, static/wq_sql (fast ranks' median)")
    with scratch(a.backend, a.pg, "torchlt") as url:
        for run in range(a.runs):
            queue = f"lt_{uuid.uuid4().hex[:8]}"
            job = {"files": files, "lines": a.lines, "epochs": a.epochs, "seconds": a.seconds, "slow": a.slow,
                   "workers": a.workers, "prefetch": a.prefetch, "lease_ahead": a.lease_ahead, "url": url,
                   "queue": queue}
            port = _free_port()
            procs = []
            for r in range(a.ranks):
                env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(a.ranks),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": queue,
                       "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen([sys.executable, __file__, "rank", json.dumps(job)], env=env,
                                              stdout=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=600)[0] for p in procs]
            assert all(p.returncode == 0 for p in procs), "a rank failed"
            results = json.loads(outs[0].strip().splitlines()[-1])
            wq_sql.drop_queue(queue, url)
            span = {k: max(r[k][1] for r in results) - min(r[k][0] for r in results)
                    for k in ("static", "queue", "oracle")}
            ideal = len(files) * a.epochs / sum(1 / r["seconds"] for r in results)
            counts = [r["queue"][2] for r in results]
            first = {k: max(r[k][3] for r in results) for k in ("static", "queue", "oracle")}
            # The same ideal with each rank's steps as long as they really were in the wq_sql run
            # (a loaded machine wakes a sleep late): what is left above it is the loader's.
            as_run = len(files) * a.epochs / sum(r["queue"][2] / r["queue"][4] for r in results)
            # Each rank's time outside its steps per batch (the loader's next(), the wake-up of
            # the step's sleep on a loaded machine): what the per-batch costs add to every rank.
            outside = {k: statistics.median((r[k][1] - r[k][0] - r[k][4]) / r[k][2] * 1000 for r in results[:-1])
                       for k in ("static", "queue")}
            print(f"{run:>3}  {span['static']:>16.2f} s  {span['queue']:>6.2f} s  {ideal:>4.2f} s  "
                  f"{span['queue'] / ideal:>11.2f}x  {span['static'] / ideal:>11.2f}x  "
                  f"{first['static']:.2f}/{first['queue']:.2f} s  {as_run:>18.2f} s  "
                  f"{span['queue'] / as_run:>10.2f}x  {counts}  {outside['static']:.2f}/{outside['queue']:.2f}")
            print(f"     oracle (a static split by the known speeds, files per rank "
                  f"{[r['oracle'][2] for r in results]}): {span['oracle']:.2f} s, {span['oracle'] / ideal:.2f}x "
                  f"of the ideal, first batch {first['oracle']:.2f} s; wq_sql / oracle "
                  f"{span['queue'] / span['oracle']:.2f}x")
            if a.detail:
                t0 = {k: min(r[k][0] for r in results) for k in ("static", "queue", "oracle")}
                for k in ("static", "oracle", "queue"):
                    for rank, r in enumerate(results):
                        d = r[k][5]
                        print(f"       {k:6s} rank {rank}: {r[k][2]} batches, first {r[k][3] * 1000:.0f} ms, "
                              f"waits for a batch p50 {d['wait p50']:.2f} / p90 {d['wait p90']:.2f} / max "
                              f"{d['wait max']:.1f} ms, sum {d['wait sum']:.0f} ms, {d['waits > 5 ms']} > 5 ms; "
                              f"last step ended at {(r[k][0] - t0[k] + d['last step ended']) * 1000:.0f} ms, "
                              f"pass ends {d['pass ends']} ms, loop ended at {(r[k][1] - t0[k]) * 1000:.0f} ms")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lease_ahead(text: str) -> Optional[int]:
    """``--lease-ahead``: ``auto`` (None: the core sizes the rounds) or a number."""
    return None if text == "auto" else int(text)


def main() -> None:
    if sys.argv[1:2] == ["rank"]:
        return rank_main(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    for name in ("throughput", "long-tail"):
        p = sub.add_parser(name)
        p.add_argument("--backend", choices=["sqlite", "postgresql"], default="sqlite")
        p.add_argument("--pg", default=PG_ADMIN, help="Postgres admin URL (a scratch database is made there)")
        p.add_argument("--runs", type=int, default=7 if name == "throughput" else 1)
        p.add_argument("--epochs", type=int, default=1 if name == "throughput" else 2)
        p.add_argument("--lines", type=int, default=100)
        p.add_argument("--workers", type=int, default=2 if name == "throughput" else 1)
    tp = sub.choices["throughput"]
    tp.add_argument("--files", type=int, default=1000)
    tp.add_argument("--batch", type=int, default=256)
    tp.add_argument("--lease-ahead", type=lease_ahead, nargs="+", default=[None],
                    help="items per claim round, or auto (the default: the core's automatic size)")
    tp.add_argument("--persistent", action="store_true")
    tp.add_argument("--floor", type=int, default=0, metavar="N",
                    help="also time DurableFloor: the static loader plus only the durable statements per "
                         "item (claim rounds of N, each marking the last round's items done), raw driver")
    tp.add_argument("--consumed", choices=["trained", "checkpoint", "trained+lineage", "checkpoint+lineage"],
                    nargs="+", default=["trained"],
                    help="both: each run measures them in turn (checkpoint mode's cost, same run)")
    tp.add_argument("--save-every", type=int, default=50, help="batches between state_dict() (checkpoint)")
    lt = sub.choices["long-tail"]
    lt.add_argument("--files", type=int, default=400)
    lt.add_argument("--ranks", type=int, default=4)
    lt.add_argument("--slow", type=float, default=4.0)
    lt.add_argument("--seconds", type=float, default=0.01, help="per batch (one file) on a fast rank")
    lt.add_argument("--prefetch", type=int, default=1)
    lt.add_argument("--lease-ahead", type=lease_ahead, default=None, help="a number, or auto (the default)")
    lt.add_argument("--detail", action="store_true", help="per rank: the waits for batches, the ends")
    a = ap.parse_args()
    info = machine()
    print(f"machine: {info['nproc']} cpus ({info['cpu']}), load {info['load1']}, python {info['python']}, "
          f"sqlite {info['sqlite']}, postgres {info['postgres']}, torch {torch.__version__}, "
          f"commit {git_rev()}")
    if a.what == "throughput":
        throughput(a)
    else:
        long_tail(a)


if __name__ == "__main__":
    main()
