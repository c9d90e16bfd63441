"""A trainer with checkpoint-consistent resume, for the kill tests: ``python torch_ckpt_trainer.py
'<job JSON>'``.

It trains a one-weight model on the records of a ``QueueDataset(consumed="checkpoint")`` through
``wq_sql.torch.DataLoader`` (``num_workers`` fork workers), saves a checkpoint (model, optimizer,
``loader.state_dict()``, epoch) every ``every`` steps and at the end of each pass (written to a
temporary file, then renamed: a kill never leaves half a checkpoint), and resumes from it when it
exists. Its log (``job["log"]``, one JSON line each, appended) says what it did: ``{"restored":
step}`` at start, ``{"step", "epoch", "records"}`` for each batch trained, ``{"saved": step}``
after each save. Each record is ``<line>@e<item epoch>``.

``per_rank``: one of a torchrun job's ranks (``RANK``, ``TORCHELASTIC_RUN_ID`` in the environment):
its worker identity is the rank's (``wq_sql.torch.rank_name``), its checkpoint and log are
``<ckpt>.rank<R>`` and ``<log>.rank<R>``. ``hold_at``: after training that step, stop (sleep
until killed), holding what it read."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from wq_sql.torch import DataLoader, QueueDataset


def read_lines(item: Any) -> list[str]:
    with open(item) as f:
        return [f"{line}@e{item.epoch}" for line in f.read().splitlines()]


def main() -> None:
    job: dict[str, Any] = json.loads(sys.argv[1])
    worker: Any = "trainer"
    if job.get("per_rank"):
        worker = None  # the rank's: <TORCHELASTIC_RUN_ID>/rank<RANK>
        rank = os.environ["RANK"]
        job = {**job, "ckpt": f"{job['ckpt']}.rank{rank}", "log": f"{job['log']}.rank{rank}"}
    ds = QueueDataset(job["files"], num_epochs=job["num_epochs"], seed=7, name=job["queue"], url=job["url"],
                      read=read_lines, consumed="checkpoint", worker=worker, lease_ahead=2,
                      **job.get("options", {}))
    loader = DataLoader(ds, batch_size=job["batch_size"], num_workers=job["num_workers"],
                        multiprocessing_context="fork")
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    path = Path(job["ckpt"])
    start_epoch, step = 0, 0
    if path.exists():
        ckpt = torch.load(path)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["loader"]["step"]
        start_epoch = ckpt["epoch"] + (1 if ckpt["pass_ended"] else 0)
    with open(job["log"], "a", buffering=1) as log:
        log.write(json.dumps({"restored": step, "pid": os.getpid()}) + "\n")

        def save(epoch: int, pass_ended: bool) -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "loader": loader.state_dict(), "epoch": epoch, "pass_ended": pass_ended}
            tmp = path.with_name(path.name + ".tmp")  # per rank: ckpt.pt.rank0 -> ckpt.pt.rank0.tmp
            torch.save(state, tmp)
            os.replace(tmp, path)
            log.write(json.dumps({"saved": step}) + "\n")

        for epoch in range(start_epoch, job["num_epochs"]):
            for batch in loader:
                loss = model(torch.ones(len(batch), 1)).sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(job.get("step_seconds", 0))
                step += 1
                log.write(json.dumps({"step": step, "epoch": epoch, "records": list(batch)}) + "\n")
                if step % job["every"] == 0:
                    save(epoch, False)
                if step == job.get("hold_at"):
                    log.write(json.dumps({"holding": step}) + "\n")
                    while True:
                        time.sleep(1)
            save(epoch, True)
    print(json.dumps({"finished": step}))


if __name__ == "__main__":
    main()
