"""Running worker processes as the field runs them: beside CPU burners, under a hang detector.

``burners(n)`` starts ``n`` busy-loop processes (each stops by itself after ``seconds``, and is
killed when the block ends). ``run_all(cmds, hang=...)`` starts every command with
``PYTHONFAULTHANDLER=1`` and waits; if any is still running after ``hang`` seconds, every process
still alive gets ``SIGABRT``, on which faulthandler writes the Python stacks of all its threads
to stderr, and :class:`Hung` is raised with every process's output. A hang is never just a
timeout: it arrives with the stacks that show where each process waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BURN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def burners(n: int = 2, seconds: float = 600.0) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes that keep a core busy each, for at most ``seconds``."""
    procs = [subprocess.Popen([sys.executable, "-c", _BURN.format(s=seconds)]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@dataclass
class Finished:
    cmd: Sequence[str]
    returncode: int
    stdout: str
    stderr: str


class Hung(AssertionError):
    """Processes still running after the hang timeout; the message holds their stacks."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout importable, faulthandler on (stacks on SIGABRT), TensorFlow quiet."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})}


def run_all(cmds: Sequence[Sequence[str]], hang: float, env: dict[str, str] | None = None,
            cwd: Path | None = None, started: Callable[[], bool] | None = None,
            start_timeout: float = 600.0) -> list[Finished]:
    """Run ``cmds`` concurrently; raise :class:`Hung` (with every process's stacks and output) if
    they have not all ended ``hang`` seconds after ``started()`` first returned true (default:
    at once). Start-up (imports on a busy machine can take a minute) is bounded by
    ``start_timeout`` instead."""
    full_env = child_env(env)
    procs = [subprocess.Popen(list(c), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=full_env, cwd=cwd) for c in cmds]
    deadline = time.monotonic() + (hang if started is None else start_timeout)
    clock_started = started is None
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if not clock_started and started is not None and started():
                clock_started, deadline = True, time.monotonic() + hang
            time.sleep(0.05)
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.send_signal(signal.SIGABRT)  # faulthandler dumps every thread's stack, then it dies
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    done = [Finished(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, outs)]
    if hung:
        report = "\n\n".join(f"--- {' '.join(map(str, f.cmd))[-120:]} (exit {f.returncode})\n"
                             f"stdout:\n{f.stdout[-3000:]}\nstderr:\n{f.stderr[-12000:]}" for f in done)
        when = f"{hang:.0f}s after they started" if clock_started else "start-up"
        raise Hung(f"{len(hung)} of {len(procs)} process(es) still running {when}; "
                   f"their stacks:\n{report}")
    return done
