"""Synchronous training (MultiWorkerMirroredStrategy) over a shared queue.

Workers take different numbers of items (fast ones more), so their data ends unevenly; a loop
that ran a collective per local batch until its own data ended would wait forever for the
worker that stopped first. TensorFlow's distributed iterator
(``strategy.experimental_distribute_dataset(...)`` or ``distribute_datasets_from_function``) agrees
on the end across workers: at each step it all-reduces whether every worker still has data, so
all workers run the same number of steps (the last ones with partial or empty batches) and end
together. This test shows it with two real worker processes.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from tf_support import finish_worker, start_worker


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
def test_mirrored_workers_with_uneven_items_end_together(tmp_path: Path) -> None:
    works = [f"w{i}" for i in range(30)]  # 1 to 3 elements each: 60 in all
    job = {"mode": "mirrored", "works": works, "url": f"sqlite:///{tmp_path / 'wq.db'}",
           "ports": free_ports(2), "pause": 0.05}
    procs = [start_worker({**job, "index": i}) for i in range(2)]
    reports = [finish_worker(p, timeout=240) for p in procs]  # a hang fails here
    assert sum(r["taken"] for r in reports) == len(works)
    assert sum(r["local"] for r in reports) == 60          # every element trained on once
    assert reports[0]["steps"] == reports[1]["steps"]      # ... in the same number of steps
    assert reports[0]["all_reduced"] == reports[1]["all_reduced"] == 60


def test_synchronous_ends_a_workers_data_instead_of_waiting_for_a_peers_items(tmp_path: Path) -> None:
    """The deadlock the option removes, without a strategy: a peer holds the last items (claimed
    ahead, as its prefetch thread does) and, in synchronous training, would be blocked in a
    collective waiting for this worker. By default this worker's pull waits for those items;
    with ``synchronous=True`` its data ends, and the peer still gets them."""
    import tensorflow as tf

    import wq_sql
    from wq_sql.tf import WorkQueue

    url = f"sqlite:///{tmp_path / 'wq.db'}"
    works = [f"w{i}" for i in range(4)]
    peer = wq_sql.WorkQueue(works, shuffle=False, name="sync", url=url, worker="peer", lease_ahead=3)
    assert peer.take_many(2) == ["w0", "w1"]      # w2 claimed ahead too
    assert peer.prefetch() == 1                   # w3: nothing left to claim
    waiting = WorkQueue.attach("sync", url=url, worker="waiting")
    with pytest.raises(wq_sql.QueueEmpty):
        waiting.queue.take(timeout=0.3)           # the default take waits for the peer's items
    ending = WorkQueue.attach("sync", url=url, worker="ending", synchronous=True)
    assert list(ending.input_dataset()) == []     # ends at once
    with pytest.raises(tf.errors.OutOfRangeError):
        ending.take()
    assert [str(i) for i in peer.take_many(4)] == ["w2", "w3"]
    for wq in (waiting, ending, peer):
        wq.close()
    assert wq_sql.WorkQueue.attach("sync", url=url, worker="check").progress().done == 4


def test_synchronous_end_takes_what_a_refill_claimed_after_the_take_gave_up(db_url: str) -> None:
    """Issue 13's interleaving at the synchronous end: the pull's take finds nothing claimable
    and gives up; a moment later a refill (the prefetch thread kicked by the last hand-out)
    claims an item the peer just released into this worker's buffer. Ending the data there
    would strand that item in a buffer no pull looks at; the data ends only once the refills
    are stopped and the buffer is empty."""
    import wq_sql
    from wq_sql.tf import WorkQueue

    peer = wq_sql.WorkQueue(["a", "b"], shuffle=False, name="sync", url=db_url, worker="peer",
                            lease_ahead=2, auto_complete=False)
    assert peer.take_many(2) == ["a", "b"]
    ending = WorkQueue.attach("sync", url=db_url, worker="ending", synchronous=True)
    core = ending.queue
    real_take_many = core.take_many
    first = [True]

    def take_many(n: int, timeout: float | None = None, *, claim: int | None = None) -> list:
        try:
            return real_take_many(n, timeout, claim=claim)
        except wq_sql.QueueEmpty:
            if first[0]:
                first[0] = False
                peer.release("b")
                assert core.prefetch() == 1  # what the refill thread does, just too late
            raise

    core.take_many = take_many  # type: ignore[method-assign]
    assert [x.decode() for x in ending.input_dataset().as_numpy_iterator()] == ["b"]
    peer.complete("a")
    ending.close()
    peer.close()
    with wq_sql.WorkQueue.attach("sync", url=db_url, worker="check") as check:
        assert check.progress().done == 2


@pytest.mark.parametrize(("tf_config", "expected"), [
    (None, False),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}, False),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}, True),
    ({"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}, True),
    ({"cluster": {"ps": ["p:1"], "worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}, False),
    ("not json", False),
])
def test_the_synchronous_end_is_chosen_from_the_jobs_shape(
        tf_config: object, expected: bool, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several workers and no parameter server: synchronous training, so the queue ends a
    worker's data instead of waiting for a peer's items; a parameter-server job (DeepRec's) or a
    single worker waits. The flag overrides the rule either way."""
    from wq_sql.tf import WorkQueue, synchronous_training

    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
    assert synchronous_training() is expected
    with WorkQueue(["a", "b"], name="auto", url=db_url, worker="w") as wq:
        assert wq.synchronous is expected
    with WorkQueue.attach("auto", url=db_url, worker="w", synchronous=not expected) as wq:
        assert wq.synchronous is (not expected)

