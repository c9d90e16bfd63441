"""wq_sql.torch in one process (its DataLoader workers aside), on both backends."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch.utils.data
from torch_support import ENV, close_datasets, sql, write_files  # noqa: F401 - an autouse fixture

from wq_sql import InvalidInput, WorkQueue
from wq_sql.torch import DataLoader, QueueDataset, QueueSampler, acks, rank_name


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_import_wq_sql_does_not_import_torch() -> None:
    code = "import sys, wq_sql, wq_sql.queue, wq_sql.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert out.stdout.strip() == "False"


def test_rank_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WQ_SQL_WORKER", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert rank_name("mine") == "mine"
    assert ":" in rank_name()  # host:pid, not stable across restarts
    monkeypatch.setenv("RANK", "3")
    assert rank_name() == "rank3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id is no job name
    assert rank_name() == "rank3"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert rank_name() == "job-7/rank3"
    monkeypatch.setenv("WQ_SQL_WORKER", "exp")
    assert rank_name() == "exp/rank3"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_passes_follow_epochs(db_url: str, tmp_path: Path, num_workers: int) -> None:
    """Each pass yields its own epoch's records, exactly once; epochs='all' is one pass."""
    files, lines = write_files(tmp_path / "data", 30, 4)
    ds = QueueDataset(files, num_epochs=3, url=db_url, read=read_lines, name="each", worker="r")
    loader = DataLoader(ds, batch_size=7, num_workers=num_workers)
    for epoch in range(3):
        seen = Counter(r for batch in loader for r in batch)
        assert seen == Counter(lines), epoch
        done = sql(db_url, "SELECT epoch, count(*) FROM wq_audit WHERE queue = 'each' AND state = 'done' "
                           "GROUP BY epoch ORDER BY epoch")
        assert [tuple(r) for r in done] == [(e, 30) for e in range(epoch + 1)]
    assert list(loader) == []  # nothing left
    one = QueueDataset(files, num_epochs=2, url=db_url, read=read_lines, name="all", worker="r", epochs="all")
    seen = Counter(r for batch in DataLoader(one, batch_size=7, num_workers=num_workers) for r in batch)
    assert seen == Counter(lines * 2)


def test_items_are_done_only_after_their_step(db_url: str, tmp_path: Path) -> None:
    """Workers and prefetch read ahead, but an item is done only once every one of its records was
    in a batch whose training step is over (the loop asked for the next batch)."""
    files, _ = write_files(tmp_path / "data", 40, 6)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="ahead", worker="r", lease_ahead=4)
    loader = DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=4)
    trained: Counter[str] = Counter()
    for step, batch in enumerate(loader):
        done = [Path(w).name for (w,) in sql(db_url, "SELECT work FROM wq_audit WHERE queue = 'ahead' "
                                                     "AND state = 'done'")]
        for name in done:
            prefix = f"f{int(name[5:9]):04d}-"
            assert sum(n for r, n in trained.items() if r.startswith(prefix)) == 6, (step, name)
        trained.update(batch)
        if step == 30:
            break
    assert sum(trained.values()) == 31 * 4


def test_acknowledgements_in_the_background(db_url: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """consumed='trained': during a pass the acknowledgements go out from a background thread
    (the loop does not wait for their commits); the pass's end waits for them, so every item is
    done when the loop ends, and one that failed is raised in the loop."""
    monkeypatch.setattr(acks, "ACK_SECONDS", 0.0)  # every step's items at once
    real = WorkQueue.complete_handed
    threads: set[str] = set()

    def spy(self: WorkQueue, handed: Any, steps: Any = None) -> Any:
        threads.add(threading.current_thread().name)
        return real(self, handed, steps)

    monkeypatch.setattr(WorkQueue, "complete_handed", spy)
    files, lines = write_files(tmp_path / "data", 30, 4)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="bg", worker="r")
    seen = Counter(r for batch in DataLoader(ds, batch_size=5, num_workers=0) for r in batch)
    assert seen == Counter(lines)
    assert sql(db_url, "SELECT count(*) FROM wq_audit WHERE queue = 'bg' AND state = 'done'") == [(30,)]
    assert any(name.startswith("wq_sql-acks") for name in threads), threads

    def broken(self: WorkQueue, handed: Any, steps: Any = None) -> Any:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(WorkQueue, "complete_handed", broken)
    ds2 = QueueDataset(files, url=db_url, read=read_lines, name="bg2", worker="r2")
    with pytest.raises(RuntimeError, match="went away"):
        for _ in DataLoader(ds2, batch_size=5, num_workers=0):
            pass


