"""This process's side of queue objects: the objects open in it, closed (acknowledging what
they handed out) at a clean interpreter exit and given fresh locks in a child after ``fork()``
before it touches them (a lock another thread of the parent held at the fork would stay held
forever there); and :func:`weak_method`, the callbacks of the services (heartbeat, epoch maker,
refill thread) into their owner that do not keep it alive, so a queue object dropped without
``close()`` is freed at once and its threads end."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Any, Callable, TypeVar

log = logging.getLogger("wq_sql")

# Each open object and what gives it fresh locks after a fork (a weak key: an object nobody
# holds any more is not kept alive by this registry).
_open: weakref.WeakKeyDictionary[Any, Callable[[], None]] = weakref.WeakKeyDictionary()


def add(obj: Any, fresh_locks: Callable[[], None]) -> None:
    """Register ``obj`` (it has ``close()`` and ``name``); ``fresh_locks`` must not refer to it."""
    _open[obj] = fresh_locks


def discard(obj: Any) -> None:
    _open.pop(obj, None)


def open_objects() -> list[Any]:
    return list(_open.keys())


@atexit.register
def _close_all() -> None:
    """A normal interpreter exit is a clean exit: acknowledge what was handed out."""
    for obj in open_objects():
        try:
            obj.close()
        except Exception as e:  # the database may be gone at exit; leases cover it
            log.warning("closing queue %r at exit failed: %s", obj.name, e)


def _after_fork_in_child() -> None:
    for fresh_locks in list(_open.values()):
        fresh_locks()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


T = TypeVar("T")


def weak_method(method: Callable[..., T], default: T) -> Callable[..., T]:
    """``method`` (a bound method), called while its object lives; ``default`` after."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> T:
        m = ref()
        return default if m is None else m(*args, **kwargs)

    return call
