"""What the hot path's foreign keys cost Postgres (migration 0009 dropped two of them).

Two scratch databases, measured alternately in the same run: ``head`` (the schema as migrated
today) and ``keys`` (the same, with the two foreign keys 0009 dropped added back under their old
names: ``wq_items.worker_id -> wq_workers``, checked at every claim, and ``wq_events.queue_id ->
wq_queues``, checked at every history row). For each:

* rounds: one connection claims and acknowledges ``--items`` items in rounds of ``--round``
  with the claim path's own round (``ClaimRound``); the server backend's CPU (from
  ``/proc``) and the wall time, per item. Needs the server on this machine.
* MultiXacts: ``--procs`` workers drain ``--items`` items with ``lease_ahead=4``; the MultiXact ids
  the server handed out meanwhile (``pg_control_checkpoint()`` after a ``CHECKPOINT`` before and
  after). A foreign key check takes a KEY SHARE lock on the parent row: concurrent ones on the one
  queue row need a MultiXact, which the server must later freeze (anti-wraparound vacuum).

    .venv/bin/python bench/pg_hot_keys.py --repeats 5
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PG_ADMIN, git_rev, machine, median, scratch_pg  # noqa: E402

from wq_sql import QueueExhausted, WorkQueue  # noqa: E402
from wq_sql.claim import ClaimRound  # noqa: E402
from wq_sql.dialects import Dialect  # noqa: E402
from wq_sql.engine import resolve_url  # noqa: E402


def _keys() -> list[tuple[str, str, str, str, str]]:
    """Migration 0009's dropped keys: (constraint, table, column, referred table, ON DELETE)."""
    path = Path(__file__).resolve().parent.parent / "migrations" / "versions" / "0009_hot_path_foreign_keys.py"
    spec = importlib.util.spec_from_file_location("wq_sql_migration_0009", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.KEYS)


def _raw(url: str) -> Any:
    import psycopg2
    u = resolve_url(url)
    conn = psycopg2.connect(host=u.host, port=u.port or 5432, user=u.username, password=u.password,
                            dbname=u.database)
    conn.autocommit = True
    return conn


def prepare(url: str, keys: bool) -> None:
    WorkQueue(["x"], name="setup", url=url, worker="setup").close()  # the schema, at head
    if keys:
        conn = _raw(url)
        with conn.cursor() as cur:
            for name, table, column, referred, ondelete in _keys():
                cur.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({column}) "
                            f"REFERENCES {referred} (id) ON DELETE {ondelete}")
        conn.close()


def _backend_cpu_ms(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def rounds(url: str, items: int, size: int) -> tuple[float, float]:
    """Server CPU and wall time per item (us) of claiming and acknowledging ``items`` in rounds of
    ``size``: the claim path's own round (``ClaimRound``), each call its own transaction."""
    name = f"r{time.monotonic_ns()}"
    WorkQueue([f"w{i}" for i in range(items)], name=name, url=url, worker="creator", shuffle=False,
              claim_ahead=False).close()
    conn = _raw(url)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT q.id, w.id FROM wq_queues q JOIN wq_workers w ON w.queue_id = q.id "
                        "WHERE q.name = %s", (name,))
            qid, wid = cur.fetchone()
            cur.execute("SELECT pg_backend_pid()")
            pid = cur.fetchone()[0]
        rnd = ClaimRound(Dialect("postgresql"), size, lease_seconds=60)
        rnd.warm(conn, "")
        acks: list[tuple[int, int]] = []
        c0, t0 = _backend_cpu_ms(pid), time.perf_counter()
        while True:
            _, got, _ = rnd.run(conn, qid, wid, acks)
            acks = [(c.id, c.token) for c in got]
            if not acks:
                break
        wall, cpu = time.perf_counter() - t0, _backend_cpu_ms(pid) - c0
    finally:
        conn.close()
    return cpu * 1e3 / items, wall * 1e6 / items


def _next_multixact(url: str) -> int:
    conn = _raw(url)
    try:
        with conn.cursor() as cur:
            cur.execute("CHECKPOINT")
            cur.execute("SELECT next_multixact_id FROM pg_control_checkpoint()")
            return int(cur.fetchone()[0])
    finally:
        conn.close()


def _drain(url: str, name: str, i: int) -> None:
    wq = WorkQueue.attach(name, url=url, worker=f"d{i}", lease_ahead=4)
    try:
        while True:
            wq.take()
    except QueueExhausted:
        pass
    finally:
        wq.close()


def multixacts(url: str, items: int, procs: int) -> tuple[int, float]:
    """MultiXacts made and seconds taken while ``procs`` workers drain ``items``."""
    name = f"m{time.monotonic_ns()}"
    WorkQueue([f"w{i}" for i in range(items)], name=name, url=url, worker="creator", shuffle=False).close()
    m0, t0 = _next_multixact(url), time.perf_counter()
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_drain, args=(url, name, i)) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(600)
        assert p.exitcode == 0, p.exitcode
    seconds = time.perf_counter() - t0
    return _next_multixact(url) - m0, seconds


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=4000)
    ap.add_argument("--round", type=int, default=256, help="items per claim round (rounds)")
    ap.add_argument("--procs", type=int, default=8, help="draining workers (MultiXacts)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pg", default=PG_ADMIN)
    ns = ap.parse_args(argv)
    print("#", machine(), "rev", git_rev(), flush=True)
    got: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": [], "mx": [], "drain": []}
                                               for v in ("head", "keys")}
    with scratch_pg(ns.pg, tag="keys_head") as head, scratch_pg(ns.pg, tag="keys_old") as keys:
        urls = {"head": head, "keys": keys}
        prepare(head, keys=False)
        prepare(keys, keys=True)
        for rep in range(ns.repeats):
            for v in (("head", "keys") if rep % 2 == 0 else ("keys", "head")):
                cpu, wall = rounds(urls[v], ns.items, ns.round)
                mx, drain = multixacts(urls[v], ns.items, ns.procs)
                for k, x in (("cpu", cpu), ("wall", wall), ("mx", mx), ("drain", drain)):
                    got[v][k].append(x)
                print(f"  rep {rep} {v:4s}: rounds of {ns.round}: server CPU {cpu:.1f} us/item, wall {wall:.1f} "
                      f"us/item; {ns.procs} workers draining {ns.items}: {mx} MultiXacts, {drain:.2f} s "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    h, k = ({m: median(got[v][m]) for m in ("cpu", "wall", "mx", "drain")} for v in ("head", "keys"))
    print(f"\n## Postgres hot path with and without the two foreign keys (medians of {ns.repeats})\n")
    print("| | server CPU per item (rounds) | wall per item (rounds) | MultiXacts per drain | drain s |")
    print("|---|---|---|---|---|")
    print(f"| with the keys (0008) | {k['cpu']:.1f} us | {k['wall']:.1f} us | {k['mx']:.0f} | {k['drain']:.2f} |")
    print(f"| without (0009, head) | {h['cpu']:.1f} us | {h['wall']:.1f} us | {h['mx']:.0f} | {h['drain']:.2f} |")
    print(f"| head / with | {h['cpu'] / k['cpu']:.2f}x | {h['wall'] / k['wall']:.2f}x | | "
          f"{h['drain'] / k['drain']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
