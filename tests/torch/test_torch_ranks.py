"""Ranks in their own processes, as torchrun starts them, each with DataLoader worker processes,
on both backends: every record (or index) exactly once per epoch, by the ranks' own logs and by
the SQL audit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from torch_support import (
    audit_exactly_once,
    finish,
    free_port,
    per_epoch,
    read_log,
    sql,
    start_rank,
    write_files,
)


def strip(counter: Counter[str]) -> Counter[str]:
    """Records without the ``@w<k>`` tag of the DataLoader worker that read them."""
    out: Counter[str] = Counter()
    for record, n in counter.items():
        out[record.split("@")[0]] += n
    return out


def test_two_ranks_ddp_two_workers_two_epochs(db_url: str, tmp_path: Path) -> None:
    """2 gloo ranks under DDP x DataLoader num_workers=2 over 200 files, rank 1's input pipeline
    slow (30 ms per file): each epoch's records exactly once. DDP steps the ranks together, so the
    fast rank's loader runs ahead (its workers read 8 batches ahead each) and holds more when the
    queue runs dry: it ends each pass with more batches, and join() lets it finish them while the
    other rank has stopped. (Without the deeper read-ahead the ends may come out even: on SQLite a
    loader claims only when it reads, with no refill thread claiming ahead.)"""
    files, lines = write_files(tmp_path / "data", 200, 5)
    log = tmp_path / "log"
    job = {"url": db_url, "queue": "ddp", "files": files, "num_epochs": 2, "num_workers": 2, "batch_size": 4,
           "dist": True, "log": str(log), "prefetch_factor": {"0": 8}}
    port = free_port()
    procs = [start_rank(job, r, 2, port, read_seconds=0.0 if r == 0 else 0.03) for r in range(2)]
    reports = [finish(p) for p in procs]
    logs = [read_log(Path(f"{log}.rank{r}")) for r in range(2)]
    for epoch in range(2):
        seen = strip(sum((per_epoch(b).get(epoch, Counter()) for b in logs), Counter()))
        assert seen == Counter(lines), f"epoch {epoch}: missing or repeated records"
    fast, slow = reports[0]["steps"], reports[1]["steps"]
    assert fast > slow, reports  # the fast rank trained more batches: dynamic sharding, uneven ends
    audit_exactly_once(db_url, "ddp", 200, 2)
    holders = {r[0] for r in sql(db_url, "SELECT DISTINCT worker FROM wq_audit WHERE queue = 'ddp'")}
    assert holders == {f"test/rank{r}/loader{k}" for r in range(2) for k in range(2)}, holders


def test_sampler_two_ranks(db_url: str, tmp_path: Path) -> None:
    """A map-style dataset of 10,000 indices through QueueSampler (100 ranges), 2 ranks, 2 epochs,
    num_workers=2: every index once per epoch."""
    log = tmp_path / "log"
    job = {"url": db_url, "queue": "idx", "mode": "sampler", "num_samples": 10_000, "num_slices": 100,
           "num_epochs": 2, "num_workers": 2, "batch_size": 64, "log": str(log), "start_line": True}
    port = free_port()
    procs = [start_rank({**job, "step_seconds": 0.0 if r == 0 else 0.002}, r, 2, port) for r in range(2)]
    for p in procs:
        finish(p)
    logs = [read_log(Path(f"{log}.rank{r}")) for r in range(2)]
    for epoch in range(2):
        seen = sum((per_epoch(b).get(epoch, Counter()) for b in logs), Counter())
        assert seen == Counter(str(i) for i in range(10_000)), f"epoch {epoch}"
    assert all(b for b in logs), "both ranks took part"
    audit_exactly_once(db_url, "idx", 100, 2)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_start_methods_and_persistent_workers(db_url: str, tmp_path: Path, context: str) -> None:
    """DataLoader workers started by fork or spawn, persistent across passes: 2 epochs of 60 files,
    each exactly once per epoch, and each pass only its own epoch's items."""
    files, lines = write_files(tmp_path / "data", 60, 3)
    log = tmp_path / "log"
    job = {"url": db_url, "queue": "pw", "files": files, "num_epochs": 2, "num_workers": 2, "batch_size": 5,
           "context": context, "persistent": True, "log": str(log)}
    finish(start_rank(job, 0, 1, free_port()))
    counts = per_epoch(read_log(Path(f"{log}.rank0")))
    assert sorted(counts) == [0, 1]
    for epoch in (0, 1):
        assert strip(counts[epoch]) == Counter(lines)
    audit_exactly_once(db_url, "pw", 60, 2)
    # Both workers of the one rank took items, in both passes.
    rows = sql(db_url, "SELECT DISTINCT worker, epoch FROM wq_audit WHERE queue = 'pw'")
    assert set(rows) == {(f"test/rank0/loader{k}", e) for k in (0, 1) for e in (0, 1)}, rows
