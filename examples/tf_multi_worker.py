"""Several worker processes, each a TensorFlow input pipeline, sharing one wq_sql queue.

    python examples/tf_multi_worker.py                  # 3 workers on a fresh SQLite file
    WQ_SQL_URL=postgresql://user@host/db python examples/tf_multi_worker.py

Each worker runs ``tf.data.TextLineDataset(work_queue.input_dataset())`` on the same list of
files; the queue hands each file to exactly one of them, the faster workers taking more (worker
``i`` pauses ``i * 10`` ms per batch, like a slower machine). At the end the script prints what
each worker read and checks, from the files and from the queue's own audit trail (the
``wq_history`` view), that every line was read exactly once and every item done exactly once.
On a cluster, each machine runs the worker part with the same file list and ``WQ_SQL_URL``.
The queue has a fresh name in the database and is dropped at the end, also after an error.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

import wq_sql

N_WORKERS, N_FILES, NUM_EPOCHS = 3, 24, 2


def worker(index: int, tmp: str, url: str, queue: str) -> None:
    """One worker process: an ordinary TF2 input pipeline fed by the shared queue."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from wq_sql.tf import WorkQueue

    paths = sorted(str(p) for p in Path(tmp, "data").iterdir())
    work_queue = WorkQueue(paths, num_epochs=NUM_EPOCHS, name=queue, url=url, worker=f"worker:{index}")
    dataset = tf.data.TextLineDataset(work_queue.input_dataset()).batch(8).prefetch(1)

    # Start together, so that the workers really share the queue.
    Path(tmp, f"ready-{index}").touch()
    while len(list(Path(tmp).glob("ready-*"))) < N_WORKERS:
        time.sleep(0.05)

    lines = []
    for batch in dataset:  # ends when every item of every epoch is done
        lines.extend(line.decode() for line in batch.numpy())
        time.sleep(0.01 * index)
    work_queue.close()
    Path(tmp, f"result-{index}.json").write_text(json.dumps({"files": work_queue.taken, "lines": lines}))


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="wq_sql_tf_multi_worker_")
    url = os.environ.get("WQ_SQL_URL") or f"sqlite:///{tmp}/wq.db"
    queue = f"tf_multi_worker_{uuid.uuid4().hex[:8]}"  # a fresh queue in a shared database
    Path(tmp, "data").mkdir()
    expected = []
    for i in range(N_FILES):
        lines = [f"file {i:02d} line {j:02d}" for j in range(10 + i % 7)]
        Path(tmp, "data", f"part-{i:02d}.txt").write_text("\n".join(lines) + "\n")
        expected += lines * NUM_EPOCHS

    try:
        run_workers(tmp, url, queue)
        check(tmp, url, queue, expected)
    finally:
        wq_sql.drop_queue(queue, url)  # a shared database keeps no trace of this run, also after an error


def run_workers(tmp: str, url: str, queue: str) -> None:
    """Start the workers and wait for all of them; if one fails, stop the others (which would
    otherwise wait for it at the start line) and say so."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), tmp, url, queue])
             for i in range(N_WORKERS)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise SystemExit(f"worker:{failed[0]} failed (exit code {codes[failed[0]]}); "
                                 "see its traceback above")
            if None not in codes:
                return
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def check(tmp: str, url: str, queue: str, expected: list[str]) -> None:
    """What each worker read, and whether the files and the queue's audit trail agree."""
    got = []
    for i in range(N_WORKERS):
        result = json.loads(Path(tmp, f"result-{i}.json").read_text())
        print(f"worker:{i} files {result['files']} lines {len(result['lines'])}")
        got += result["lines"]
    print(f"files: {N_FILES} x {NUM_EPOCHS} epochs, lines read: {len(got)}")
    print(f"every line exactly once per epoch: {sorted(got) == sorted(expected)}")

    # Plain SQLAlchemy on the same URL as the workers: any SQL client can audit the queue.
    engine = sa.create_engine(url)
    with engine.connect() as c:
        twice = c.execute(sa.text(
            "SELECT epoch, seq FROM wq_history WHERE queue = :q AND kind = 'done' "
            "GROUP BY epoch, seq HAVING count(*) <> 1"), {"q": queue}).all()
        done = c.execute(sa.text("SELECT count(*) FROM wq_audit WHERE queue = :q AND state = 'done'"),
                         {"q": queue}).scalar_one()
    engine.dispose()
    print(f"every item done exactly once (wq_history): {not twice and done == N_FILES * NUM_EPOCHS}")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), *sys.argv[3:6])
    else:
        main()
