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
until killed), holding what it read.

For the resume regressions (``test_resume_regressions.py``): ``kill_after_save``: SIGKILL the
process group (this process and its DataLoader workers) right after the save at that step, before
the loop asks for the next batch; ``kill_after_pass``: the same right after the save that ends
that epoch's pass; ``save_at_pass_start``: also save right before each pass begins, and
``kill_at_pass_start``: die right after that save of that epoch; ``keep``: keep every
checkpoint as ``<ckpt>.step<N>`` too; ``restore``: the checkpoint file to resume from (default
``ckpt``); ``persistent_workers``: the DataLoader's; ``kill_at``: die right after training that
step. ``consumed``: the dataset's (default ``"checkpoint"``). ``per_rank`` jobs: ``hold_at``,
``step_seconds`` and ``kill_after_save`` may be ``{rank: value}``; ``departed``: checkpoint
files of ranks that did not come back, whose loader states this rank restores with its own
(``load_state_dict(departed=)``); ``epoch_from``: for a rank without a checkpoint of its own, the
checkpoint whose epoch the job resumes at; ``incarnation``: logged."""

from __future__ import annotations

import json
import os
import shutil
import signal
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
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # a group of its own, with its DataLoader workers: die() kills just them
    worker: Any = "trainer"
    if job.get("per_rank"):
        worker = None  # the rank's: <TORCHELASTIC_RUN_ID>/rank<RANK>
        rank = os.environ["RANK"]
        job = {**job, "ckpt": f"{job['ckpt']}.rank{rank}", "log": f"{job['log']}.rank{rank}"}
        for key in ("hold_at", "step_seconds", "kill_after_save"):  # {rank: value}: per rank
            if isinstance(job.get(key), dict):
                job[key] = job[key].get(rank)
    ds = QueueDataset(job["files"], num_epochs=job["num_epochs"], seed=7, name=job["queue"], url=job["url"],
                      read=read_lines, consumed=job.get("consumed", "checkpoint"), worker=worker,
                      lease_ahead=2, **job.get("options", {}))
    extra = {"persistent_workers": True} if job.get("persistent_workers") else {}
    loader = DataLoader(ds, batch_size=job["batch_size"], num_workers=job["num_workers"],
                        multiprocessing_context="fork" if job["num_workers"] else None, **extra)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    path = Path(job["ckpt"])
    start_epoch, step = 0, 0
    source = Path(job.get("restore") or path)
    departed = [torch.load(f)["loader"] for f in job.get("departed", [])]
    if source.exists():
        ckpt = torch.load(source)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"], departed=departed)
        step = ckpt["loader"]["step"]
        start_epoch = ckpt["epoch"] + (1 if ckpt["pass_ended"] else 0)
    elif job.get("epoch_from") and Path(job["epoch_from"]).exists():
        # A rank the restored checkpoint has no state for (the job grew): the job's epoch.
        ckpt = torch.load(job["epoch_from"])
        start_epoch = ckpt["epoch"] + (1 if ckpt["pass_ended"] else 0)
        ds.set_epoch(start_epoch)
    with open(job["log"], "a", buffering=1) as log:
        kept = job.get("restore") and str(source).startswith(f"{path}.step")  # a kept copy of path
        log.write(json.dumps({"restored": step, "pid": os.getpid(),
                              "source": str(path if kept else source) if source.exists() else None,
                              "departed": [[f, s["step"]] for f, s in zip(job.get("departed", []), departed)],
                              **{k: job[k] for k in ("incarnation",) if k in job}}) + "\n")

        def save(epoch: int, pass_ended: bool) -> None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "loader": loader.state_dict(), "epoch": epoch, "pass_ended": pass_ended}
            tmp = path.with_name(path.name + ".tmp")  # per rank: ckpt.pt.rank0 -> ckpt.pt.rank0.tmp
            torch.save(state, tmp)
            os.replace(tmp, path)
            if job.get("keep"):
                shutil.copyfile(path, f"{path}.step{step}")
            log.write(json.dumps({"saved": step, "epoch": epoch, "pass_ended": pass_ended}) + "\n")

        def die() -> None:
            log.write(json.dumps({"dying": step}) + "\n")
            os.killpg(os.getpgid(0), signal.SIGKILL)

        for epoch in range(start_epoch, job["num_epochs"]):
            if job.get("save_at_pass_start"):
                save(epoch - 1, True)  # between passes: the state says the previous pass ended
                if job.get("kill_at_pass_start") == epoch:
                    die()
            for batch in loader:
                loss = model(torch.ones(len(batch), 1)).sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                time.sleep(job.get("step_seconds", 0))
                step += 1
                log.write(json.dumps({"step": step, "epoch": epoch, "records": list(batch)}) + "\n")
                if step == job.get("kill_at"):
                    die()
                if step % job["every"] == 0:
                    save(epoch, False)
                    if step == job.get("kill_after_save"):
                        die()
                if step == job.get("hold_at"):
                    log.write(json.dumps({"holding": step}) + "\n")
                    while True:
                        time.sleep(1)
            save(epoch, True)
            if job.get("kill_after_pass") == epoch:
                die()
    print(json.dumps({"finished": step}))


if __name__ == "__main__":
    main()
