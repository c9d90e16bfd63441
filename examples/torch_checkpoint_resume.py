"""Resume consistent with the model checkpoint, in PyTorch: a training process (DataLoader with two
worker processes) is killed (SIGKILL) between two checkpoints, restarted from the latest one, and
no record is lost; the restored model sees twice only the records of items that straddled the
save (their first records before it, their last after it: at most one per DataLoader worker).

    python examples/torch_checkpoint_resume.py
    WQ_SQL_URL=postgresql://user@host/db python examples/torch_checkpoint_resume.py

``QueueDataset(..., consumed="checkpoint")`` keeps the items the loader read claimed until a
checkpoint holding ``loader.state_dict()`` is saved; ``loader.load_state_dict(...)`` resumes and
re-opens what the checkpoint does not cover. The "model" counts how often it saw each record (a
tensor in the checkpoint), so the final counts show what the restored checkpoint plus the training
after the restart saw. The setup writes twelve small files and the checkpoint to a temp dir, and
the queue to ``$WQ_SQL_URL``, by default a fresh SQLite file in that dir; the queue has a name of
its own and is dropped at the end, also after an error.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import uuid

import sqlalchemy as sa

import wq_sql

N_FILES, LINES = 12, 10


def read_numbers(path):
    """The records of one item: the numbers in its file (module-level: workers unpickle it)."""
    with open(path) as f:
        return [int(line) for line in f]


def train(tmp, url, queue, kill_at):
    """One training process: restore the checkpoint (if any), train, save every 5 steps."""
    import torch

    from wq_sql.torch import DataLoader, QueueDataset

    files = [os.path.join(tmp, f"part-{i:02d}.txt") for i in range(N_FILES)]
    # The same identity after a restart (worker=): its DataLoader workers take back what they held.
    ds = QueueDataset(files, url=url, name=queue, worker="trainer", read=read_numbers, consumed="checkpoint")
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    counts = torch.zeros(N_FILES * LINES, dtype=torch.int64)  # the "model"
    step = 0
    path = os.path.join(tmp, "ckpt.pt")
    restored = None
    if os.path.exists(path):
        ckpt = torch.load(path)
        counts = ckpt["counts"]
        loader.load_state_dict(ckpt["loader"])  # also re-opens what the checkpoint does not cover
        step = restored = ckpt["loader"]["step"]

    def save():
        torch.save({"counts": counts, "loader": loader.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)  # a kill never leaves half a checkpoint

    for batch in loader:
        counts.index_add_(0, batch, torch.ones_like(batch))  # "training"
        step += 1
        if step == kill_at:
            os.killpg(0, signal.SIGKILL)  # a crash between two checkpoints, DataLoader workers too
        if step % 5 == 0:
            save()  # its items are done once the loop asks for the next batch
    save()
    return {"restored": restored, "step": step, "counts": counts.tolist()}


if len(sys.argv) == 5:  # a training process started below
    result = train(*sys.argv[1:4], int(sys.argv[4]))
    print(json.dumps(result))  # at exit, the last save's items become done
    sys.exit(0)

tmp = tempfile.mkdtemp(prefix="wq_sql_torch_ckpt_")
url = os.environ.get("WQ_SQL_URL") or f"sqlite:///{tmp}/wq.db"
queue = f"torch_checkpoint_resume_{uuid.uuid4().hex[:8]}"  # this run's own, in a database that may be shared
for i in range(N_FILES):
    with open(os.path.join(tmp, f"part-{i:02d}.txt"), "w") as f:
        f.writelines(f"{i * LINES + j}\n" for j in range(LINES))


def run(kill_at):
    return subprocess.run([sys.executable, __file__, tmp, url, queue, str(kill_at)], capture_output=True,
                          text=True, start_new_session=True)


try:
    first = run(kill_at=13)
    print(f"first run: killed by SIGKILL at step 13: {first.returncode == -signal.SIGKILL}")
    proc = run(kill_at=-1)
    if proc.returncode != 0:
        raise SystemExit(f"the second run failed:\n{proc.stderr}")
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"second run: restored the checkpoint of step {second['restored']}")
    counts = second["counts"]
    twice = {n // LINES for n, c in enumerate(counts) if c > 1}
    print(f"records: {len(counts)}, every record trained at least once: {min(counts) >= 1}")
    print(f"items whose records the model saw twice: {len(twice)}, at most one per DataLoader worker: "
          f"{len(twice) <= 2}")
    engine = sa.create_engine(url)  # any SQL client can read the queue's tables
    with engine.connect() as c:
        done = c.execute(sa.text("SELECT count(*) FROM wq_audit WHERE queue = :q AND state = 'done'"),
                         {"q": queue}).scalar_one()
    engine.dispose()
    print(f"items done: {done} of {N_FILES}")
finally:
    wq_sql.drop_queue(queue, url)  # a shared database keeps no trace of this run
