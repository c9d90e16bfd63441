"""The chaos suites' replay of a queue's history, read in its stored form: one ``wq_events`` row
per delivery, written when the delivery ended, with the delivery's ``claimed_at`` and attempt.

:func:`replay` reads every item's deliveries in id order and checks what holds for any queue:

* every row that ends a delivery carries its ``claimed_at`` and ``attempt``;
* deliveries of one item never overlap: a delivery is claimed only once the one before it ended
  (``claimed_at >= `` the previous row's ``at``), except the delivery a ``recover`` begins, which
  goes on at once under the same worker identity with the same ``claimed_at``;
* ``attempt`` moves as ``wq_items.attempts`` does: +1 after a ``fail``, ``expire`` or ``recover``,
  unchanged after a ``release``;
* the item's last delivery, if it ended ``done``, was acknowledged by the item's holder (the row's
  worker and ``claimed_at`` are the item row's);
* ``wq_history`` shows exactly one ``claim`` or ``recover`` row per delivery, and the stored rows.

The suites then check their own invariants on the :class:`Delivery` lists it returns.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

from worker_proc import query


@dataclass(frozen=True)
class Delivery:
    worker: Optional[str]
    claimed_at: Any          # str on SQLite (the stored text), datetime on Postgres
    ended_at: Any
    end: str                 # the row's kind: done, release, fail, expire, recover, requeue
    attempt: int
    after_requeue: bool      # an operator requeued the item (done or failed) since the delivery before


def replay(url: str, queue: str) -> dict[tuple[int, int], list[Delivery]]:
    """Every (epoch, seq)'s ended deliveries, in order, after the checks of the module docstring."""
    rows = query(url, "SELECT e.epoch, e.seq, e.kind, w.name, e.claimed_at, e.at, e.attempt "
                      "FROM wq_events e JOIN wq_queues q ON q.id = e.queue_id "
                      "LEFT JOIN wq_workers w ON w.id = e.worker_id WHERE q.name = :q ORDER BY e.id", q=queue)
    out: dict[tuple[int, int], list[Delivery]] = collections.defaultdict(list)
    requeued: set[tuple[int, int]] = set()
    for e, s, kind, worker, claimed_at, at, attempt in rows:
        assert kind != "claim", f"{(e, s)}: a stored claim row (only converted history has them)"
        if kind == "requeue" and claimed_at is None:
            requeued.add((e, s))  # a done or failed item put back: ends no delivery
            continue
        assert claimed_at is not None and attempt is not None, f"{(e, s)}: {kind} row without its delivery"
        out[(e, s)].append(Delivery(worker, claimed_at, at, kind, attempt, (e, s) in requeued))
        requeued.discard((e, s))
    for key, ds in out.items():
        for prev, d in zip(ds, ds[1:]):
            if prev.end == "recover":
                assert (d.worker, d.claimed_at) == (prev.worker, prev.claimed_at), (
                    f"{key}: the delivery a recover began is {d}, after {prev}")
            else:
                assert d.claimed_at >= prev.ended_at, f"{key}: {d} claimed while {prev} was held"
            counted = prev.end in ("fail", "expire", "recover")
            assert d.after_requeue or d.attempt == prev.attempt + counted, (
                f"{key}: attempt {d.attempt} after {prev}")
    last = {(e, s): (state, w, c) for e, s, state, w, c in query(
        url, "SELECT i.epoch, i.seq, i.state, w.name, i.claimed_at FROM wq_items i "
             "JOIN wq_queues q ON q.id = i.queue_id LEFT JOIN wq_workers w ON w.id = i.worker_id "
             "WHERE q.name = :q", q=queue)}
    for key, ds in out.items():
        if ds[-1].end == "done":
            state, holder, claimed_at = last[key]
            assert (state, holder, claimed_at) == ("done", ds[-1].worker, ds[-1].claimed_at), (
                f"{key}: done by {ds[-1]}, but the item row says {last[key]}")
    # The view: one claim or recover per delivery (plus one per item still claimed).
    starts = collections.Counter((e, s) for e, s in query(
        url, "SELECT epoch, seq FROM wq_history WHERE queue = :q AND kind IN ('claim', 'recover')", q=queue))
    flying = {key for key, (state, _, _) in last.items() if state == "claimed"}
    assert starts == {key: len(out.get(key, [])) + (key in flying) for key in set(out) | flying}, (
        "wq_history's claim and recover rows are not one per delivery")
    return dict(out)
