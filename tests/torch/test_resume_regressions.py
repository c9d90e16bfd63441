"""The resume bugs users report in training data loaders, each as a test of wq_sql.torch with
``consumed="checkpoint"`` (and, where a run without checkpoint consistency can show the bug,
with the default ``consumed="trained"``), on every backend.

A real trainer (``torch_ckpt_trainer.py``: a model, an optimizer, ``wq_sql.torch.DataLoader``,
``torch.save`` of the model with ``loader.state_dict()``) is SIGKILLed with its DataLoader
workers at the point each bug needs and resumed from its checkpoint, as a job restarts. Files
have as many lines as a batch, so every batch is one whole item and no item straddles a save:
the final model must have seen every record of every epoch exactly once
(``resume.exact``, from the trainers' own logs), and the SQL audit must agree (every item done
once since its last re-open, each by a checkpoint)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from procwatch import child_env, run_all
from resume import exact, read_runs
from torch_support import (  # noqa: F401 - close_datasets: an autouse fixture
    HERE,
    close_datasets,
    finish,
    kill_ranks_when,
    read_log,
    sql,
    start_rank,
    write_files,
)

TRAINER = HERE / "torch_ckpt_trainer.py"
LINES = 4  # lines per file = batch size: a batch is one item
FILES = 20  # items per epoch


def job_for(url: str, tmp: Path, queue: str, epochs: int, **changes: Any) -> dict[str, Any]:
    files, _ = write_files(tmp / "data", FILES, LINES)
    return {"url": url, "queue": queue, "files": files, "num_epochs": epochs, "num_workers": 2,
            "batch_size": LINES, "every": 5, "log": str(tmp / "log"), "ckpt": str(tmp / "ckpt.pt"),
            # every kill counts an attempt on what the trainer held; long leases: only the
            # restarted identity brings items back
            "options": {"max_attempts": 1000, "heartbeat_seconds": 2, "lease_seconds": 60}, **changes}


def run(job: dict[str, Any], killed: bool, **changes: Any) -> None:
    """One trainer process to its end, or to the kill it was told to do to itself."""
    job = {**job, **changes}
    done = run_all([[sys.executable, str(TRAINER), json.dumps(job)]], hang=240, env=child_env())[0]
    if killed:
        assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-4000:])
    else:
        assert done.returncode == 0, done.stderr[-4000:]


def expected(epochs: int) -> Counter[str]:
    return Counter(f"f{i:04d}-{j:03d}@e{e}"
                   for e in range(epochs) for i in range(FILES) for j in range(LINES))


def audit(url: str, queue: str, epochs: int) -> None:
    """Every item of every epoch done, once since its last re-open, stamped with a checkpoint step."""
    rows = sql(url, "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = :q GROUP BY epoch, state",
               q=queue)
    assert sorted(tuple(r) for r in rows) == [(e, "done", FILES) for e in range(epochs)], rows
    again = sql(url, """
        SELECT h.item_id, count(*) FROM wq_history h
        WHERE h.queue = :q AND h.kind = 'done' AND h.event_id > coalesce(
            (SELECT max(r.event_id) FROM wq_history r WHERE r.item_id = h.item_id AND r.kind = 'requeue'), 0)
        GROUP BY h.item_id HAVING count(*) <> 1""", q=queue)
    assert again == []
    assert sql(url, "SELECT count(*) FROM wq_items i JOIN wq_queues q ON q.id = i.queue_id "
                    "WHERE q.name = :q AND i.ckpt_step IS NULL", q=queue) == [(0,)]


def check(job: dict[str, Any], epochs: int) -> list[Any]:
    """``consumed="checkpoint"``: the final model saw every record once, and the audit agrees.
    The default, ``consumed="trained"`` (done once trained, whatever the checkpoint): every
    record trained by some run, and every item done exactly once."""
    runs = read_runs(Path(job["log"]), job["ckpt"])
    if job.get("consumed", "checkpoint") == "checkpoint":
        exact(runs, expected(epochs))
        audit(job["url"], job["queue"], epochs)
        return runs
    trained = {r for run in runs for _, records in run.batches for r in records}
    assert trained == set(expected(epochs)), f"{len(set(expected(epochs)) - trained)} record(s) never trained"
    rows = sql(job["url"], "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = :q "
                           "GROUP BY epoch, state", q=job["queue"])
    assert sorted(tuple(r) for r in rows) == [(e, "done", FILES) for e in range(epochs)], rows
    assert sql(job["url"], "SELECT epoch, seq FROM wq_history WHERE queue = :q AND kind = 'done' "
                           "GROUP BY epoch, seq HAVING count(*) <> 1", q=job["queue"]) == []
    return runs


@pytest.mark.parametrize("consumed", ["checkpoint", "trained"])
def test_resume_twice_in_a_row_neither_skips_nor_repeats(db_url: str, tmp_path: Path, consumed: str) -> None:
    """huggingface/datasets#8308: resuming a second time, from a resumed run, skipped or repeated
    data. Run, killed right after its save at step 10; resumed, killed right after its save at
    step 25 (a checkpoint written by a resumed run); resumed again to the end."""
    job = job_for(db_url, tmp_path, "twice", 2, consumed=consumed)
    run(job, True, kill_after_save=10)
    run(job, True, kill_after_save=25)
    run(job, False)
    runs = check(job, 2)
    assert [r.restored for r in runs] == [0, 10, 25]


def test_resume_from_a_resumed_runs_checkpoint_between_saves(db_url: str, tmp_path: Path) -> None:
    """huggingface/datasets#8308, the other half: the resumed run is killed between two saves
    (its last checkpoint is its own, steps it trained after it are thrown away) and the next run
    restores that checkpoint: the thrown-away steps' records are trained again, nothing else."""
    job = job_for(db_url, tmp_path, "resumed", 2)
    run(job, True, kill_at=12)
    run(job, True, kill_at=28)
    run(job, False)
    runs = check(job, 2)
    assert [r.restored for r in runs] == [0, 10, 25]


