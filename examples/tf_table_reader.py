"""DeepRec's TableRecordReader example on wq_sql (TF1 graph mode).

    python examples/tf_table_reader.py
    WQ_SQL_URL=postgresql://user@host/db python examples/tf_table_reader.py

DeepRec reads ODPS tables; here the works are SQL tables (``table:<name>`` in the queue's own
database), cut into ``num_slices`` key ranges when the queue is created. Only the import lines
and the work names differ from the original. The setup writes two tables into the queue's
database, ``$WQ_SQL_URL``, by default a fresh SQLite file in a temp dir; the tables (with names of
their own) and the queue are dropped at exit, also after an error.
"""

import atexit
import os
import tempfile
import uuid

import sqlalchemy as sa
import tensorflow.compat.v1 as tf

import wq_sql

tf.disable_eager_execution()

# ---- setup: two tables in the queue's database
tmp = tempfile.mkdtemp(prefix="wq_sql_tf_table_")
url = os.environ.setdefault("WQ_SQL_URL", f"sqlite:///{tmp}/wq.db")
run = uuid.uuid4().hex[:8]  # table names of this run's own, in a database that may be shared
sizes = {f"clicks_{run}": 300, f"views_{run}": 700}
metadata = sa.MetaData()
tables = [sa.Table(name, metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("name", sa.Text),
                   sa.Column("score", sa.Float)) for name in sizes]
engine = sa.create_engine(url)
with engine.begin() as c:
    metadata.create_all(c)
    for table in tables:
        c.execute(table.insert(), [{"id": i, "name": f"{table.name}-user-{i}", "score": i / 10}
                                   for i in range(sizes[table.name])])
odps_path1, odps_path2 = (f"table:{name}" for name in sizes)
num_workers = 1
records = []


def clean_up_at_exit():
    """$WQ_SQL_URL may name a shared database: leave nothing there, also after an error. The queue
    is this run's own: its works are this run's tables, so a queue of the same name from elsewhere
    would have been refused, not joined."""
    if "work_queue" in globals():
        work_queue.close()
        wq_sql.drop_queue(work_queue.name)
    metadata.drop_all(engine)
    engine.dispose()


atexit.register(clean_up_at_exit)

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

# ---- every row of both tables exactly once, as "id,name,score" strings
print(f"items per epoch: {work_queue.items_per_epoch}")
print(f"records: {len(records)}")
expected = sorted(f"{i},{t}-user-{i},{i / 10}".encode() for t, n in sizes.items() for i in range(n))
print(f"every row exactly once: {sorted(records) == expected}")
