"""The resume bugs users report in training data loaders, each as a test of wq_sql.tf with
``consumed="checkpoint"``, on every backend: real training processes (``ckpt_worker.py``) that
SIGKILL themselves at the step each bug needs and are restarted from a
``tf.train.CheckpointManager`` checkpoint (``wq.checkpoint_manager``).

The model counts how often it trained on each record (saved in the checkpoint), so the final
counts say what the restored checkpoints plus the training after each restart saw. With the
``tf.data`` iterator in the checkpoint (a TF2 loop), every record exactly once per epoch, but
for hand-outs that overlapped an iterator's serialization (the documented exception, counted
from ``wq_checkpoints``); with Keras ``model.fit`` (the iterator not in the checkpoint), at least
once, duplicates within the read-ahead bound. A batch is one file (10 lines), so a step is an
item, and an epoch is 6 items (steps 1-6 of the first pass are epoch 0)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ckpt_support import CKPT_WORKER, LINES_PER_FILE, base_job, check_queue, rows, train
from procwatch import child_env

FILES = 6  # items per epoch


def job_for(url: str, tmp: Path, mode: str, queue: str, epochs: int, **changes: Any) -> dict[str, Any]:
    job = base_job(url, tmp, mode, FILES)
    return {**job, "queue": queue, "num_epochs": epochs, "batch": LINES_PER_FILE, **changes}


def missed(counts: list[list[int]]) -> list[list[int]]:
    """Per Keras epoch, the files (items) with a record it did not train."""
    return [sorted({r // LINES_PER_FILE for r, c in enumerate(epoch) if c == 0}) for epoch in counts]


def exactly_once(url: str, job: dict[str, Any], final: dict[str, Any], files: int = FILES) -> tuple[int, int]:
    """Every record trained ``num_epochs`` times by the final model, but for the records of
    hand-outs that overlapped a restored save's iterator serialization (each may be twice).
    Returns (records trained again, the bound)."""
    epochs = job["num_epochs"]
    saves = check_queue(url, job["queue"], files * epochs)
    counts = final["counts"]
    assert min(counts) == epochs, f"records lost: {[i for i, c in enumerate(counts) if c < epochs]}"
    restored = [step for action, step, _, _ in saves if action == "restore" and step is not None]
    ambiguous = sum(a for action, step, _, a in saves if action == "save" and step in restored)
    again = sum(c - epochs for c in counts)
    assert again <= ambiguous * LINES_PER_FILE, (counts, saves)
    return again, ambiguous * LINES_PER_FILE


def test_resume_twice_in_a_row_and_from_a_resumed_runs_checkpoint(db_url: str, tmp_path: Path) -> None:
    """huggingface/datasets#8308: resuming a second time, from a resumed run, skipped or repeated
    data. Checkpoints every 2 steps; killed at step 5 (restored: 4), then at step 9 (restored:
    8, a checkpoint the resumed run wrote), then to the end of 2 epochs."""
    job = job_for(db_url, tmp_path, "iterator", "twice", 2, save_every=2)
    train(job, kill_at=5)
    train(job, kill_at=9)
    final = train(job)
    exactly_once(db_url, job, final)
    saves = check_queue(db_url, "twice", 2 * FILES)
    assert [s for a, s, _, _ in saves if a == "restore"] == [None, 4, 8]


@pytest.mark.parametrize("where", ["end", "start"])
def test_checkpoint_at_an_epoch_boundary_skips_no_epoch(db_url: str, tmp_path: Path, where: str) -> None:
    """volcengine/verl#7401: a checkpoint saved exactly at the end of an epoch made the resumed
    run skip the next epoch and exit 0. Saved at step 6, the last item of epoch 0 (``end``), or
    at step 7, the first of epoch 1 (``start``), killed right after; resumed: 3 epochs in all,
    each record of each once."""
    every = FILES if where == "end" else FILES + 1
    job = job_for(db_url, tmp_path, "iterator", f"boundary-{where}", 3, save_every=every)
    train(job, kill_at=every + 1)
    final = train(job)
    exactly_once(db_url, job, final)


def test_restoring_an_older_checkpoint_reopens_the_newer_ones_items(db_url: str, tmp_path: Path) -> None:
    """Restoring the checkpoint before the latest (the latest was bad, say): what the latest
    covered is pending again and trained again by the restored model, once."""
    job = job_for(db_url, tmp_path, "iterator", "older", 2, save_every=2)
    train(job, kill_at=9)  # checkpoints 2, 4, 6, 8
    final = train(job, restore="previous")  # 6
    exactly_once(db_url, job, final)
    saves = check_queue(db_url, "older", 2 * FILES)
    assert [s for a, s, _, _ in saves if a == "restore"] == [None, 6]


def test_keras_epochs_are_queue_epochs(db_url: str, tmp_path: Path) -> None:
    """``model.fit(ds, epochs=3)`` over ``TextLineDataset(wq.input_dataset(epochs="each"))`` of a
    3-epoch queue: Keras epoch k trains queue epoch k, every record once in each (with
    ``epochs="all"``, DeepRec's one pass, Keras epoch 0 would train all three and epochs 1 and
    2 nothing)."""
    job = job_for(db_url, tmp_path, "fit", "keras", 3, save_every=4, keras_epochs=True)
    final = train(job)
    assert final["start"] == 0  # (Keras counts one step more per epoch of unknown cardinality)
    assert final["counts"] == [[1] * (FILES * LINES_PER_FILE)] * 3
    check_queue(db_url, "keras", 3 * FILES)


def test_keras_epochs_resume_at_the_restored_epoch(db_url: str, tmp_path: Path) -> None:
    """Keras with one queue epoch per Keras epoch, killed in epoch 1 (step 9; checkpoints every 4
    steps and at each epoch's end) and resumed with ``initial_epoch=wq.resume_epoch()``: the
    resumed run starts at epoch 1, and every Keras epoch trains every record at least once,
    duplicates within the read-ahead bound."""
    job = job_for(db_url, tmp_path, "fit", "keras-resume", 3, save_every=4, keras_epochs=True)
    train(job, kill_at=9)
    final = train(job)
    assert final["start"] == 1
    counts, w = final["counts"], final["read_ahead"]
    if not all(min(epoch) >= 1 for epoch in counts):
        q = "keras-resume"
        history = rows(db_url, "SELECT event_id, epoch, seq, item_id, kind, worker, detail FROM wq_history "
                               "WHERE queue = :q ORDER BY event_id", q=q)
        saves = rows(db_url, "SELECT c.action, c.step, c.items, c.ambiguous FROM wq_checkpoints c JOIN "
                             "wq_queues q ON q.id = c.queue_id WHERE q.name = :q ORDER BY c.id", q=q)
        raise AssertionError("a Keras epoch missed records of its queue epoch: per Keras epoch, the files "
                             f"with a record never trained: {missed(counts)}; checkpoints: {saves}; "
                             "history:\n" + "\n".join(map(str, history)))
    assert sum(c - 1 for epoch in counts for c in epoch) <= w * LINES_PER_FILE
    check_queue(db_url, "keras-resume", 3 * FILES)


def test_trainer_killed_at_random_points_loses_nothing(db_url: str, tmp_path: Path) -> None:
    """A TF2 trainer (the iterator in the checkpoint, a checkpoint every 3 steps, the manager
    keeping 2) SIGKILLed from outside at random moments after it started training, ``KILLS``
    times (``$WQ_SQL_TEST_KILLS``; ``make stress`` runs 50), each time restarted from its latest
    checkpoint: every record of every epoch trained once by the final model, but for hand-outs
    that overlapped a restored save's iterator serialization. (Killed while the manager was
    recording a checkpoint, after its files were written, the queue had been told: restoring
    it must not hand its items out again.)"""
    kills = int(os.environ.get("WQ_SQL_TEST_KILLS", "3"))
    rng = random.Random(int(os.environ.get("WQ_SQL_TEST_SEED", "35")))
    job = {**job_for(db_url, tmp_path, "iterator", "random", 2 + kills, save_every=3), "pause": 0.03,
           "max_to_keep": 2, "ready": str(tmp_path / "ready")}
    job = {**job, **{k: v for k, v in base_job(db_url, tmp_path / "big", "iterator", 30).items()
                     if k in ("files", "n_records")}}
    for k in range(kills):
        p = subprocess.Popen([sys.executable, str(CKPT_WORKER), json.dumps(job)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True)
        deadline = time.monotonic() + 120
        while len(Path(job["ready"]).read_text().splitlines() if Path(job["ready"]).exists() else []) <= k:
            assert p.poll() is None, p.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5))  # anywhere: reading, training, saving, covering
        assert p.poll() is None, f"finished after {k} kills: give it more data"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    final = train(job)
    again, bound = exactly_once(db_url, {**job, "num_epochs": 2 + kills}, final, files=30)
    print(f"\n{kills} kills: {again} records trained again by the final model (bound {bound}), "
          f"{30 * LINES_PER_FILE * (2 + kills)} records")