def test_break_then_next_pass(db_url: str, tmp_path: Path) -> None:
    """Leaving a pass early loses nothing: the next pass delivers the rest (at least once)."""
    files, lines = write_files(tmp_path / "data", 20, 5)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="brk", worker="r")
    loader = DataLoader(ds, batch_size=3, num_workers=0)
    seen: Counter[str] = Counter()
    for i, batch in enumerate(loader):
        seen.update(batch)
        if i == 6:
            break
    ds.set_epoch(0)  # the same epoch again
    for batch in loader:
        seen.update(batch)
    assert set(seen) == set(lines)
    assert sum(seen.values()) - len(lines) <= 2 * 3  # at least once: the batch the loop left, again
    assert sql(db_url, "SELECT count(*) FROM wq_audit WHERE queue = 'brk' AND state = 'done'") == [(20,)]


def test_sources_and_items(db_url: str, tmp_path: Path) -> None:
    """read='source' reads sliced works (here a lines: file cut into 5 items); read=None yields items."""
    path = tmp_path / "big.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    ds = QueueDataset([f"lines:{path}"], num_slices=5, url=db_url, read="source", name="src", worker="r")
    got = [r for batch in DataLoader(ds, batch_size=None) for r in [batch]]
    assert sorted(got) == sorted(f"line {i}".encode() for i in range(100))
    items = QueueDataset(["a", "b", "c"], url=db_url, name="items", worker="r")
    got_items = [x for batch in DataLoader(items, batch_size=2, num_workers=2) for x in batch]
    assert sorted(got_items) == ["a", "b", "c"]


def test_plain_dataloader_needs_taken(db_url: str, tmp_path: Path) -> None:
    files, lines = write_files(tmp_path / "data", 10, 2)
    ds = QueueDataset(files, url=db_url, read=read_lines, name="plain", worker="r")
    with pytest.raises(InvalidInput, match="needs wq_sql.torch.DataLoader"):
        list(torch.utils.data.DataLoader(ds, batch_size=4))
    taken = QueueDataset(files, num_epochs=2, url=db_url, read=read_lines, name="taken", worker="r2",
                         consumed="taken")
    plain = torch.utils.data.DataLoader(taken, batch_size=4, num_workers=2)
    for epoch in range(2):
        taken.set_epoch(epoch)  # a plain DataLoader does not count passes
        assert Counter(r for b in plain for r in b) == Counter(lines)


def test_bad_arguments(db_url: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="reads a QueueDataset"):
        DataLoader(list(range(3)))
    with pytest.raises(InvalidInput, match="epochs must be"):
        QueueDataset(["a"], url=db_url, epochs="some")
    with pytest.raises(InvalidInput, match="consumed must be"):
        QueueDataset(["a"], url=db_url, consumed="later")
    with pytest.raises(InvalidInput, match="pass url="):
        QueueDataset(["a"], url=db_url, engine=object())
    with pytest.raises(InvalidInput, match="read must be"):
        QueueDataset(["a"], url=db_url, read=3)
    sampler = QueueSampler(10, url=db_url, name="s", worker="r")
    with pytest.raises(InvalidInput, match="in_order=True"):
        DataLoader(list(range(10)), sampler=sampler, num_workers=1, in_order=False)
    with pytest.raises(InvalidInput, match="as sampler="):
        DataLoader(list(range(10)), batch_sampler=sampler)
