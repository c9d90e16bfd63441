"""DeepRec's Reader example on wq_sql (TF1 graph mode): only the import lines differ.

    python examples/tf_reader.py

``TextLineReader().read_up_to(work_queue.input_producer(), num_records=2)`` in a
``MonitoredTrainingSession``; the loop ends normally when the queue is exhausted. The setup
writes three small text files to a temp dir, and the queue to ``$WQ_SQL_URL``, by default a fresh
SQLite file in that dir (``WQ_SQL_URL=postgresql://user@host/db python examples/tf_reader.py``).
"""

import atexit
import os
import tempfile

# DeepRec is TF1: in TF2, the same names live in tensorflow.compat.v1, in graph mode.
import tensorflow.compat.v1 as tf

import wq_sql

tf.disable_eager_execution()

# ---- setup: three small text files, and a database for the queue
tmp = tempfile.mkdtemp(prefix="wq_sql_tf_reader_")
os.environ.setdefault("WQ_SQL_URL", f"sqlite:///{tmp}/wq.db")
paths = []
for i, n in enumerate([5, 6, 7]):
    paths.append(os.path.join(tmp, f"part-{i}.txt"))
    with open(paths[-1], "w") as f:
        f.writelines(f"file {i} line {j}\n" for j in range(n))
path1, path2, path3 = paths
records = []


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

work_queue = WorkQueue([path1, path2, path3], shuffle=True)
work_queue.add_summary()

# create file reader
reader = tf.TextLineReader()
# get 2 records
keys, values = reader.read_up_to(work_queue.input_producer(), num_records=2)

with tf.train.MonitoredTrainingSession() as sess:
    while not sess.should_stop():  # DeepRec's docs: sess.run(...)
        records.extend(sess.run(values).tolist())

# ---- after the queue is exhausted, the session ended normally
expected = [line.encode() for p in paths for line in open(p).read().splitlines()]
print(f"records: {len(records)}")
print(f"every line exactly once: {sorted(records) == sorted(expected)}")
print("summaries: " + ", ".join(sorted(s.op.name for s in tf.get_collection(tf.GraphKeys.SUMMARIES))))
