"""Lineage: every training step of every rank maps, through ``wq-sql trace``, to exactly the
records the trainer logged for it; ``ReplayDataset`` feeds a rank's batches again, record for
record; bad input gets one line saying what was recorded."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch.utils.data
from torch_support import close_datasets, finish, free_port, read_log, start_rank, write_files  # noqa: F401

from wq_sql import InvalidInput
from wq_sql.cli import main as cli
from wq_sql.torch import DataLoader, QueueDataset, ReplayDataset


def plain_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def traced_json(url: str, *args: str) -> list[dict[str, object]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["--url", url, "trace", *args, "--format", "json"]) == 0
    return json.loads(out.getvalue())


def trace_error(url: str, *args: str) -> str:
    """The one line ``wq-sql trace`` prints for bad input (it exits 1)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli(["--url", url, "trace", *args]) == 1
    assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    return err.getvalue()


def untagged(records: list[str]) -> list[str]:
    return [r.split("@")[0] for r in records]  # without the @w<k> of the DataLoader worker that read it


def test_every_step_traces_to_the_logged_records_and_replays(db_url: str, tmp_path: Path) -> None:
    """2 gloo ranks under DDP x 2 DataLoader workers, 2 epochs of 500 files of 5 lines in
    batches of 5: about 1,000 steps in all, rank 1's reader slow so the ranks' batches differ in
    number and make-up. Each rank's step k (its k-th logged batch) is, through ``wq-sql trace``,
    exactly the records the rank logged, in order; replaying steps [120, 140) of rank 1 (through
    a DataLoader with 2 workers) gives its logged batches."""
    files, lines = write_files(tmp_path / "data", 500, 5)
    log = tmp_path / "log"
    job = {"url": db_url, "queue": "lin", "files": files, "num_epochs": 2, "num_workers": 2, "batch_size": 5,
           "dist": True, "log": str(log), "options": {"lineage": True}}
    port = free_port()
    procs = [start_rank(job, r, 2, port, read_seconds=0.0 if r == 0 else 0.002) for r in range(2)]
    for p in procs:
        finish(p)
    logs = [read_log(Path(f"{log}.rank{r}")) for r in range(2)]
    total = sum(len(b) for b in logs)
    assert total >= 950, total
    content = {Path(f).name: plain_lines(f) for f in files}
    for r in range(2):
        last = str(len(logs[r]) - 1)
        rows = traced_json(db_url, "lin", "--step", "0", "--to", last, "--worker", f"test/rank{r}")
        per_step: dict[int, list[str]] = {}
        for t in rows:
            assert t["run"] == 1
            per_step.setdefault(int(t["step"]), []).extend(
                content[Path(str(t["work"])).name][int(t["first_record"]):int(t["last_record"]) + 1])
        assert sorted(per_step) == list(range(len(logs[r]))), f"rank {r}: steps without lineage"
        bad = [k for k, b in enumerate(logs[r]) if per_step[k] != untagged(b["records"])]
        assert not bad, (r, bad[:5], [(per_step[k], logs[r][k]["records"]) for k in bad[:2]])
    # One step through the table output too.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["--url", db_url, "trace", "lin", "--step", "7", "--worker", "test/rank1"]) == 0
    assert "1 step(s)" in out.getvalue() and "test/rank1" in out.getvalue()

    replay = ReplayDataset("lin", url=db_url, worker="test/rank1", steps=range(120, 140), read=plain_lines,
                           collate_fn=list)
    assert [list(b) for b in replay] == [untagged(b["records"]) for b in logs[1][120:140]]
    batches = list(torch.utils.data.DataLoader(replay, batch_size=None, num_workers=2))
    assert batches == [untagged(b["records"]) for b in logs[1][120:140]]


