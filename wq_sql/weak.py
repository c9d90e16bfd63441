"""Callbacks that do not keep their owner alive.

A service (the heartbeat, the epoch maker, the refill thread) calls back into the queue object
that owns it. Holding the owner's bound methods strongly would make a cycle, so a queue object
that its user dropped without ``close()`` would live (and heartbeat) until the cyclic garbage
collector runs; through :func:`weak_method` it is freed at once and its threads end.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def weak_method(method: Callable[..., T], default: T) -> Callable[..., T]:
    """``method`` (a bound method), called while its object lives; ``default`` after."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> T:
        m = ref()
        return default if m is None else m(*args, **kwargs)

    return call
