"""Checkpoint-consistent resume in wq_sql.torch (``consumed="checkpoint"``), in one process (its
DataLoader workers aside), on both backends: items become done only when a checkpoint holding the
loader's ``state_dict()`` is saved, never because the loader read ahead; restoring an older
checkpoint re-opens what it does not cover."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_support import close_datasets, sql, write_files  # noqa: F401 - an autouse fixture
from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataLoader

from wq_sql import InvalidInput
from wq_sql.torch import DataLoader, QueueDataset, QueueSampler, StatefulDataLoader

LINES = 5  # records per file (item)


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def done_files(url: str, queue: str) -> dict[str, int]:
    """{file name: ckpt_step} of the done items."""
    rows = sql(url, "SELECT a.work, i.ckpt_step FROM wq_audit a JOIN wq_items i ON i.id = a.item_id "
                    "WHERE a.queue = :q AND a.state = 'done'", q=queue)
    return {Path(w).name: s for w, s in rows}


def whole(trained: Counter[str]) -> set[str]:
    """The files every record of which was trained."""
    per_file = Counter(f"part-{r[1:5]}.txt" for r in set(trained))
    return {name for name, n in per_file.items() if n == LINES}


@pytest.mark.parametrize("loader_class", [DataLoader, StatefulDataLoader])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_items_are_done_only_when_a_checkpoint_covers_them(db_url: str, tmp_path: Path, num_workers: int,
                                                           loader_class: Any) -> None:
    files, lines = write_files(tmp_path / "data", 40, LINES)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="ck", worker="r", consumed="checkpoint",
                      lease_ahead=4)
    extra = {"prefetch_factor": 4} if num_workers else {}
    loader = loader_class(ds, batch_size=3, num_workers=num_workers, **extra)
    if loader_class is StatefulDataLoader:
        assert isinstance(loader, TorchdataLoader)
    trained: Counter[str] = Counter()
    batches = iter(loader)
    for _ in range(10):
        trained.update(next(batches))
    steps = 11
    # Workers and prefetch read ahead and ten steps were trained: nothing is done without a checkpoint.
    assert done_files(db_url, "ck") == {}
    state = loader.state_dict()
    assert state["step"] == 10 and state["epoch"] == 0 and not state["pass_ended"]
    assert done_files(db_url, "ck") == {}  # taken, not yet saved
    torch.save({"loader": state}, tmp_path / "ckpt.pt")
    first_ten = Counter(trained)
    trained.update(next(batches))  # the loop goes on: the checkpoint was saved
    covered = done_files(db_url, "ck")
    # Exactly the items whose every record was in the first ten batches, stamped with step 10.
    assert set(covered) == whole(first_ten) and set(covered.values()) == {10}
    for batch in batches:
        trained.update(batch)
        steps += 1
    assert Counter(trained) == Counter(lines)
    assert len(done_files(db_url, "ck")) == len(covered)  # the rest waits for the next checkpoint
    end = loader.state_dict()
    assert end["pass_ended"] and end["step"] == steps
    assert loader.checkpoint_saved() == 40 - len(covered)
    assert set(done_files(db_url, "ck").values()) == {10, end["step"]}
    saves = sql(db_url, "SELECT c.step, c.items FROM wq_checkpoints c JOIN wq_queues q ON q.id = c.queue_id "
                        "WHERE q.name = 'ck' AND c.action = 'save' ORDER BY c.id")
    assert [tuple(r) for r in saves] == [(10, len(covered)), (end["step"], 40 - len(covered))]


def test_covered_items_are_those_trained_before_the_state(db_url: str, tmp_path: Path) -> None:
    """The first checkpoint covers exactly the items whose last record was in a batch yielded before
    state_dict() (num_workers=0: one item at a time, in order)."""
    files, _ = write_files(tmp_path / "data", 12, LINES)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="exact", worker="r", consumed="checkpoint",
                      shuffle=False)
    loader = DataLoader(ds, batch_size=4, num_workers=0)
    batches = iter(loader)
    trained: Counter[str] = Counter()
    for _ in range(7):  # 28 records: 5 whole files and 3 records of the 6th
        trained.update(next(batches))
    loader.state_dict()
    next(batches)
    assert set(done_files(db_url, "exact")) == whole(trained) == {f"part-{i:04d}.txt" for i in range(5)}


def test_restoring_an_older_checkpoint_reopens_what_it_does_not_cover(db_url: str, tmp_path: Path) -> None:
    files, lines = write_files(tmp_path / "data", 30, LINES)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="older", worker="r", consumed="checkpoint",
                      max_attempts=10)
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    batches = iter(loader)
    model_saw: Counter[str] = Counter()  # what the model restored at step 6 and trained on saw
    for _ in range(6):
        model_saw.update(next(batches))
    older = loader.state_dict()
    for _ in range(6):
        next(batches)  # trained, then forgotten: the job goes back to step 6
    loader.state_dict()
    next(batches)
    at_12 = done_files(db_url, "older")
    assert set(at_12.values()) == {6, 12}
    del batches
    again = DataLoader(ds, batch_size=3, num_workers=2)
    again.load_state_dict(older)  # before iterating: the pass of epoch 0 again
    after = done_files(db_url, "older")
    assert set(after.values()) == {6}, after
    reopened = sql(db_url, "SELECT count(*) FROM wq_history WHERE queue = 'older' AND kind = 'requeue' "
                           "AND detail = 'model restored from checkpoint step 6'")
    assert reopened == [(len(at_12) - len(after),)]
    for batch in again:
        model_saw.update(batch)
    again.state_dict()
    again.checkpoint_saved()
    # Nothing lost for the model; seen twice only the records of items that straddled step 6
    # (at most one per DataLoader worker).
    assert set(model_saw) == set(lines)
    twice = {r for r, n in model_saw.items() if n > 1}
    assert len({r[:5] for r in twice}) <= 2, twice
    rows = sql(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = 'older' GROUP BY state")
    assert [tuple(r) for r in rows] == [("done", 30)]


@pytest.mark.parametrize("how", ["departed", "fallback"])
def test_restoring_an_older_checkpoint_after_a_shrink_reopens_what_departed_ranks_covered(
        db_url: str, tmp_path: Path, how: str) -> None:
    """A job of 2 ranks (run ``job``, restart 0) saves at steps 2 and 4; it restarts with 1 rank
    (restart 1) from rank 0's older checkpoint (step 2). The model forgot every step after 2, on
    both ranks: what rank 1's step-4 checkpoint covered goes back to the queue too, although
    rank 1 never comes back to restore, and the new rank trains it. ``departed``: rank 0 is given
    rank 1's state of the same checkpoint (``load_state_dict(departed=)``): exactly once.
    ``fallback``: it is not; rank 0 puts back what rank 1 covered after rank 0's state was taken
    (here, rank 1 ran after rank 0: all of it): every record at least once."""
    files, lines = write_files(tmp_path / "data", 24, LINES)
    states: dict[int, dict[str, Any]] = {}
    model_saw: Counter[str] = Counter()  # what the model restored at step 2 saw
    old = []
    for rank in (0, 1):
        ds = QueueDataset(files, url=db_url, read=read_lines, name="shrink", worker=f"job/rank{rank}",
                          consumed="checkpoint", run=("job", 0), lease_ahead=1)
        loader = DataLoader(ds, batch_size=LINES)  # one file per batch, read in the main process
        batches = iter(loader)
        for _ in range(2):
            model_saw.update(next(batches))
        states[rank] = loader.state_dict()
        for _ in range(2):
            next(batches)  # trained, then forgotten: the job goes back to step 2
        loader.state_dict()
        loader.checkpoint_saved()
        old.append((ds, batches))
    assert sorted(done_files(db_url, "shrink").values()) == [2, 2, 2, 2, 4, 4, 4, 4]
    for ds, batches in old:
        del batches
        ds.close()  # the incarnation is gone (a kill would leave the same rows: covered items are done)
    ds = QueueDataset(None, url=db_url, read=read_lines, name="shrink", worker="job/rank0",
                      consumed="checkpoint", run=("job", 1))
    again = DataLoader(ds, batch_size=LINES)
    again.load_state_dict(states[0], departed=[states[1]] if how == "departed" else [])
    left = sorted(done_files(db_url, "shrink").values())
    if how == "departed":
        assert left == [2, 2, 2, 2], "rank 1's step-4 items stayed done"
    else:
        assert left == [2, 2], "rank 1's items covered after rank 0's state stayed done"
    for batch in again:
        model_saw.update(batch)
    again.state_dict()
    again.checkpoint_saved()
    if how == "departed":
        assert model_saw == Counter(lines), "a record lost for the model restored at step 2, or trained twice"
    else:
        assert set(model_saw) == set(lines), "a record lost for the model restored at step 2"
    rows = sql(db_url, "SELECT state, count(*) FROM wq_audit WHERE queue = 'shrink' GROUP BY state")
    assert [tuple(r) for r in rows] == [("done", 24)]


def test_resume_state_and_bad_states(db_url: str, tmp_path: Path) -> None:
    """A state taken after a pass resumes at the next epoch; a foreign state is refused."""
    files, lines = write_files(tmp_path / "data", 6, 2)
    ds = QueueDataset(files, num_epochs=2, url=db_url, read=read_lines, name="res", worker="r",
                      consumed="checkpoint")
    loader = DataLoader(ds, batch_size=4)
    assert Counter(r for b in loader for r in b) == Counter(lines)
    state = loader.state_dict()
    loader.checkpoint_saved()
    assert state["epoch"] == 0 and state["pass_ended"]
    resumed = DataLoader(ds, batch_size=4)
    resumed.load_state_dict(state)
    assert Counter(r for b in resumed for r in b) == Counter(lines)  # epoch 1's pass
    resumed.state_dict()
    resumed.checkpoint_saved()
    rows = sql(db_url, "SELECT epoch, state, count(*) FROM wq_audit WHERE queue = 'res' "
                       "GROUP BY epoch, state")
    assert sorted(tuple(r) for r in rows) == [(0, "done", 6), (1, "done", 6)]
    with pytest.raises(InvalidInput, match="not a wq_sql.torch loader state"):
        resumed.load_state_dict({"step": 3})
    with pytest.raises(InvalidInput, match="belongs to queue 'other'"):
        resumed.load_state_dict({**state, "queue": "other"})


class Indices(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("loader_class", [DataLoader, StatefulDataLoader])
def test_sampler_ranges_are_done_only_when_a_checkpoint_covers_them(db_url: str, loader_class: Any) -> None:
    sampler = QueueSampler(1000, num_slices=20, url=db_url, name="smp", worker="r", consumed="checkpoint")
    loader = loader_class(Indices(), batch_size=16, sampler=sampler, num_workers=2)
    batches = iter(loader)
    trained: list[int] = []
    for _ in range(10):
        trained += next(batches).tolist()
    assert sql(db_url, "SELECT count(*) FROM wq_audit WHERE queue = 'smp' AND state = 'done'") == [(0,)]
    loader.state_dict()
    first = set(trained)
    trained += next(batches).tolist()
    done = sql(db_url, "SELECT work FROM wq_audit WHERE queue = 'smp' AND state = 'done'")
    ranges = [range(50 * k, 50 * k + 50) for k in range(20)]  # range:1000 cut into 20 items
    whole = {k for k, r in enumerate(ranges) if set(r) <= first}
    assert len(done) == len(whole) > 0
    for batch in batches:
        trained += batch.tolist()
    assert sorted(trained) == list(range(1000))
    loader.state_dict()
    loader.checkpoint_saved()
    assert sql(db_url, "SELECT count(*) FROM wq_audit WHERE queue = 'smp' AND state = 'done'") == [(20,)]
