"""DeepRec's ``tf.data`` example on wq_sql: only the import line differs from DeepRec's docs.

    python examples/tf_dataset.py
    WQ_SQL_URL=postgresql://user@host/db python examples/tf_dataset.py

The setup writes four small text files to a temp dir, and the queue to ``$WQ_SQL_URL``, by default
a fresh SQLite file in that dir.
"""

import atexit
import os
import tempfile

import tensorflow as tf

import wq_sql

# ---- setup: four small text files, and a database for the queue
tmp = tempfile.mkdtemp(prefix="wq_sql_tf_dataset_")
os.environ.setdefault("WQ_SQL_URL", f"sqlite:///{tmp}/wq.db")
paths = []
for i in range(4):
    paths.append(os.path.join(tmp, f"part-{i}.csv"))
    with open(paths[-1], "w") as f:
        f.writelines(f"{i},{j},{(i * 31 + j) % 7}\n" for j in range(25))
filename, filename1, filename2, filename3 = paths
num_epochs, batch_size = 1, 8


def drop_queue_at_exit():
    """$WQ_SQL_URL may name a shared database: leave no queue there, also after an error. The queue
    is this run's own: its works are this run's temp files, so a queue of the same name from
    elsewhere would have been refused, not joined."""
    if "work_queue" in globals():
        work_queue.close()
        wq_sql.drop_queue(work_queue.name)


atexit.register(drop_queue_at_exit)

# ---- DeepRec's example, verbatim but for the import line
# from tensorflow.python.ops.work_queue import WorkQueue
from wq_sql.tf import WorkQueue  # noqa: E402

# use WorkQueue to allocate tasks
work_queue = WorkQueue([filename, filename1, filename2, filename3])
f_data = work_queue.input_dataset()

# Extract lines from input files using the Dataset API.
dataset = tf.data.TextLineDataset(f_data)
dataset = dataset.shuffle(buffer_size=20000, seed=2021)  # fix seed for reproducing
dataset = dataset.repeat(num_epochs)
dataset = dataset.prefetch(batch_size)
dataset = dataset.batch(batch_size)
dataset = dataset.prefetch(1)

# ---- consume it, as a training loop would
lines, batches = [], 0
for batch in dataset:
    batches += 1
    lines.extend(batch.numpy().tolist())
expected = [line.encode() for p in paths for line in open(p).read().splitlines()]
print(f"batches: {batches}")
print(f"lines: {len(lines)}")
print(f"every line exactly once: {sorted(lines) == sorted(expected)}")
print(f"items done: {work_queue.progress().done} of {len(work_queue) * work_queue.num_epochs}")
