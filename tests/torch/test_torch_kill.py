"""A trainer with checkpoint-consistent resume (``consumed="checkpoint"``, DataLoader
``num_workers=2``) SIGKILLed at random points, ``KILLS`` times per backend, each time restarted
from its last checkpoint: no record lost, and records trained again only of items that no
checkpoint covered at the kill (checked against the trainer's own log and the SQL audit)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from procwatch import child_env, run_all
from torch_support import HERE, read_log, sql, write_files

TRAINER = HERE / "torch_ckpt_trainer.py"
KILLS = int(os.environ.get("WQ_SQL_TEST_KILLS", "10"))
EPOCHS = max(2, KILLS // 4)  # enough training for every kill to land before the end
WORKERS = 2  # DataLoader worker processes: at most one item each straddles a save
LINES = 6


def item_of(record: str) -> tuple[int, str]:
    """``f0012-003@e1`` -> (epoch 1, ``part-0012.txt``)."""
    line, epoch = record.split("@e")
    return int(epoch), f"part-{line[1:5]}.txt"


def test_trainer_killed_at_random_points_loses_nothing(db_url: str, tmp_path: Path) -> None:
    files, lines = write_files(tmp_path / "data", 120, LINES)
    log = tmp_path / "log"
    job = {"url": db_url, "queue": "kill", "files": files, "num_epochs": EPOCHS, "num_workers": WORKERS,
           "batch_size": 4, "every": 5, "step_seconds": 0.02, "log": str(log),
           "ckpt": str(tmp_path / "ckpt.pt"),
           # every crash counts an attempt on what the trainer held; long leases: only the
           # restarted identities bring items back
           "options": {"max_attempts": 1000, "heartbeat_seconds": 2, "lease_seconds": 60}}
    cmd = [sys.executable, str(TRAINER), json.dumps(job)]
    rng = random.Random(int(os.environ.get("WQ_SQL_TEST_SEED", "18")))
    kills: list[set[tuple[int, str]]] = []  # the items done (covered by a checkpoint) at each kill
    for k in range(KILLS):
        with open(tmp_path / f"out{k}", "w") as out:
            p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                 start_new_session=True)
        deadline = time.monotonic() + 120
        while sum("restored" in e for e in read_log(log)) <= k:
            assert p.poll() is None, (tmp_path / f"out{k}").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer did not start"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.2))  # anywhere: restoring, reading, training, saving, covering
        assert p.poll() is None, f"finished after {k} kills: give it more data"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(0.1)  # its DataLoader workers, in the same process group, are gone too
        kills.append({(e, Path(w).name) for e, w in sql(
            db_url, "SELECT epoch, work FROM wq_audit WHERE queue = 'kill' AND state = 'done'")})
    final = run_all([cmd], hang=180, env={"PYTHONPATH": str(HERE.parent.parent)})[0]
    assert final.returncode == 0, final.stderr[-5000:]

    # The runs, as the trainer logged them: what each restored, trained and saved.
    runs: list[dict[str, Any]] = []
    for entry in read_log(log):
        if "restored" in entry:
            runs.append({"restored": entry["restored"], "batches": []})
        elif "records" in entry:
            runs[-1]["batches"].append((entry["step"], entry["records"]))
    assert len(runs) == KILLS + 1

    # The model's timeline: each run's batches up to the step the next run restored.
    timeline: Counter[str] = Counter()
    raw: Counter[str] = Counter()
    restores = sum(1 for run in runs[1:] if run["restored"])
    for k, run in enumerate(runs):
        upto = runs[k + 1]["restored"] if k + 1 < len(runs) else None
        for step, records in run["batches"]:
            raw.update(records)
            if upto is None or step <= upto:
                timeline.update(records)
        if k < KILLS:
            # After kill k, an item a checkpoint covered is never trained again: records trained
            # twice are of items the last checkpoint did not cover.
            later = {item_of(r) for run2 in runs[k + 1:] for _, records in run2["batches"] for r in records}
            assert not (later & kills[k]), sorted(later & kills[k])[:5]

    expected = Counter(f"{line}@e{e}" for e in range(EPOCHS) for line in lines)
    assert set(timeline) == set(expected), "records lost for the model"
    assert set(raw) == set(expected)
    # What the restored models saw twice: only the items that straddled a restored save (their
    # first records before it, their last after it), at most one per DataLoader worker.
    twice = {item_of(r) for r, n in timeline.items() if n > 1}
    assert len(twice) <= WORKERS * restores, (sorted(twice), restores)

    # SQL: every item done once, by a checkpoint; the crashes were recoveries, never a loss.
    rows = sql(db_url, "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = 'kill' "
                       "GROUP BY epoch, state")
    assert sorted(tuple(r) for r in rows) == [(e, "done", 120) for e in range(EPOCHS)]
    assert sql(db_url, "SELECT count(*) FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                       "WHERE q.name = 'kill' AND i.ckpt_step IS NULL") == [(0,)]
    once = sql(db_url, "SELECT epoch, seq, count(*) FROM wq_history WHERE queue = 'kill' AND kind = 'done' "
                       "GROUP BY epoch, seq HAVING count(*) <> 1")
    assert once == []
    print(f"\n{KILLS} kills: {sum(raw.values())} records trained for {len(expected)} "
          f"({sum(raw.values()) - len(expected)} again, {sum(timeline.values()) - len(expected)} of them "
          f"in the restored models' timeline: {len(twice)} items, bound {WORKERS} x {restores} restores)")