@pytest.mark.parametrize("consumed", ["checkpoint", "trained"])
@pytest.mark.parametrize("where", ["pass_end", "last_step"])
def test_checkpoint_at_the_end_of_an_epoch_skips_no_epoch(db_url: str, tmp_path: Path, where: str,
                                                         consumed: str) -> None:
    """volcengine/verl#7401: a checkpoint saved exactly at the end of an epoch made the resumed
    run skip the next epoch and exit 0. Killed right after the save that ends epoch 0's pass
    (``pass_end``), or right after a periodic save at the epoch's last batch, its pass not yet
    over (``last_step``, step 20 of 20); resumed: epochs 1 and 2 are trained, each once."""
    job = job_for(db_url, tmp_path, f"end-{where}", 3, every=10, consumed=consumed)
    if where == "pass_end":
        run(job, True, kill_after_pass=0)
    else:
        run(job, True, kill_after_save=FILES)
    run(job, False)
    runs = check(job, 3)
    assert runs[1].restored == FILES


@pytest.mark.parametrize("where", ["before_first_batch", "after_first_batch"])
def test_checkpoint_at_the_start_of_an_epoch_skips_no_epoch(db_url: str, tmp_path: Path, where: str) -> None:
    """volcengine/verl#7401, the other side of the boundary: the checkpoint is saved right before
    epoch 1's pass begins (``before_first_batch``), or after its first batch (step 21); killed
    then, resumed: the rest of epoch 1, then epoch 2, each record once."""
    if where == "before_first_batch":
        job = job_for(db_url, tmp_path, "start-before", 3, every=1000, save_at_pass_start=True)
        run(job, True, kill_at_pass_start=1)
    else:
        job = job_for(db_url, tmp_path, "start-after", 3, every=FILES + 1)
        run(job, True, kill_after_save=FILES + 1)
    run(job, False)
    check(job, 3)


@pytest.mark.parametrize("consumed", ["checkpoint", "trained"])
def test_persistent_workers_keep_the_restored_position(db_url: str, tmp_path: Path, consumed: str) -> None:
    """huggingface/datasets#7447: with ``persistent_workers=True`` the restored position was lost.
    Three epochs through persistent DataLoader workers, killed in epoch 1 right after a save,
    resumed with persistent workers again, then killed in epoch 2 and resumed."""
    job = job_for(db_url, tmp_path, "persistent", 3, persistent_workers=True, consumed=consumed)
    run(job, True, kill_after_save=25)
    run(job, True, kill_after_save=50)
    run(job, False)
    check(job, 3)


