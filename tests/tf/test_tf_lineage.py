"""Lineage in the TensorFlow shim: every step of every worker's ``wq.batches(...)`` maps, through
``wq-sql trace``, to exactly the records its loop received; ``replay_dataset`` feeds a worker's
batches again, record for record; the loop's wait inside ``get_next`` is what the worker
reports; bad input gets one clear error."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import tensorflow as tf
from tf_support import finish_worker, start_worker, write_text_files

from wq_sql import InvalidInput
from wq_sql.cli import main as cli
from wq_sql.tf import WorkQueue, replay_dataset


def traced_json(url: str, *args: str) -> list[dict[str, Any]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["--url", url, "trace", *args, "--format", "json"]) == 0
    return json.loads(out.getvalue())


def decoded(batch: Any) -> list[str]:
    return [x.decode("utf-8") for x in batch.numpy().tolist()]


def test_every_step_of_two_workers_traces_to_the_logged_records(db_url: str, tmp_path: Path) -> None:
    """Two worker processes, 2 epochs of 200 files of 1 to 9 lines, batches of 2 (batches
    straddle items), one worker reading 2 items at a time: about 1,000 steps in all. Each
    worker's step k (the k-th batch its loop received) is, through ``wq-sql trace``, exactly its
    logged records; replaying steps [120, 140) of a worker gives its logged batches."""
    paths, _ = write_text_files(tmp_path / "data", [1 + i % 9 for i in range(200)])
    content = {p: Path(p).read_text(encoding="utf-8").splitlines() for p in paths}
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    jobs = [{"mode": "lineage", "files": paths, "num_epochs": 2, "queue": "lin", "url": db_url,
             "worker": f"w{r}", "batch_size": 2, "interleave": 1 + r, "barrier": str(barrier), "n_workers": 2,
             "pause": 0.0 if r == 0 else 0.001} for r in range(2)]
    logs = [finish_worker(p, timeout=300)["steps"] for p in [start_worker(j) for j in jobs]]
    total = sum(len(s) for s in logs)
    assert total >= 950 and all(logs), [len(s) for s in logs]
    assert sorted(x for s in logs for b in s for x in b) == sorted(2 * [x for p in paths for x in content[p]])
    for r in range(2):
        rows = traced_json(db_url, "lin", "--step", "0", "--to", str(len(logs[r]) - 1), "--worker", f"w{r}")
        per_step: dict[int, list[str]] = {}
        for t in rows:
            assert t["run"] == 1
            per_step.setdefault(int(t["step"]), []).extend(
                content[str(t["work"])][int(t["first_record"]):int(t["last_record"]) + 1])
        assert sorted(per_step) == list(range(len(logs[r]))), f"worker {r}: steps without lineage"
        bad = [k for k, b in enumerate(logs[r]) if per_step[k] != b]
        assert not bad, (r, bad[:5], [(per_step[k], logs[r][k]) for k in bad[:2]])
    # The worker that trained more (how the two split the ~1,000 steps depends on the machine).
    r = max(range(2), key=lambda k: len(logs[k]))
    replay = replay_dataset("lin", url=db_url, worker=f"w{r}", steps=range(120, 140),
                            read=tf.data.TextLineDataset)
    assert [decoded(b) for b in replay] == logs[r][120:140]


def test_keras_fit_records_each_step(db_url: str, tmp_path: Path) -> None:
    """``model.fit`` on ``wq.batches(...)`` with a parsing ``map_fn``: one lineage step per batch
    Keras trained, each the records of that batch; the replay gives the same features."""
    paths, _ = write_text_files(tmp_path / "data", [7] * 12)
    content = {p: Path(p).read_text(encoding="utf-8").splitlines() for p in paths}

    def parse(line: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        value = tf.strings.to_number(tf.strings.split(line)[-1], tf.float32)
        return tf.reshape(value / 1000.0, [1]), tf.reshape(value, [1])

    wq = WorkQueue(paths, url=db_url, worker="keras", lineage=True, name="fit")
    ds = wq.batches(tf.data.TextLineDataset, 8, map_fn=parse)
    seen: list[int] = []

    class Count(tf.keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append(batch)

    model = tf.keras.Sequential([tf.keras.Input(shape=(1,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(ds, epochs=1, verbose=0, callbacks=[Count()])
    wq.close()
    assert len(seen) == 11  # 84 lines in batches of 8
    rows = traced_json(db_url, "fit", "--step", "0", "--to", "10", "--worker", "keras")
    assert sorted({int(t["step"]) for t in rows}) == list(range(11))
    traced = [line for t in rows for line in content[str(t["work"])][t["first_record"]:t["last_record"] + 1]]
    assert sorted(traced) == sorted(x for p in paths for x in content[p])
    replay = replay_dataset("fit", url=db_url, worker="keras", steps=range(0, 11),
                            read=tf.data.TextLineDataset, map_fn=parse)
    ys = [float(v) for _, y in replay for v in y.numpy().ravel()]
    assert ys == [float(line.split()[-1]) for line in traced]


def test_the_input_wait_is_the_loops_own(db_url: str, tmp_path: Path) -> None:
    """A deliberately slow reader (20 ms per record, batches of 2): the wait the worker reports
    (in memory and, after close, in ``wq_workers``) agrees with the loop's own measurement of
    its ``next`` within 10%."""
    paths, _ = write_text_files(tmp_path / "data", [3] * 8)

    def slow(line: tf.Tensor) -> tf.Tensor:
        def sleep(x: Any) -> Any:
            time.sleep(0.02)
            return x
        out = tf.numpy_function(sleep, [line], tf.string, stateful=True)
        out.set_shape([])
        return out

    wq = WorkQueue(paths, url=db_url, worker="slow", name="wait")
    ds = wq.batches(tf.data.TextLineDataset, 2, map_fn=slow, num_parallel_calls=None, prefetch=1)
    it = iter(ds)
    own = 0.0
    n = 0
    while True:
        t = time.monotonic()
        try:
            next(it)
        except StopIteration:
            break
        own += time.monotonic() - t
        n += 1
        time.sleep(0.01)  # the "model step"
    wq.close()
    assert n == 12
    assert own > 0.3, own
    reported = wq.queue.input_wait
    assert reported is not None and abs(reported - own) <= 0.1 * own, (reported, own)
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as c:
            stored = c.execute(sa.text("SELECT input_wait FROM wq_workers WHERE name = 'slow'")).scalar()
    finally:
        engine.dispose()
    assert stored is not None and abs(float(stored) - own) <= 0.1 * own, (stored, own)


def test_what_lineage_does_not_hold_is_said(db_url: str, tmp_path: Path) -> None:
    paths, _ = write_text_files(tmp_path / "data", [4] * 6)
    plain = WorkQueue(paths, url=db_url, worker="r", name="plain")
    assert sum(1 for _ in plain.batches(tf.data.TextLineDataset, 4)) == 6
    plain.close()
    with pytest.raises(InvalidInput, match="holds no lineage: train with lineage=True"):
        replay_dataset("plain", url=db_url, worker="r", steps=range(0, 2), read=tf.data.TextLineDataset)
    wq = WorkQueue(paths, url=db_url, worker="r", name="rec", lineage=True)
    assert sum(1 for _ in wq.batches(tf.data.TextLineDataset, 4)) == 6
    wq.close()
    with pytest.raises(InvalidInput, match=r"steps 6, 7 of worker 'r' .* no lineage"):
        replay_dataset("rec", url=db_url, worker="r", steps=range(4, 8), read=tf.data.TextLineDataset)
    with pytest.raises(InvalidInput, match=r"worker 'x' recorded no lineage .* workers with lineage: r"):
        replay_dataset("rec", url=db_url, worker="x", steps=range(0, 2), read=tf.data.TextLineDataset)
    with pytest.raises(InvalidInput, match="read must be a function"):
        replay_dataset("rec", url=db_url, worker="r", steps=range(0, 2), read="lines")
    short = replay_dataset("rec", url=db_url, worker="r", steps=range(0, 6),
                           read=lambda work: tf.data.TextLineDataset(work).take(1))
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs the same reader and unchanged data"):
        list(short)
    again = WorkQueue.attach("rec", url=db_url, worker="r2", lineage=True)
    for bad, match in (({"batch_size": 0}, "batch_size must be a whole number >= 1"),
                       ({"interleave": 0}, "interleave must be a whole number >= 1"),
                       ({"first_step": -1}, "first_step must be a whole number >= 0")):
        with pytest.raises(InvalidInput, match=match):
            again.batches(tf.data.TextLineDataset, **{"batch_size": 4, **bad})
    with pytest.raises(InvalidInput, match="read must be a function"):
        again.batches(None, 4)  # type: ignore[arg-type]
    again.close()
    with pytest.raises(ValueError, match="lineage must be True or False"):
        WorkQueue(paths, url=db_url, worker="r3", name="rec", lineage="yes")  # type: ignore[arg-type]


def test_first_step_begins_a_new_run(db_url: str, tmp_path: Path) -> None:
    """After a restore the loop numbers its batches from the restored step: ``first_step`` does
    that in a new run, so the abandoned steps' lineage stays readable under its own run."""
    paths, _ = write_text_files(tmp_path / "data", [4] * 4)
    wq = WorkQueue(paths, num_epochs=2, url=db_url, worker="r", name="runs", lineage=True)
    first = [decoded(b) for b in wq.batches(tf.data.TextLineDataset, 4, epochs="each")]  # epoch 0
    wq.close()
    again = WorkQueue.attach("runs", url=db_url, worker="r", lineage=True)  # a restored process
    second = [decoded(b) for b in again.batches(tf.data.TextLineDataset, 4, epochs="each", first_step=2)]
    again.close()
    assert len(first) == len(second) == 4
    latest = traced_json(db_url, "runs", "--step", "2", "--worker", "r")
    assert {t["run"] for t in latest} == {2}
    old = traced_json(db_url, "runs", "--step", "2", "--worker", "r", "--run", "1")
    content = {p: Path(p).read_text(encoding="utf-8").splitlines() for p in paths}

    def records(rows: list[dict[str, Any]]) -> list[str]:
        return [x for t in rows for x in content[t["work"]][t["first_record"]:t["last_record"] + 1]]
    assert records(old) == first[2]
    assert records(latest) == second[0]


