"""Resume consistent with the model checkpoint: a training process is killed (SIGKILL) between two
checkpoints, restarted from the latest one, and every record is trained exactly once (but the
records of hand-outs that overlapped the save of the restored checkpoint, which it counts as
``ambiguous`` in ``wq_checkpoints``: those may be trained twice, never lost).

    python examples/tf_checkpoint_resume.py
    WQ_SQL_URL=postgresql://user@host/db python examples/tf_checkpoint_resume.py

``WorkQueue(..., consumed="checkpoint")`` keeps the items handed to the pipeline claimed until a
checkpoint covers them; ``wq.checkpoint_manager(...)`` is a ``tf.train.CheckpointManager`` whose
saves mark the covered items done and whose restores re-open the rest. With the tf.data iterator
in the checkpoint, what the pipeline was reading at the save is in the checkpoint too.

The "model" counts how often it saw each record (a variable in the checkpoint), so the final
counts show what the restored checkpoint plus the training after the restart saw. The setup
writes twelve small files and the checkpoints to a temp dir, and the queue to ``$WQ_SQL_URL``, by
default a fresh SQLite file in that dir; the queue has a name of its own and is dropped at the
end, also after an error.
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


def train(tmp, url, queue, kill_at):
    """One training process: restore the latest checkpoint (if any), train, save every 5 steps."""
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    files = [os.path.join(tmp, f"part-{i:02d}.txt") for i in range(N_FILES)]
    # The same worker identity after a restart: it takes back the items it held.
    wq = WorkQueue(files, url=url, name=queue, worker="trainer-0", consumed="checkpoint")
    dataset = tf.data.TextLineDataset(wq.input_dataset())
    dataset = dataset.map(lambda line: tf.strings.to_number(line, tf.int32)).batch(4).prefetch(2)
    iterator = iter(dataset)

    counts = tf.Variable(tf.zeros([N_FILES * LINES], tf.int32))  # the "model"
    step = tf.Variable(0, dtype=tf.int64)
    checkpoint = tf.train.Checkpoint(step=step, counts=counts, iterator=iterator)
    manager = wq.checkpoint_manager(checkpoint, os.path.join(tmp, "ckpt"))
    restored = manager.restore_or_initialize()  # also re-opens what the checkpoint does not cover

    for ids in iterator:
        counts.scatter_nd_add(tf.reshape(ids, [-1, 1]), tf.ones_like(ids))  # "training"
        step.assign_add(1)
        if int(step) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash between two checkpoints
        if int(step) % 5 == 0:
            manager.save(checkpoint_number=int(step))
    manager.save(checkpoint_number=int(step), data_ended=True)
    wq.close()
    return {"restored": restored and os.path.basename(restored), "step": int(step),
            "counts": counts.numpy().tolist(), "done": wq.progress().done}


if len(sys.argv) == 5:  # a training process started below
    print(json.dumps(train(*sys.argv[1:4], int(sys.argv[4]))))
    sys.exit(0)

tmp = tempfile.mkdtemp(prefix="wq_sql_tf_ckpt_")
url = os.environ.get("WQ_SQL_URL") or f"sqlite:///{tmp}/wq.db"
queue = f"tf_checkpoint_resume_{uuid.uuid4().hex[:8]}"  # this run's own, in a database that may be shared
for i in range(N_FILES):
    with open(os.path.join(tmp, f"part-{i:02d}.txt"), "w") as f:
        f.writelines(f"{i * LINES + j}\n" for j in range(LINES))


def run(kill_at):
    return subprocess.run([sys.executable, __file__, tmp, url, queue, str(kill_at)], capture_output=True,
                          text=True)


try:
    first = run(kill_at=13)
    print(f"first run: killed by SIGKILL at step 13: {first.returncode == -signal.SIGKILL}")
    proc = run(kill_at=-1)
    if proc.returncode != 0:
        raise SystemExit(f"the second run failed:\n{proc.stderr}")
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"second run: restored {second['restored']}")
    counts = second["counts"]
    step = int(second["restored"].split("-")[-1])
    engine = sa.create_engine(url)  # any SQL client can read the queue's tables
    with engine.connect() as c:
        ambiguous = c.execute(sa.text(
            "SELECT c.ambiguous FROM wq_checkpoints c JOIN wq_queues q ON q.id = c.queue_id "
            "WHERE q.name = :q AND c.action = 'save' AND c.step = :step"),
            {"q": queue, "step": step}).scalar_one()
    engine.dispose()
    twice = sum(c - 1 for c in counts if c > 1)
    print(f"records: {len(counts)}, every record trained at least once: {min(counts) >= 1}")
    print(f"records trained more than once: {twice}, within the {ambiguous} hand-out(s) that overlapped "
          f"the save: {twice <= ambiguous * LINES}")
    print(f"every record trained exactly once: {counts == [1] * len(counts)}")
    print(f"items done: {second['done']} of {N_FILES}")
finally:
    wq_sql.drop_queue(queue, url)  # a shared database keeps no trace of this run
