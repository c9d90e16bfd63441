"""DeepRec's TableRecordReader example on wq_sql (TF1 graph mode).

    python examples/tf_table_reader.py

DeepRec reads ODPS tables; here the works are SQL tables (``table:<name>`` in the queue's own
database), cut into ``num_slices`` key ranges when the queue is created. Only the import lines
and the work names differ from the original. The setup writes two tables into a fresh SQLite
file in a temp dir.
"""

import os
import sqlite3
import tempfile

import tensorflow.compat.v1 as tf

tf.disable_eager_execution()

# ---- setup: two tables in the queue's database
tmp = tempfile.mkdtemp(prefix="wq_sql_tf_table_")
os.environ["WQ_SQL_URL"] = f"sqlite:///{tmp}/wq.db"
with sqlite3.connect(f"{tmp}/wq.db") as db:
    for table, n in (("clicks", 300), ("views", 700)):
        db.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, user TEXT, score REAL)")
        db.executemany(f"INSERT INTO {table} VALUES (?, ?, ?)",
                       [(i, f"{table}-user-{i}", i / 10) for i in range(n)])
odps_path1, odps_path2 = "table:clicks", "table:views"
num_workers = 1
records = []

# ---- DeepRec's example, but for the import lines
# from tensorflow.python.ops.work_queue import WorkQueue
from wq_sql.tf import TableRecordReader, WorkQueue  # noqa: E402

work_queue = WorkQueue(
    [odps_path1, odps_path2], shuffle=True, num_slices=num_workers * 10)
# create table reader
reader = TableRecordReader()  # DeepRec: tf.TableRecordReader()
# get 2 records
keys, values = reader.read_up_to(work_queue.input_producer(), num_records=2)

with tf.train.MonitoredTrainingSession() as sess:
    while not sess.should_stop():
        records.extend(sess.run(values).tolist())

# ---- every row of both tables exactly once, as "id,user,score" strings
print(f"items per epoch: {work_queue.items_per_epoch}")
print(f"records: {len(records)}")
expected = sorted(f"{i},{t}-user-{i},{i / 10}".encode() for t, n in (("clicks", 300), ("views", 700))
                  for i in range(n))
print(f"every row exactly once: {sorted(records) == expected}")
