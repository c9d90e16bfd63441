"""A rank SIGKILLed mid-epoch (its main process and DataLoader workers, as torchrun kills a failed
rank) and restarted with the same RANK and TORCHELASTIC_RUN_ID: its DataLoader workers take back
the items they held, before anything else, and no record is lost."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

from torch_support import audit_exactly_once, finish, free_port, read_log, sql, start_rank, write_files


def test_killed_rank_gets_its_items_back_first(db_url: str, tmp_path: Path) -> None:
    files, lines = write_files(tmp_path / "data", 120, 4)
    log = tmp_path / "log"
    # Long heartbeats: the peer's would otherwise return the dead rank's items to the queue (its
    # processes are gone, on this host) if one fell between the kill and the restart.
    job = {"url": db_url, "queue": "crash", "files": files, "num_epochs": 1, "num_workers": 2,
           "batch_size": 4, "lease_ahead": 4, "log": str(log),
           "options": {"heartbeat_seconds": 30, "lease_seconds": 120}}
    port = free_port()
    # The peer reads 5x slower: on a busy machine rank 1's start (torch's import, its DataLoader
    # workers) can lag by seconds, and a fast peer would drain the queue before rank 1 holds anything.
    peer = start_rank(job, 0, 2, port, read_seconds=0.1)
    victim = start_rank(job, 1, 2, port, read_seconds=0.02)
    deadline = time.monotonic() + 60
    while len(read_log(Path(f"{log}.rank1"))) < 10:
        assert time.monotonic() < deadline and victim.poll() is None, "rank 1 did not get going"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    in_flight = {(w, Path(work).name) for w, work in sql(
        db_url, "SELECT worker, work FROM wq_audit WHERE queue = 'crash' AND state = 'claimed' "
                "AND worker LIKE 'test/rank1/%'")}
    assert in_flight, "rank 1 held nothing when it was killed"
    before = read_log(Path(f"{log}.rank1"))

    restarted = start_rank({**job, "log": f"{log}.again"}, 1, 2, port, read_seconds=0.02)
    finish(restarted)
    finish(peer)

    # The restarted workers recovered exactly what their predecessors held...
    recovered = {(w, Path(work).name) for w, work in sql(
        db_url, "SELECT h.worker, a.work FROM wq_history h JOIN wq_audit a ON a.item_id = h.item_id "
                "WHERE h.queue = 'crash' AND h.kind = 'recover'")}
    assert recovered == in_flight
    # ... and each read them before any other item.
    after = read_log(Path(f"{log}.again.rank1"))
    for k in (0, 1):
        mine = {name for w, name in recovered if w == f"test/rank1/loader{k}"}
        order: list[str] = []
        for batch in after:
            for record in batch["records"]:
                line, worker = record.split("@")
                name = f"part-{line[1:5]}.txt"
                if worker == f"w{k}" and name not in order:
                    order.append(name)
        assert set(order[:len(mine)]) == mine, (k, order[:len(mine)], mine)

    # Every record trained at least once; twice only if it belonged to an item in flight.
    trained: Counter[str] = Counter()
    for batches in (read_log(Path(f"{log}.rank0")), before, after):
        for batch in batches:
            trained.update(r.split("@")[0] for r in batch["records"])
    assert set(trained) == set(lines)
    again = {r for r, n in trained.items() if n > 1}
    flight = {f"part-{r[1:5]}.txt" for r in again}
    assert flight <= {name for _, name in in_flight}, flight
    audit_exactly_once(db_url, "crash", 120, 1)
