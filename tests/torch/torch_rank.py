"""One rank of the PyTorch tests, started by ``torch_support.start_rank`` with torchrun's
environment: ``python torch_rank.py '<job JSON>'``.

It trains a one-weight model on the records of a ``QueueDataset`` (or the indices of a
``QueueSampler``) through ``wq_sql.torch.DataLoader``, ``num_epochs`` passes, under DDP with
the gloo backend and ``join()`` when ``dist`` is set, sleeping ``step_seconds`` per step (a slow
rank). Each trained batch is appended to ``<log>.rank<R>`` as a JSON line as soon as its step is
over; the last stdout line is a JSON report."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, get_worker_info

from wq_sql.torch import DataLoader, QueueDataset, QueueSampler

READ_SECONDS = float(os.environ.get("TEST_READ_SECONDS", "0"))


def read_lines(path: str) -> list[str]:
    """Each line of a file, tagged with the DataLoader worker that read it (after
    ``$TEST_READ_SECONDS``: a slow reader)."""
    info = get_worker_info()
    time.sleep(READ_SECONDS)
    with open(path) as f:
        return [f"{line}@w{info.id if info else 0}" for line in f.read().splitlines()]


class Indices(Dataset):  # type: ignore[type-arg]
    """A map-style dataset whose sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def main() -> None:
    job: dict[str, Any] = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    options = dict(job.get("options", {}))
    if job.get("dist"):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    loader_args: dict[str, Any] = {"batch_size": job.get("batch_size", 8),
                                   "num_workers": job.get("num_workers", 2)}
    if loader_args["num_workers"]:
        loader_args["multiprocessing_context"] = job.get("context", "fork")
        loader_args["persistent_workers"] = bool(job.get("persistent"))
        if str(rank) in job.get("prefetch_factor", {}):  # {rank: batches each worker reads ahead}
            loader_args["prefetch_factor"] = job["prefetch_factor"][str(rank)]
    if job.get("mode", "dataset") == "dataset":
        ds = QueueDataset(job["files"], num_epochs=job["num_epochs"], seed=7, name=job["queue"],
                          url=job["url"], read=read_lines, lease_ahead=job.get("lease_ahead", 4), **options)
        loader = DataLoader(ds, **loader_args)
    else:
        sampler = QueueSampler(job["num_samples"], num_slices=job["num_slices"],
                               num_epochs=job["num_epochs"], seed=7, name=job["queue"], url=job["url"],
                               lease_ahead=job.get("lease_ahead", 4), **options)
        loader = DataLoader(Indices(job["num_samples"]), sampler=sampler, **loader_args)
    model: torch.nn.Module = torch.nn.Linear(1, 1)
    if job.get("dist"):
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    if job.get("start_line"):  # wait until every rank is ready, so that all share the queue
        world = int(os.environ["WORLD_SIZE"])
        Path(f"{job['log']}.ready{rank}").touch()
        deadline = time.monotonic() + 120
        while len(list(Path(job["log"]).parent.glob(Path(job["log"]).name + ".ready*"))) < world:
            assert time.monotonic() < deadline, "the other ranks never got ready"
            time.sleep(0.02)
    steps = 0
    per_epoch: list[int] = []
    with open(f"{job['log']}.rank{rank}", "a", buffering=1) as log:
        for epoch in range(job["num_epochs"]):
            join: Any = model.join() if job.get("dist") else contextlib.nullcontext()
            per_epoch.append(0)
            with join:
                for batch in loader:
                    records = [str(r) if not isinstance(r, torch.Tensor) else str(int(r)) for r in batch]
                    loss = model(torch.ones(len(records), 1)).sum()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    time.sleep(job.get("step_seconds", 0))
                    log.write(json.dumps({"epoch": epoch, "records": records}) + "\n")
                    steps += 1
                    per_epoch[-1] += 1
    if job.get("dist"):
        dist.barrier()
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "steps": steps, "per_epoch": per_epoch}))


if __name__ == "__main__":
    main()