def test_checkpoint_mode_traces_what_a_checkpoint_covered(db_url: str, tmp_path: Path) -> None:
    """``consumed="checkpoint"`` with lineage: a save covers the items handed out to the
    pipeline before it (the iterator in the checkpoint holds the rest of their records), and
    ``wq-sql trace --checkpoint S`` lists every step that trained them, each step's records as
    the loop received them."""
    paths, _ = write_text_files(tmp_path / "data", [6] * 8)
    content = {p: Path(p).read_text(encoding="utf-8").splitlines() for p in paths}
    wq = WorkQueue(paths, url=db_url, worker="ck", name="ckq", consumed="checkpoint", lineage=True)
    ds = wq.batches(tf.data.TextLineDataset, 4)
    it = iter(ds)
    ckpt = tf.train.Checkpoint(iterator=it)
    manager = wq.checkpoint_manager(ckpt, str(tmp_path / "ckpt"))
    manager.restore_or_initialize()
    logged = [decoded(next(it)) for _ in range(6)]  # 24 lines: the first 4 files
    manager.save(checkpoint_number=6)
    logged += [decoded(b) for b in it]
    manager.save(checkpoint_number=len(logged))
    wq.close()
    rows = traced_json(db_url, "ckq", "--checkpoint", "6")
    assert rows, "checkpoint 6 covered no item with lineage"
    steps = sorted({int(t["step"]) for t in rows})
    assert steps[0] == 0 and set(range(6)) <= set(steps), steps  # the steps before the save
    for k in steps:
        mine = [t for t in rows if int(t["step"]) == k]
        assert {t["checkpoint"] for t in mine} == {6}
        got = [x for t in mine for x in content[str(t["work"])][t["first_record"]:t["last_record"] + 1]]
        assert set(got) <= set(logged[k]), (k, got, logged[k])
    every = traced_json(db_url, "ckq", "--step", "0", "--to", str(len(logged) - 1), "--worker", "ck")
    assert {t["checkpoint"] for t in every} <= {6, len(logged)}