@pytest.mark.parametrize("consumed", ["checkpoint", "trained"])
def test_resume_with_another_num_workers(db_url: str, tmp_path: Path, consumed: str) -> None:
    """pytorch/data#1437: a StatefulDataLoader restored with another ``num_workers`` lost its
    place. ``num_workers`` 0, then 2, then 1, each run killed right after a save."""
    job = job_for(db_url, tmp_path, "workers", 2, num_workers=0, consumed=consumed)
    run(job, True, kill_after_save=10)
    run(job, True, kill_after_save=20, num_workers=2)
    run(job, False, num_workers=1)
    check(job, 2)


def test_restoring_an_older_checkpoint_reopens_the_newer_ones_items(db_url: str, tmp_path: Path) -> None:
    """Restoring a checkpoint older than the latest (the newest was bad, say): the items the
    newer checkpoints covered are pending again and trained again, by the restored model."""
    job = job_for(db_url, tmp_path, "older", 2, keep=True)
    run(job, True, kill_after_save=20)  # checkpoints at 5, 10, 15, 20 kept
    run(job, False, restore=f"{job['ckpt']}.step10")
    runs = check(job, 2)
    assert [r.restored for r in runs] == [0, 10]
    reopened = sql(db_url, "SELECT count(*) FROM wq_history WHERE queue = 'older' AND kind = 'requeue' "
                           "AND detail = 'model restored from checkpoint step 10'")
    # The save at 15 covered steps 11-15 (one item each); the kill came before the save at 20
    # was known to have been saved: its items were still held, and went back unreopened.
    assert reopened == [(5,)]


def start(job: dict[str, Any], rank: int, world: int, incarnation: int, run_id: str,
          restart: int) -> subprocess.Popen[str]:
    return start_rank({**job, "incarnation": incarnation}, rank, world, 0, run_id=run_id, restart=restart,
                      script=TRAINER)


def holding(log: Path, ranks: list[int], incarnation: int) -> bool:
    """Each of ``ranks`` logged, in this incarnation, that it holds (or is dying)."""
    def held(r: int) -> bool:
        entries = read_log(Path(f"{log}.rank{r}"))
        mine = [i for i, e in enumerate(entries) if e.get("incarnation") == incarnation]
        return bool(mine) and any("holding" in e or "dying" in e for e in entries[mine[-1]:])
    return all(held(r) for r in ranks)


def uneven_ranks_killed(url: str, tmp: Path, queue: str) -> tuple[dict[str, Any], Path, Path]:
    """A torchrun-style job of 2 ranks over 2 epochs of 40 files, one rank three times slower,
    killed once both hold (steps 32 and 12; their last saves, see :func:`last_saved`, are
    30 and 10, or the end of pass 0 when a rank's share of epoch 0 ended just after those): the
    job, its log and checkpoint paths (one of each per rank), for the next incarnations."""
    files, _ = write_files(tmp / "data", 40, LINES)
    log, ckpt = tmp / "log", tmp / "ckpt.pt"
    job = {"url": url, "queue": queue, "files": files, "num_epochs": 2, "num_workers": 2,
           "batch_size": LINES, "every": 5, "log": str(log), "ckpt": str(ckpt), "per_rank": True,
           "options": {"max_attempts": 1000, "heartbeat_seconds": 60, "lease_seconds": 300}}
    first = {**job, "hold_at": {"0": 32, "1": 12}, "step_seconds": {"0": 0.01, "1": 0.03}}
    kill_ranks_when([start(first, r, 2, 0, "job", 0) for r in (0, 1)], lambda: holding(log, [0, 1], 0),
                    "to their holds")
    return job, log, ckpt


