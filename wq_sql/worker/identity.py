"""Who a worker is, and whether a process holding an identity is still alive."""

from __future__ import annotations

import json
import os
import socket
from typing import Optional


def default_worker_name() -> str:
    """``$WQ_SQL_WORKER``, else ``type:index`` from ``$TF_CONFIG``, else ``host:pid``.

    The first two survive a restart, so a restarted worker gets its un-acked items back at once;
    ``host:pid`` does not, and its items return to the queue when their lease expires."""
    name = os.environ.get("WQ_SQL_WORKER")
    if name:
        return name
    tf_config = os.environ.get("TF_CONFIG")
    if tf_config:
        try:
            task = json.loads(tf_config).get("task") or {}
            if "type" in task and "index" in task:
                return f"{task['type']}:{task['index']}"
        except (ValueError, AttributeError):
            pass
    return f"{socket.gethostname()}:{os.getpid()}"


def check_worker_name(name: object) -> str:
    from wq_sql.errors import InvalidInput
    from wq_sql.plan import check_text

    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidInput(f"worker must be a non-empty str of at most 200 characters, got {name!r}")
    if "\x00" in name:
        raise InvalidInput(f"worker must not contain a NUL character, which neither backend can store, "
                           f"got {name!r}")
    check_text("worker", name)  # a lone surrogate, e.g. from undecodable bytes (surrogateescape)
    return name.strip()


def hostname() -> str:
    return socket.gethostname()[:255]


def process_start(pid: int) -> Optional[int]:
    """The kernel's start time of ``pid`` (clock ticks since boot), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its closing paren.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: Optional[int]) -> bool:
    """Whether ``pid`` on this host is the same live process that registered (not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now_start = process_start(pid)
    if now_start is None:
        return start is None  # no /proc: trust the signal check
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        if state in (b"Z", b"X"):
            return False
    except (OSError, IndexError):
        pass
    return start is None or now_start == start
