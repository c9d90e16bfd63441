"""What keeps ``input_dataset``'s pulls off the database: the core hooks
(``wq_sql.WorkQueue.prefetch`` and ``take_many``) and the shim's background thread. Claimed items
the pipeline has not reached stay at most ``lease_ahead``; nothing is claimed before the first
pull; an item is done only once the pipeline has pulled past it."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import tensorflow as tf
from tf_support import states_of

import wq_sql
import wq_sql.tf as wq_sql_tf
from wq_sql.tf import WorkQueue


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'wq.db'}"


def claimed(url: str, worker: str) -> int:
    return states_of(url, "work_queue", worker).get("claimed", 0)


def test_prefetch_tops_up_to_lease_ahead_and_sends_the_acks(url: str) -> None:
    works = [f"w{i}" for i in range(10)]
    wq = wq_sql.WorkQueue(works, shuffle=False, url=url, worker="w", lease_ahead=3)
    assert wq.take() == "w0"                     # one round trip: w0..w2 claimed, w0 handed out
    assert claimed(url, "w") == 3
    assert wq.prefetch(min_claim=2) == 0         # one place free: not enough
    assert wq.prefetch() == 1                    # w3
    assert wq.prefetch() == 0                    # full: 3 claimed ahead plus the one handed out
    assert claimed(url, "w") == 4
    assert wq.take() == "w1"                     # from the buffer; w0 is acknowledged ...
    assert states_of(url, "work_queue", "w") == {"claimed": 4}
    assert wq.prefetch() == 1                    # ... by the next round trip
    assert states_of(url, "work_queue", "w") == {"claimed": 4, "done": 1}
    assert [wq.take() for _ in range(8)] == works[2:]
    assert wq.prefetch() == 0                    # nothing left to claim
    with pytest.raises(wq_sql.QueueExhausted):
        wq.take()
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": 10}


def test_take_many_hands_out_what_is_buffered_and_acks_a_hand_out_at_the_next(url: str) -> None:
    works = [f"w{i}" for i in range(10)]
    wq = wq_sql.WorkQueue(works, shuffle=False, url=url, worker="w", lease_ahead=4, claim_ahead=False)
    assert wq.take_many(3) == ["w0", "w1", "w2"]  # one round trip claimed w0..w3
    assert wq.take_many(3) == ["w3"]              # what the buffer holds; w0..w2 acked next trip
    assert states_of(url, "work_queue", "w") == {"claimed": 4}
    # lease_ahead bounds what is claimed and not handed out yet: 4 - 0 buffered = 4 free.
    assert wq.prefetch() == 4
    assert states_of(url, "work_queue", "w") == {"claimed": 5, "done": 3}
    assert wq.take_many(4) == ["w4", "w5", "w6", "w7"]
    # The hand-out in use counts but its first item (reached as it is handed out): 4 - 3 = 1.
    assert wq.prefetch() == 1                     # w8
    assert wq.prefetch() == 0
    assert wq.take_many(0) == ["w8"]              # at least one
    assert wq.take_many(5) == ["w9"]              # the round trip claimed the last one
    with pytest.raises(wq_sql.QueueExhausted):
        wq.take_many(5)
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": 10}

def test_take_many_with_claim_leaves_the_rest_to_prefetch(url: str) -> None:
    works = [f"w{i}" for i in range(12)]
    wq = wq_sql.WorkQueue(works, shuffle=False, url=url, worker="w", lease_ahead=6)
    assert wq.take_many(2, claim=2) == ["w0", "w1"]  # the empty buffer: only this hand-out claimed
    assert claimed(url, "w") == 2
    assert wq.prefetch() == 5                        # 6 - 0 buffered - w1, not reached yet
    assert wq.take_many(2, claim=2) == ["w2", "w3"]  # from the buffer: claim= changes nothing
    assert claimed(url, "w") == 7
    assert wq.take_many(9, claim=9) == ["w4", "w5", "w6"]
    assert wq.take_many(1, claim=50) == ["w7"]      # claims up to lease_ahead: the five left
    assert states_of(url, "work_queue", "w") == {"claimed": 5, "done": 7}
    assert wq.take_many(5) == ["w8", "w9", "w10", "w11"]
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": 12}



def test_prefetch_from_another_thread_never_double_claims(url: str) -> None:
    works = [f"w{i}" for i in range(300)]
    wq = wq_sql.WorkQueue(works, num_epochs=2, url=url, worker="w", lease_ahead=4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def prefetcher() -> None:
        try:
            while not stop.is_set():
                wq.prefetch()
        except wq_sql.WqSqlError:
            pass  # closed
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=prefetcher) for _ in range(2)]
    for t in threads:
        t.start()
    got, most_ahead = [], 0
    for item in wq:
        got.append(str(item))
        most_ahead = max(most_ahead, wq.buffered)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    wq.close()
    assert errors == []
    assert sorted(got) == sorted(works * 2)
    assert most_ahead <= 4
    assert states_of(url, "work_queue", "w") == {"done": 600}


def test_close_gives_back_what_prefetch_claimed(url: str) -> None:
    wq = wq_sql.WorkQueue([f"w{i}" for i in range(10)], shuffle=False, url=url, worker="w", lease_ahead=5)
    wq.take()                                    # w0 handed out, w1..w4 buffered
    assert wq.prefetch() == 1                    # w5
    wq.close()                                   # w0 done, w1..w5 back to the queue
    assert states_of(url, "work_queue", "w") == {"done": 1, "pending": 5}


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("lease_ahead", [256, None])
def test_input_dataset_hands_out_at_most_hand_out_max_items_per_call(url: str,
                                                                    lease_ahead: Optional[int]) -> None:
    """A large lease_ahead (given, or grown by the automatic size on fast reads) still reaches the
    pipeline HAND_OUT_MAX items per Python call at most: what a crash may deliver again, what a
    checkpoint assumes read ahead and the acknowledgements of the last pull stay bounded."""
    works = [f"w{i}" for i in range(1000)]
    wq = WorkQueue(works, shuffle=False, url=url, worker="w",
                   **({} if lease_ahead is None else {"lease_ahead": lease_ahead}))
    sizes: list[int] = []
    hand_out = wq._next_many

    def counted(passes: Any = None, with_ids: bool = False) -> Any:
        got = hand_out(passes, with_ids)
        sizes.append(len(got))
        return got

    wq._next_many = counted  # type: ignore[method-assign]  # read by input_dataset()'s take
    assert [x.numpy().decode() for x in wq.input_dataset()] == works
    wq.close()
    assert max(sizes) == wq_sql_tf.HAND_OUT_MAX, sizes  # reached, never passed
    assert wq.default_read_ahead == wq_sql_tf.DEFAULT_READ_AHEAD + wq_sql_tf.HAND_OUT_MAX
    assert states_of(url, "work_queue", "w") == {"done": 1000}


@pytest.mark.parametrize("lease_ahead", [1, 4, 16])
def test_input_dataset_prefetches_in_the_background_within_lease_ahead(url: str, lease_ahead: int) -> None:
    works = [f"w{i}" for i in range(20)]
    before = set(threading.enumerate())
    wq = WorkQueue(works, shuffle=False, url=url, worker="w", lease_ahead=lease_ahead)
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False  # one pull = one item taken
    it = iter(wq.input_dataset().with_options(options))
    time.sleep(0.2)
    assert states_of(url, "work_queue", "w") == {}  # nothing before the first pull
    # The thread refills once half of lease_ahead is free (so that one round trip claims
    # several), up to lease_ahead claimed beyond what was handed out, never more. Hand-outs
    # are of k items: the pipeline's pulls reached into the second.
    k = max(1, (lease_ahead + 1) // 2)
    pulls = k + 1
    handed = 2 * k
    assert [next(it).numpy().decode() for _ in range(pulls)] == works[:pulls]

    def held() -> int:  # claimed or done by this worker
        return sum(states_of(url, "work_queue", "w").values())

    # Without the thread, the first round trip's lease_ahead items (or one per pull) would be all.
    assert wait_for(lambda: held() > max(lease_ahead, pulls))
    time.sleep(0.3)
    assert max(lease_ahead, pulls) < held() <= handed + lease_ahead
    assert states_of(url, "work_queue", "w").get("done", 0) <= pulls - 1  # done = pulled past
    assert [x.numpy().decode() for x in it] == works[pulls:]
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": 20}
    assert not [t for t in threading.enumerate() if t.name.startswith("wq_sql-refill") and t not in before]


def test_input_dataset_ends_on_the_takes_out_of_range_and_keeps_its_cardinality_unknown(url: str) -> None:
    """On the tested TensorFlow the hand-outs' map ends where the take raises OutOfRangeError
    (``wq_sql.tf._ending_map``, a private TF class: the public ``take_while`` form is the
    fallback); the pipeline still reads every work once, ends, and a new iterator ends at once."""
    from wq_sql import tf as wq_tf

    assert wq_tf._ending_map(tf.data.Dataset.from_tensors(0).repeat(), lambda x: x) is not None
    works = [f"w{i}" for i in range(7)]
    wq = WorkQueue(works, shuffle=False, url=url, worker="w", lease_ahead=4)
    ds = wq.input_dataset()
    assert ds.cardinality().numpy() == tf.data.UNKNOWN_CARDINALITY  # not "infinite": Keras' fit needs that
    assert [x.numpy().decode() for x in ds] == works
    assert list(ds) == []
    wq.close()
    assert states_of(url, "work_queue", "w") == {"done": 7}