def last_saved(log: Path, rank: int) -> int:
    """The step of the last save in rank ``rank``'s log (what its next incarnation restores):
    the saves come every 5 steps and at the end of each pass, and where pass 0 ends depends on
    how the ranks' speeds split epoch 0's items."""
    runs = read_runs(Path(f"{log}.rank{rank}"), "")
    return runs[-1].saves[-1]


def check_ranks(job: dict[str, Any], restored: list[tuple[int, str, int]]) -> None:
    """The runs of every rank were ``(incarnation, rank, step restored)``; the final model saw
    every record of both epochs once, and every item is done."""
    ranks = {name for _, name, _ in restored}
    runs = [run for name in sorted(ranks)
            for run in read_runs(Path(f"{job['log']}.{name}"), f"{job['ckpt']}.{name}")]
    assert sorted((r.incarnation, r.file[-5:], r.restored) for r in runs) == sorted(restored)
    exact(runs, Counter(f"f{i:04d}-{j:03d}@e{e}" for e in range(2) for i in range(40) for j in range(LINES)))
    rows = sql(job["url"], "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = :q "
                           "GROUP BY epoch, state", q=job["queue"])
    assert sorted(tuple(r) for r in rows) == [(0, "done", 40), (1, "done", 40)]


@pytest.mark.parametrize("run_ids", ["same", "new"])
def test_resume_with_another_world_size(db_url: str, tmp_path: Path, run_ids: str) -> None:
    """ray-project/ray#48224, pytorch/data#1437: a job restarted with another world size lost its
    place. A torchrun-style job of 2 ranks (one three times slower, so the ranks' steps differ:
    32 and 12 at the kill, last saves at 30 and 10) is killed; it restarts with 1 rank, which
    restores rank 0's state and, as ``departed=``, rank 1's; killed again, it restarts with 3
    ranks: rank 0 restores the 1-rank job's state, ranks 1 and 2 (no state in that checkpoint)
    start at its epoch. ``same``: one ``TORCHELASTIC_RUN_ID``, restart counts 0, 1, 2;
    ``new``: the 3-rank job runs under a new run id, and the 1-rank job is killed right after
    its save (so the items its state lists were never marked done by it). Every record once."""
    job, log, ckpt = uneven_ranks_killed(db_url, tmp_path, "world")
    saved = last_saved(log, 0)
    assert saved in (30, 31), saved  # 31: rank 0's share of epoch 0 ended there
    b = {**job, "departed": [f"{ckpt}.rank1"]}
    if run_ids == "same":
        kill_ranks_when([start({**b, "hold_at": 42}, 0, 1, 1, "job", 1)], lambda: holding(log, [0], 1),
                        "to its hold")
    else:
        p = start({**b, "kill_after_save": 40}, 0, 1, 1, "job", 1)
        p.wait(timeout=240)
        assert p.returncode == -signal.SIGKILL, p.communicate()[1][-4000:]
    Path(f"{ckpt}.rank1").unlink()  # the 1-rank job's checkpoint has rank 0's state only
    run_id, restart = ("job", 2) if run_ids == "same" else ("job2", 0)
    c = {**job, "epoch_from": f"{ckpt}.rank0"}
    for p in [start(c, r, 3, 2, run_id, restart) for r in (0, 1, 2)]:
        finish(p)

    check_ranks(job, [(0, "rank0", 0), (0, "rank1", 0), (1, "rank0", saved),
                      (2, "rank0", 40), (2, "rank1", 0), (2, "rank2", 0)])


def snapshot(url: str, queue: str) -> dict[str, list[Any]]:
    """Every row of the queue that a restore could change."""
    return {
        "items": sql(url, "SELECT * FROM wq_audit WHERE queue = :q ORDER BY epoch, seq", q=queue),
        "history": sql(url, "SELECT * FROM wq_history WHERE queue = :q ORDER BY event_id", q=queue),
        "tallies": sql(url, "SELECT t.* FROM wq_tallies t JOIN wq_queues q ON q.id = t.queue_id "
                            "WHERE q.name = :q ORDER BY t.epoch, t.worker_id", q=queue),
        "checkpoints": sql(url, "SELECT c.* FROM wq_checkpoints c JOIN wq_queues q ON q.id = c.queue_id "
                                "WHERE q.name = :q ORDER BY c.id", q=queue),
    }


