"""The lease-ahead bound of the core: everything this worker holds claimed that its consumer has
not reached (the buffer, plus the items of a ``take_many`` hand-out after the one being read)
stays within ``lease_ahead``, while the refill thread tops the buffer up in the background, for
a fixed and for the automatic size (docs/design.md, "How much a worker claims ahead")."""

from __future__ import annotations

import time
from typing import Optional

import pytest
from lease_bound import Unreached

from wq_sql import WorkQueue
from wq_sql.worker.sizing import first_claim, hand_out_size

FILES = 48


@pytest.mark.parametrize("lease_ahead", [1, 4, 16, None])
@pytest.mark.parametrize("per_call", ["one", "half"])
def test_claimed_not_reached_stays_within_lease_ahead(db_url: str, lease_ahead: Optional[int],
                                                       per_call: str, sizes: list[int]) -> None:
    """``one``: ``take()`` per item (the core's own claim-ahead); ``half``: hand-outs of half a
    round read item by item, the buffer refilled after each (what the shims do)."""
    works = [f"w{i:02d}" for i in range(FILES)]
    wq = WorkQueue(works, shuffle=False, url=db_url, worker="w", lease_ahead=lease_ahead)
    probe = Unreached(db_url, "work_queue", "w")
    bound = 0
    try:
        read = 0
        while read < FILES:
            k = 1 if per_call == "one" else hand_out_size(wq.lease_ahead)
            got = [wq.take()] if per_call == "one" else wq.take_many(k, claim=first_claim(k))
            if per_call == "half":
                wq.refill_soon(k)
            for item in got:  # the consumer reads the hand-out one item at a time
                time.sleep(0.004)
                held = probe.sample([item.work])
                bound = max(sizes)  # read after the sample: every size in force before it
                assert held <= bound, (probe.most, bound, read)
                read += 1
    finally:
        probe.close()
        wq.close()
    assert probe.samples == FILES
    if lease_ahead:
        assert bound == lease_ahead