def test_what_lineage_does_not_hold_is_said(db_url: str, tmp_path: Path) -> None:
    files, _ = write_files(tmp_path / "data", 12, 4)
    plain = QueueDataset(files, url=db_url, read=plain_lines, name="plain", worker="r")
    for _ in DataLoader(plain, batch_size=4):
        pass
    with pytest.raises(InvalidInput, match="holds no lineage: train with lineage=True"):
        ReplayDataset("plain", url=db_url, worker="r", steps=range(0, 2), read=plain_lines)
    ds = QueueDataset(files, url=db_url, read=plain_lines, name="rec", worker="r", lineage=True)
    steps = sum(1 for _ in DataLoader(ds, batch_size=4))
    assert steps == 12
    with pytest.raises(InvalidInput, match=r"steps 12, 13 of worker 'r' .* no lineage"):
        ReplayDataset("rec", url=db_url, worker="r", steps=range(10, 14), read=plain_lines)
    with pytest.raises(InvalidInput, match=r"worker 'x' recorded no lineage .* workers with lineage: r"):
        ReplayDataset("rec", url=db_url, worker="x", steps=range(0, 2), read=plain_lines)
    with pytest.raises(InvalidInput, match=r"run 2 recorded no lineage .* worker 'r' run 1 steps 0..11"):
        ReplayDataset("rec", url=db_url, worker="r", steps=range(0, 2), run=2, read=plain_lines)
    assert ("step 50 of queue 'rec' recorded no lineage; recorded: worker 'r' run 1 steps 0..11"
            in trace_error(db_url, "rec", "--step", "50"))
    assert "has no work 'nope'" in trace_error(db_url, "rec", "--work", "nope")
    assert "checkpoint at step 3" in trace_error(db_url, "rec", "--checkpoint", "3")
    assert "--to 2 comes before --step 5" in trace_error(db_url, "rec", "--step", "5", "--to", "2")
    with pytest.raises(InvalidInput, match="steps must be a non-empty range"):
        ReplayDataset("rec", url=db_url, worker="r", steps=range(-1, 2), read=plain_lines)
    # A work's every step, and a reader that no longer yields what was trained.
    rows = traced_json(db_url, "rec", "--work", files[3])
    assert rows and {r["work"] for r in rows} == {files[3]}
    short = ReplayDataset("rec", url=db_url, worker="r", steps=range(0, 12), read=lambda item: ["one"])
    with pytest.raises(InvalidInput, match="replay needs the run's reader and unchanged data"):
        list(short)
    with pytest.raises(InvalidInput, match="lineage must be True or False"):
        QueueDataset(files, url=db_url, read=plain_lines, name="rec", worker="r2", lineage="yes")


def test_a_restored_checkpoint_records_a_new_run(db_url: str, tmp_path: Path) -> None:
    """consumed='checkpoint': the rows name the checkpoint that covered the items; a restore
    numbers the steps again from the state's step, in run 2, and trace picks the latest run."""
    files, _ = write_files(tmp_path / "data", 8, 5)
    ds = QueueDataset(files, url=db_url, read=plain_lines, name="ck", worker="r", lineage=True,
                      consumed="checkpoint")
    loader = DataLoader(ds, batch_size=5)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()  # covers steps 0..2
    loader.checkpoint_saved()
    trained_after = [list(next(it)) for _ in range(2)]  # steps 3, 4: trained, then the job is restored
    del it
    loader2 = DataLoader(ds, batch_size=5)
    loader2.load_state_dict(state)
    again = [list(b) for b in loader2]
    ds.close()
    rows = traced_json(db_url, "ck", "--checkpoint", "3")
    assert {r["step"] for r in rows} == {0, 1, 2} and {r["run"] for r in rows} == {1}
    latest = traced_json(db_url, "ck", "--step", "3", "--worker", "r")
    assert {r["run"] for r in latest} == {2}
    first_run = traced_json(db_url, "ck", "--step", "3", "--worker", "r", "--run", "1")
    content = {f: plain_lines(f) for f in files}

    def records(rows: list[dict[str, object]]) -> list[str]:
        return [x for r in rows
                for x in content[str(r["work"])][int(r["first_record"]):int(r["last_record"]) + 1]]
    assert records(first_run) == trained_after[0]
    assert records(latest) == again[0]