def test_bad_states_on_resume_get_one_clear_error_and_change_nothing(db_url: str) -> None:
    """A state from another queue, of another format version, cut short or damaged, one whose
    later items were compacted away: each raises ``InvalidInput`` saying what to do, and the
    queue's rows are as they were; the good state then resumes."""
    from wq_sql import InvalidInput, compact_queue
    from wq_sql.torch import DataLoader, QueueDataset

    works = [f"w{i:02d}" for i in range(6)]
    ds = QueueDataset(works, num_epochs=3, url=db_url, name="bad", worker="r", consumed="checkpoint",
                      lease_ahead=1)
    loader = DataLoader(ds, batch_size=1)
    seen = [b for _ in range(2) for b in loader]  # epochs 0 and 1
    early = loader.state_dict()  # at the end of epoch 1's pass
    loader.checkpoint_saved()
    assert len(seen) == 12
    it = iter(loader)
    seen += [next(it), next(it)]
    good = loader.state_dict()  # 2 batches into epoch 2
    del it
    before = snapshot(db_url, "bad")
    fresh = DataLoader(ds, batch_size=1)
    bad: list[tuple[Any, str]] = [
        ([good], "not a wq_sql.torch loader state"),
        ({"step": 3, "epoch": 0}, "has no 'version'"),
        ({**good, "version": 2}, "format version 2; this wq_sql reads version 1"),
        ({k: v for k, v in good.items() if k not in ("step", "items")}, r"incomplete \(no 'step', 'items'\)"),
        ({**good, "step": -4}, r"damaged \(step=-4"),
        ({**good, "items": ["12", None]}, r"damaged \(items="),
        ({**good, "pass_ended": "yes"}, r"damaged \(pass_ended='yes'"),
        ({**good, "queue": "other"}, "belongs to queue 'other', not 'bad'"),
    ]
    for state, message in bad:
        with pytest.raises(InvalidInput, match=message):
            fresh.load_state_dict(state)
        with pytest.raises(InvalidInput, match=message):
            fresh.load_state_dict(early, departed=[state])
        assert snapshot(db_url, "bad") == before, f"a refused state changed the queue: {state!r:.200}"
    with pytest.raises(InvalidInput, match="departed= holds a state of 'r'"):
        fresh.load_state_dict(good, departed=[early])
    # Epochs 0 and 1 are finished, 2 is running: compacting deletes the rows of 0 and 1.
    assert compact_queue("bad", url=db_url) == 12
    before = snapshot(db_url, "bad")
    old = {**early, "epoch": 0, "pass_ended": False}  # a state from the middle of epoch 0
    with pytest.raises(InvalidInput, match=r"epoch\(s\) \[0, 1\] were compacted away"):
        fresh.load_state_dict(old)
    assert snapshot(db_url, "bad") == before
    fresh.load_state_dict(good)  # from epoch 2: nothing it needs was compacted
    rest = list(fresh)
    fresh.state_dict()
    fresh.checkpoint_saved()
    assert sorted(seen[12:] + rest) == sorted([w] for w in works)


def test_resume_of_ranks_whose_steps_differ(db_url: str, tmp_path: Path) -> None:
    """ray-project/ray#48224's cause in a data loader that counts steps per rank: ranks of one job
    take different numbers of batches (a dynamic queue gives the fast one more), so their loader
    steps differ, and one rank's restore must not compare its step with another's checkpoints.
    2 ranks (steps 32 and 12 at the kill, last saves 30 and 10) restart as 2 ranks, each from its
    own state: rank 1's restore (step 10) leaves rank 0's checkpoints up to 30 done."""
    job, log, ckpt = uneven_ranks_killed(db_url, tmp_path, "uneven")
    saved = [last_saved(log, r) for r in (0, 1)]
    assert saved[0] in (30, 31) and saved[1] in (10, 11), saved  # or where pass 0 ended
    for p in [start(job, r, 2, 1, "job", 1) for r in (0, 1)]:
        finish(p)
    check_ranks(job, [(0, "rank0", 0), (0, "rank1", 0), (1, "rank0", saved[0]), (1, "rank1", saved[1])])
