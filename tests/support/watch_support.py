"""What the metrics and dashboard tests share: a queue made by ``wq-sql create``, worker processes
that drain it (``python tests/support/watch_support.py URL NAME WORKER ITEM_MS``), and the long-running
servers (``wq-sql metrics``/``dashboard``) started as real processes.

A worker takes items until the queue is exhausted, works ``ITEM_MS`` on each, and fails every
item whose work contains ``poison`` with the error ``boom: cannot parse <work>`` (so, with
``--max-attempts 2``, each such item is delivered twice and ends ``failed``). It prints
``EXHAUSTED`` at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]
POISON = "poison"


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def create_queue(url: str, tmp_path: Path, name: str, n: int, *, epochs: int = 1, poison_every: int = 0,
                 max_attempts: int = 2) -> list[str]:
    works = [f"{POISON}{i:05d}" if poison_every and i % poison_every == poison_every - 1 else f"w{i:05d}"
             for i in range(n)]
    listing = tmp_path / f"{name}.txt"
    listing.write_text("".join(w + "\n" for w in works))
    subprocess.run([sys.executable, "-m", "wq_sql", "create", name, "--works-from", str(listing), "--epochs",
                    str(epochs), "--seed", "7", "--max-attempts", str(max_attempts), "--url", url],
                   check=True, capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=120)
    return works


def start_worker(url: str, name: str, worker: str, item_ms: float, tmp_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), url, name, worker, str(item_ms)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / f"{worker}.err", "w"), text=True,
                            env=env(), cwd=tmp_path)


def start_server(*argv: str, tmp_path: Path, timeout: float = 60) -> tuple[subprocess.Popen[str], str]:
    """``python -m wq_sql ARGV`` that serves; returns it and the address it prints once listening."""
    p = subprocess.Popen([sys.executable, "-m", "wq_sql", *argv], stdout=subprocess.PIPE,
                         stderr=open(tmp_path / f"{argv[0]}.err", "w"), text=True, env=env(), cwd=tmp_path)
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    line = p.stdout.readline()  # the process prints this line once it listens, or exits
    if time.monotonic() > deadline or not line:
        p.kill()
        raise AssertionError(f"{argv[0]} did not start: {(tmp_path / (argv[0] + '.err')).read_text()}")
    m = re.search(r"on (http://\S+)", line)
    assert m, line
    return p, m.group(1)


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.wait(timeout=30)
        if p.stdout is not None:
            p.stdout.close()


def pause(procs: list[subprocess.Popen[str]], on: bool, db_url: Optional[str] = None) -> None:
    """Stop (SIGSTOP) or continue the processes. Stopping returns once each one is stopped and,
    with ``db_url`` on Postgres, once the server has finished every statement they had sent (a
    COMMIT already on its way lands meanwhile): from then on, nothing changes in the database."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGSTOP if on else signal.SIGCONT)
    if not on:
        return
    deadline = time.monotonic() + 30
    for p in procs:
        while p.poll() is None and _proc_state(p.pid) not in ("T", "t", "Z", None):
            assert time.monotonic() < deadline, f"process {p.pid} did not stop"
            time.sleep(0.005)
    if db_url is None or not db_url.startswith("postgresql"):
        return
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as c:
            while c.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state = 'active' AND pid <> pg_backend_pid()")).scalar():
                assert time.monotonic() < deadline, "the workers' statements did not finish"
                c.rollback()
                time.sleep(0.005)
    finally:
        engine.dispose()


def _proc_state(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def wait_exhausted(p: subprocess.Popen[str], timeout: float = 120) -> None:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0 and "EXHAUSTED" in out, (p.returncode, out)


@contextlib.contextmanager
def database_away(db_url: str) -> Iterator[Callable[[], None]]:
    """Postgres: take the test's database away (its sessions terminated, the database renamed, so
    new connections fail as in an outage); the caller brings it back with the function yielded
    (or it comes back at the end). A reader that reconnects between the two steps makes the
    rename fail: both are repeated until it works."""
    url = sa.engine.make_url(db_url)
    away = f"{url.database}_away"
    admin = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")

    def rename(a: str, b: str) -> None:
        for _ in range(50):
            with admin.connect() as c:
                c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE datname = :d"), {"d": a})
                try:
                    c.execute(sa.text(f'ALTER DATABASE "{a}" RENAME TO "{b}"'))
                    return
                except sa.exc.OperationalError:  # "is being accessed by other users": again
                    continue
        raise AssertionError(f"could not rename database {a!r}")

    def back() -> None:
        with admin.connect() as c:
            if c.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": away}).first():
                rename(away, str(url.database))

    rename(str(url.database), away)
    try:
        yield back
    finally:
        back()
        admin.dispose()


def main(argv: Optional[list[str]] = None) -> int:
    url, name, worker, item_ms = (argv or sys.argv[1:])[:4]
    from wq_sql import QueueExhausted, WorkQueue

    # Heartbeats every 2 s: a test that stops the workers (SIGSTOP) for a comparison never makes
    # one look gone to the others (3 missed beats).
    wq = WorkQueue.attach(name, url=url, worker=worker, heartbeat_seconds=2.0, lease_seconds=30)
    while True:
        asked = time.perf_counter()
        try:
            item = wq.take()
        except QueueExhausted:
            break
        wq.add_input_wait(time.perf_counter() - asked)  # the loop's waiting on data, as a shim's
        time.sleep(float(item_ms) / 1000)
        if POISON in item.work:
            wq.fail(item, f"boom: cannot parse {item.work}")
    wq.close()
    print("EXHAUSTED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
