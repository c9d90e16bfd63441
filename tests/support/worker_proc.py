"""A worker process for the concurrency and crash tests, and the tests' handle on it.

Run as a script, it constructs the same ``WorkQueue(...)`` as every other worker of a test and
takes items, appending each one it receives to its own log file (``epoch seq work``, one line
per item, flushed before the next step), so a test can compare what the workers *received*
with what the table says. It reports on stdout, one flushed line per event:

    READY                      imports done, waiting for --barrier
    STARTED <seconds>          the WorkQueue was constructed (how long that took)
    CONFLICT <seconds>         the constructor raised WorkerConflict (exit code 3)
    HOLDING <epoch> <seq> <work>   holding the --hold-th item un-acked; now reads commands
    COMPLETED | LEASELOST      answer to the ``complete`` command
    EXHAUSTED <done> <failed>  take() raised QueueExhausted
    STOPPED                    --max-items reached

With ``--ack-log`` every item is ``complete()``-d explicitly after its work, and logged there
once ``complete()`` returned: what the worker was told is acknowledged.

Commands while holding (one per stdin line): ``complete`` (explicit ``complete()`` of the held
item), ``take`` (go on taking: the next take() acks the held item implicitly), ``exit`` (close
and exit). EOF on stdin exits without closing, like a crash.

The work list is ``w00000 ...``: ``--n-works`` items whose value repeats every ``--distinct``
items, so duplicate works (distinct items, same string) are part of every multiset check.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import queue as queue_mod
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()


def make_works(n_works: int, distinct: Optional[int] = None) -> list[str]:
    d = distinct or n_works
    return [f"w{i % d:05d}" for i in range(n_works)]


# ---------------------------------------------------------------- the worker (run as a script)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--worker", required=True)
    p.add_argument("--log", required=True, help="file that gets one line per item received")
    p.add_argument("--n-works", type=int, required=True)
    p.add_argument("--distinct", type=int, default=None)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--shuffle", type=int, default=1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--lease", type=float, default=60.0)
    p.add_argument("--heartbeat", type=float, default=None)
    p.add_argument("--lease-ahead", type=int, default=1)
    # Not the library's default (claim_ahead=True): these workers claim nothing behind the test's
    # back, so a test can say exactly which items a worker holds (tests/contract/test_chaos.py runs the
    # library's defaults).
    p.add_argument("--claim-ahead", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--barrier", default=None, help="wait for this file before constructing")
    p.add_argument("--hold", type=int, default=0, help="hold the n-th item received un-acked")
    p.add_argument("--max-items", type=int, default=0, help="close after this many items")
    p.add_argument("--item-ms", type=float, default=0.0, help="work on each item this long")
    p.add_argument("--ack-log", default=None,
                   help="complete() each item explicitly (auto_complete=False) and append "
                        "'epoch seq' to this file once complete() returned")
    return p.parse_args(argv)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    a = _parse(argv)
    # INFO from wq_sql and alembic lets a test count "created queue" and "Running upgrade".
    log_format = os.environ.get("WQ_SQL_LOG_FORMAT", "%(process)d %(name)s %(levelname)s %(message)s")
    logging.basicConfig(level=logging.WARNING, format=log_format)
    logging.getLogger("wq_sql").setLevel(logging.INFO)
    logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)
    from wq_sql import QueueExhausted, WorkerConflict, WorkQueue
    from wq_sql.errors import LeaseLost

    works = make_works(a.n_works, a.distinct)
    if a.barrier:
        _say("READY")
        deadline = time.monotonic() + 120
        while not os.path.exists(a.barrier):
            if time.monotonic() > deadline:
                _say("BARRIER-TIMEOUT")
                return 4
            time.sleep(0.005)
    t0 = time.monotonic()
    try:
        wq = WorkQueue(works, num_epochs=a.num_epochs, shuffle=bool(a.shuffle), seed=a.seed,
                       name=a.name, url=a.url, worker=a.worker, lease_seconds=a.lease,
                       heartbeat_seconds=a.heartbeat, lease_ahead=a.lease_ahead,
                       poll_seconds=a.poll, auto_complete=not a.ack_log, claim_ahead=bool(a.claim_ahead))
    except WorkerConflict as e:
        _say(f"CONFLICT {time.monotonic() - t0:.3f}")
        print(e, file=sys.stderr)
        return 3
    _say(f"STARTED {time.monotonic() - t0:.3f}")

    log = open(a.log, "a", encoding="utf-8")
    acks = open(a.ack_log, "a", encoding="utf-8") if a.ack_log else None
    n = 0
    while True:
        try:
            item = wq.take()
        except QueueExhausted as e:
            _say(f"EXHAUSTED {e.done} {e.failed}")
            break
        n += 1
        log.write(f"{item.epoch} {item.seq} {item.work}\n")
        log.flush()
        if a.item_ms:
            time.sleep(a.item_ms / 1000)
        if acks is not None:
            wq.complete(item)
            acks.write(f"{item.epoch} {item.seq}\n")
            acks.flush()
        if n == a.hold:
            _say(f"HOLDING {item.epoch} {item.seq} {item.work}")
            while True:
                cmd = sys.stdin.readline().strip()
                if cmd == "complete":
                    try:
                        wq.complete(item)
                        _say("COMPLETED")
                    except LeaseLost as e:
                        _say("LEASELOST")
                        print(e, file=sys.stderr)
                elif cmd == "take":
                    break
                elif cmd == "exit":
                    wq.close()
                    return 0
                else:  # EOF (the test went away) or garbage: leave like a crash
                    os._exit(5)
        if a.max_items and n >= a.max_items:
            _say("STOPPED")
            break
    wq.close()
    log.close()
    if acks is not None:
        acks.close()
    return 0


# ---------------------------------------------------------------- the tests' side


class Proc:
    """A running worker: its stdout lines arrive on a queue (read by a thread), its stderr goes
    to a file, and every wait has a timeout."""

    def __init__(self, url: str, name: str, worker: str, log: Path, n_works: int, *,
                 stderr_path: Optional[Path] = None, **opts: Any) -> None:
        args = [sys.executable, str(SCRIPT), "--url", url, "--name", name, "--worker", worker,
                "--log", str(log), "--n-works", str(n_works)]
        for k, v in opts.items():
            if v is not None:
                args += ["--" + k.replace("_", "-"), str(v)]
        self.worker, self.log = worker, log
        self.stderr_path = stderr_path or log.with_suffix(".err")
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("WQ_SQL_WORKER", None)
        env.pop("TF_CONFIG", None)
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._stderr, env=env, text=True)
        self.pid = self.p.pid
        self.lines: list[str] = []
        self._q: queue_mod.Queue[Optional[str]] = queue_mod.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def expect(self, prefix: str | tuple[str, ...], timeout: float = 60.0) -> str:
        """The next stdout line starting with ``prefix`` (or one of several); the lines skipped
        are kept in ``lines``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._q.get(timeout=max(0.0, left))
            except queue_mod.Empty:
                raise AssertionError(f"{self.worker}: no {prefix!r} line within {timeout}s; "
                                     f"got {self.lines}; stderr:\n{self.stderr()}") from None
            if line is None:
                self._q.put(None)
                raise AssertionError(f"{self.worker} exited (rc={self.p.poll()}) before "
                                     f"printing {prefix!r}; got {self.lines}; stderr:\n{self.stderr()}")
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def send(self, command: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(command + "\n")
        self.p.stdin.flush()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.p.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.p.wait(timeout=30)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.worker} still running after {timeout}s; stdout {self.lines}; "
                                 f"stderr:\n{self.stderr()}") from None

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for a clean exit and return the rc (asserting 0 is the caller's business)."""
        rc = self.wait(timeout)
        while True:  # drain the remaining stdout lines
            try:
                line = self._q.get(timeout=5)
            except queue_mod.Empty:
                break
            if line is None:
                self._q.put(None)
                break
            self.lines.append(line)
        return rc

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def received(self) -> list[tuple[int, int, str]]:
        """What this process received, from its own log."""
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            e, s, w = line.split(" ", 2)
            out.append((int(e), int(s), w))
        return out

    def cleanup(self) -> None:
        if self.p.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.p.stdin, self._stderr):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def query(url: str, sql: str, **params: Any) -> list[Any]:
    """Rows of one SQL query, on a short-lived engine of the test process."""
    import sqlalchemy as sa

    from wq_sql.store.engine import resolve_url

    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.connect() as c:
            return list(c.execute(sa.text(sql), params).all())
    finally:
        engine.dispose()


def query_commit(url: str, sql: str, **params: Any) -> None:
    """Run one writing statement and commit it."""
    import sqlalchemy as sa

    from wq_sql.store.engine import resolve_url

    engine = sa.create_engine(resolve_url(url))
    try:
        with engine.begin() as c:
            c.execute(sa.text(sql), params)
    finally:
        engine.dispose()


def received_multiset(procs: list[Proc]) -> collections.Counter[str]:
    return collections.Counter(w for p in procs for _, _, w in p.received())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
