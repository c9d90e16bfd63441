"""torchrun ranks sharing one wq_sql queue through ``wq_sql.torch``: the long tail, visible.

    python -m torch.distributed.run --standalone --nproc-per-node 4 examples/torch_long_tail.py
    WQ_SQL_URL=postgresql://user@host/db python -m torch.distributed.run --standalone \\
        --nproc-per-node 4 examples/torch_long_tail.py

(``torchrun`` is the same command.) Each rank scores records with a small model, one file per batch,
twice: first with a static split (``DistributedSampler``: every rank the same files), then through
``wq_sql.torch.DataLoader(QueueDataset(files, ...))``, both with ``num_workers=2`` and persistent
workers. The last rank is four times slower per batch, like a worse machine. Ranks do not step
together (no gradient all-reduce: an offline scoring job, or asynchronous training), so with the
queue the fast ranks simply take more files. Rank 0 prints what each rank read per epoch, both
makespans (measured), and checks that every record was scored exactly once per epoch, from the
ranks' own records and from the queue's audit trail (``wq_history``). (Ranks that do step together
under DDP take different numbers of batches too: iterate inside ``model.join()``, see
``wq_sql.torch``.) Without ``$WQ_SQL_URL`` the
ranks share a SQLite file in the temporary folder, named after torchrun's run id; the queue has a
fresh name and is dropped at the end, also after an error.
"""

import os
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
import torch
import torch.distributed as dist

import wq_sql
from wq_sql.torch import DataLoader, QueueDataset

N_FILES, N_LINES, NUM_EPOCHS, BATCH = 120, 20, 2, 20
SECONDS_PER_BATCH = 0.01  # the fast ranks'; the last rank takes four times as long


def read_file(path: str) -> list[int]:
    """A file's records (here: numbers), read in a DataLoader worker process."""
    with open(path) as f:
        return [int(line) for line in f]


class Files(torch.utils.data.Dataset):
    """The same files as a map-style dataset (item ``i``: file ``i``'s records), for the static split."""

    def __init__(self, files: list) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(read_file(self.files[i]))


def run(loader, seconds: float, set_epoch=None) -> tuple:
    """Score every batch of ``NUM_EPOCHS`` passes; (files per epoch, records, start, end)."""
    model = torch.nn.Linear(1, 1)
    per_epoch, records = [], []
    dist.barrier()  # start together
    start = time.time()
    for epoch in range(NUM_EPOCHS):
        if set_epoch is not None:
            set_epoch(epoch)
        n = 0
        for batch in loader:
            with torch.no_grad():
                model(batch.float().unsqueeze(1))
            time.sleep(seconds)  # the rest of this rank's work on the batch
            n += len(batch) // N_LINES
            records += [(epoch, x) for x in batch.tolist()]
        per_epoch.append(n)
    return per_epoch, records, start, time.time()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    tmp = Path(tempfile.gettempdir(), f"wq_sql_torch_long_tail_{run_id}")
    url = os.environ.get("WQ_SQL_URL") or f"sqlite:///{tmp}/wq.db"
    queue = f"torch_long_tail_{run_id}"[:200]  # a fresh queue in a shared database
    if rank == 0:
        tmp.mkdir(exist_ok=True)
        for i in range(N_FILES):
            Path(tmp, f"part-{i:03d}.txt").write_text("".join(f"{i * 1000 + j}\n" for j in range(N_LINES)))
    dist.barrier()
    files = [str(Path(tmp, f"part-{i:03d}.txt")) for i in range(N_FILES)]
    seconds = SECONDS_PER_BATCH * (4 if rank == world - 1 else 1)
    workers = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 1}
    try:
        # The static split: DistributedSampler gives every rank the same files.
        sampler = torch.utils.data.DistributedSampler(Files(files), shuffle=False)
        static = run(torch.utils.data.DataLoader(Files(files), batch_size=None, sampler=sampler, **workers),
                     seconds, sampler.set_epoch)
        # The work queue: every DataLoader worker of every rank takes the next file when it needs one.
        ds = QueueDataset(files, num_epochs=NUM_EPOCHS, seed=1, name=queue, url=url, read=read_file,
                          lease_ahead=1)
        queued = run(DataLoader(ds, batch_size=N_LINES, **workers), seconds)
        results: list = [None] * world
        dist.all_gather_object(results, (seconds, static, queued))
        if rank == 0:
            report(results, url, queue)
        ds.close()
        dist.barrier()
    finally:
        if rank == 0:
            wq_sql.drop_queue(queue, url)
        dist.destroy_process_group()


def report(results: list, url: str, queue: str) -> None:
    world = len(results)
    print(f"{world} ranks (torchrun), DataLoader(num_workers=2) each: {N_FILES} files x {N_LINES} records, "
          f"{NUM_EPOCHS} epochs; rank {world - 1} is 4x slower")
    print("rank  ms/batch  files: " + "  ".join(f"epoch {e}" for e in range(NUM_EPOCHS))
          + "  total  DistributedSampler")
    for rank, (seconds, static, queued) in enumerate(results):
        print(f"{rank:>4}  {seconds * 1000:>8.0f}         " + "  ".join(f"{n:>7}" for n in queued[0])
              + f"  {sum(queued[0]):>5}  {sum(static[0]):>18}")
    makespan = {name: max(r[i][3] for r in results) - min(r[i][2] for r in results)
                for i, name in ((1, "static"), (2, "queue"))}
    ideal = N_FILES * NUM_EPOCHS / sum(1 / r[0] for r in results)
    print(f"makespan: work queue {makespan['queue']:.2f} s, DistributedSampler {makespan['static']:.2f} s "
          f"(both measured); the batches' own time alone, ideally shared: {ideal:.2f} s")
    fast, slow = [sum(r[2][0]) for r in results[:-1]], sum(results[-1][2][0])
    print(f"the slow rank took fewer files: {'yes' if slow < min(fast) else 'no'}; the work queue "
          f"finished sooner: {'yes' if makespan['queue'] < makespan['static'] else 'no'}")
    records = [i * 1000 + j for i in range(N_FILES) for j in range(N_LINES)]
    every = sorted((e, x) for e in range(NUM_EPOCHS) for x in records)
    for i, name in ((1, "DistributedSampler"), (2, "work queue")):
        scored = sorted(x for r in results for x in r[i][1])
        print(f"{name}: every record exactly once per epoch: {scored == every}")
    engine = sa.create_engine(url)  # any SQL client can audit the queue
    with engine.connect() as c:
        twice = c.execute(sa.text("SELECT epoch, seq FROM wq_history WHERE queue = :q AND kind = 'done' "
                                  "GROUP BY epoch, seq HAVING count(*) <> 1"), {"q": queue}).all()
        done = c.execute(sa.text("SELECT count(*) FROM wq_audit WHERE queue = :q AND state = 'done'"),
                         {"q": queue}).scalar_one()
    engine.dispose()
    print(f"every item done exactly once (wq_history): {not twice and done == N_FILES * NUM_EPOCHS}")


if __name__ == "__main__":
    main()
