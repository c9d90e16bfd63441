"""The loader state of checkpoint-consistent resume: what ``DataLoader.state_dict()`` saves and
``load_state_dict()`` accepts, checked whole before anything is written, so that a state from
another queue, of another format version, cut short or damaged gets one clear error and leaves
the queue as it was."""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Optional

from wq_sql.errors import InvalidInput

STATE_VERSION = 1

_KEYS = ("version", "queue", "worker", "step", "epoch", "pass_ended", "items")


@dataclass(frozen=True)
class LoaderState:
    """A checked loader state (see :meth:`wq_sql.torch.DataLoader.state_dict`)."""

    queue: str
    worker: str  # the rank identity that saved it
    step: int  # batches yielded before it was taken
    epoch: int  # the pass's epoch (-1: before the first pass)
    pass_ended: bool
    items: tuple[int, ...]  # the ids of the items its checkpoint covers
    mark: Optional[int]  # the queue's event mark when it was taken (None: not recorded)

    @property
    def next_epoch(self) -> int:
        """The epoch of the pass that resumes from it."""
        return self.epoch + (1 if self.pass_ended else 0)


def _int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def parse(state: Any, queue: str) -> LoaderState:
    """``state`` checked as a loader state of ``queue``; :class:`InvalidInput` saying what is wrong
    and what to do otherwise."""
    if not isinstance(state, dict):
        raise InvalidInput(f"not a wq_sql.torch loader state (the dict DataLoader.state_dict() returns): got "
                           f"{type(state).__name__}")
    if "version" not in state:
        raise InvalidInput("not a wq_sql.torch loader state: it has no 'version' (DataLoader.state_dict() "
                           f"saves {', '.join(_KEYS)}); pass the state saved from the wq_sql.torch "
                           f"DataLoader, not another object's. Keys given: {sorted(map(str, state))[:10]}")
    if state["version"] != STATE_VERSION:
        raise InvalidInput(f"this loader state has format version {state['version']!r}; this wq_sql reads "
                           f"version {STATE_VERSION}: restore it with the wq_sql release that saved it, or "
                           "resume from a checkpoint saved by this one")
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise InvalidInput(f"this loader state is incomplete (no {', '.join(map(repr, missing))}): the "
                           "checkpoint holding it was cut short or edited; resume from another checkpoint")
    checks = {"queue": isinstance(state["queue"], str) and state["queue"] != "",
              "worker": isinstance(state["worker"], str) and state["worker"] != "",
              "step": _int(state["step"], 0), "epoch": _int(state["epoch"], -1),
              "pass_ended": isinstance(state["pass_ended"], bool),
              "items": isinstance(state["items"], (list, tuple)) and all(_int(i, 1) for i in state["items"]),
              "mark": state.get("mark") is None or _int(state["mark"], 0)}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        shown = ", ".join(f"{k}={state.get(k)!r:.80}" for k in bad)
        raise InvalidInput(f"this loader state is damaged ({shown}: queue and worker are names, step an "
                           "int >= 0, epoch an int >= -1, pass_ended a bool, items a list of item ids, "
                           "mark an int); resume from another checkpoint")
    if state["queue"] != queue:
        raise InvalidInput(f"this loader state belongs to queue {state['queue']!r}, not {queue!r}: pass the "
                           "state saved by this queue's loader (each queue's loader saves its own)")
    return LoaderState(state["queue"], state["worker"], state["step"], state["epoch"], state["pass_ended"],
                       tuple(state["items"]), state.get("mark"))


def rank_of_job() -> tuple[int, int]:
    """This process's ``(RANK, WORLD_SIZE)`` as torchrun sets them (``(0, 1)`` without)."""
    try:
        return int(os.environ.get("RANK", "0")), max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 0, 1


def staying_ranks(writer: str, world: int) -> Optional[Collection[str]]:
    """The identities, in the naming of ``writer`` (``<prefix>/rank<R>``), of the ranks of a job of
    ``world`` ranks: the ranks that come back and restore their own states. None when ``writer``
    is not named that way (then no rank speaks for others)."""
    m = re.fullmatch(r"(.*/)?rank\d+", writer)
    if m is None:
        return None
    return {f"{m.group(1) or ''}rank{k}" for k in range(world)}
