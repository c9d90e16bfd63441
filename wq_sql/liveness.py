"""Whether another worker that holds items is gone, so a live one can return them early.

The rule (README, "When a worker dies"): a worker is gone when its last heartbeat is
``ops.STALE_BEATS`` of its own heartbeat periods old (15 s with the defaults, a quarter of the
lease), or at once when it ran on this host and its process is dead (its pid is gone, a zombie,
or reused by another process). Processes that share a hostname must share a process table.
"""

from __future__ import annotations

from typing import Optional

from wq_sql.identity import process_alive
from wq_sql.ops import Holder


def why_gone(holder: Holder, host: str) -> Optional[tuple[str, bool]]:
    """Why ``holder`` is gone, for the log and the ``expire`` event, and whether it is known
    dead (else only its heartbeat is stale); None while it may be alive."""
    if holder.host == host and not process_alive(holder.pid, holder.proc_start):
        return f"worker {holder.name!r} died (its process {holder.pid} on {holder.host} is gone)", True
    if holder.stale:
        return (f"worker {holder.name!r} stopped heartbeating (last heartbeat {holder.age:.1f} s ago, "
                f"pid {holder.pid} on {holder.host})"), False
    return None
