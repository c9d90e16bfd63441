"""The headline benchmarks (``make bench``): the targets of BENCHMARKS.md's summary that fit in
5-10 minutes on a 2-core machine, each benchmark run as its own subprocess with its
``--json`` output, then one table: target, goal, measured ratio, verdict. The figures go into
``bench/results.json`` and the tables made from it (``bench/summary.py``; ``--no-record``: not).

    .venv/bin/python bench/headline.py                       # everything, both backends
    .venv/bin/python bench/headline.py --only claims,tail    # some of it
    .venv/bin/python bench/headline.py --backends sqlite     # without Postgres
    .venv/bin/python bench/headline.py --list                # the commands, nothing run

The set (issue 16's targets; same-run ratios, medians of 3, of 7 for the TF rows):

* ``claims``   ``bench/claim_throughput.py``: ``take()`` against the raw driver, 1 process,
               lease-ahead 1 and 32, 100,000-item queue, 2 s per run (SQLite and Postgres).
               Each row also shows wq_sql's own claim round (``claim.ClaimRound``: the
               acknowledgements' history rows and counters too) issued by the bare driver loop
               (``raw_same``), against raw: on SQLite the most ``take()`` can reach with an audit
               row per delivery; on Postgres above 1x (the round is one server-side function with
               cached plans, raw's statements are planned at every call).
* ``tail``     ``bench/long_tail.py --scenarios slow --defaults``: 8 workers, one 4x slow, 1,600
               items of 20 ms, the library's default settings, against the ideal bound.
* ``tf``       ``bench/tf_textline.py --lease-ahead default --runs 7``: ``TextLineDataset(wq.input_dataset())``
               against the plain file list, 1,000 files of 100 and of 1,000 lines, default settings.
               7 runs: at 3 the 100-line rows moved by more than their gap to the target from one
               headline run to the next on a 2-core VM (BENCHMARKS.md, the 20:42 run of 11-26).
               With ``--floor 64``: each row also shows its floor, plain reading beside only the
               durable statements, and the time the pipeline spent inside the shim's hand-outs.
* ``rollover`` ``bench/scale.py rollover --backend sqlite --procs 8``: the longest ``take()`` of 8
               processes claiming across an epoch roll-over of a 1,000,000-work queue.

Postgres: the admin URL ``--pg`` (default ``$WQ_SQL_BENCH_PG``, else
``postgresql://postgres@127.0.0.1:5432/postgres``); every benchmark works in scratch databases
of its own and drops them. If the server cannot be reached, its rows say "not measured".

The machine these run on is shared: a step that ran at a 1-minute load average above the number
of cores gets its verdict marked provisional (``*``). Rerun on a quiet machine before quoting it.
Each step has a time limit (``--step-timeout``); a step that fails or runs out of time is reported
as not measured, with why, and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CLAIM_GOALS, PG_ADMIN, git_rev, machine, median, scratch_pg  # noqa: E402

from wq_sql.store.engine import resolve_url  # noqa: E402

BENCH = Path(__file__).resolve().parent
PY = sys.executable
CORES = os.cpu_count() or 1


@dataclass
class Row:
    """One line of the table: a target, its goal, what was measured, the verdict."""

    target: str
    goal: str
    measured: str = "-"
    verdict: str = "not measured"
    load: Optional[float] = None
    step: str = ""
    value: Optional[float] = None


@dataclass
class Step:
    """One benchmark invocation, and how its JSON becomes rows."""

    name: str                      # claims / tail / tf / rollover
    backend: str                   # sqlite / postgresql
    argv: list[str]                # after the Python executable; "{json}" and "{url}" filled in
    rows: Callable[[Any], list[Row]]
    blank: list[Row] = field(default_factory=list)  # the rows, unmeasured (for failures)
    needs_tf: bool = False
    scratch_url: bool = False      # give it a scratch Postgres database as {url}


def _label(backend: str) -> str:
    return {"sqlite": "SQLite", "postgresql": "Postgres"}[backend]


def _verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------- reading each benchmark's JSON


def _claim_target(backend: str, n: int) -> str:
    return f"{_label(backend)} `take()` / raw driver, lease-ahead {n}, 1 process"


def claim_rows(backend: str) -> Callable[[Any], list[Row]]:
    def rows(runs: list[dict[str, Any]]) -> list[Row]:
        out = []
        for n in (32, 1):
            sel = {v: sorted((r for r in runs if r["backend"] == backend and r["lease_ahead"] == n
                              and r["variant"] == v), key=lambda r: r["rep"])
                   for v in ("wq_sql", "raw", "raw_same")}
            goal = CLAIM_GOALS[(backend, n)]
            row = Row(_claim_target(backend, n), f">= {goal:.2f}x")
            if sel["wq_sql"] and sel["raw"]:
                # as claim_throughput.py reports it: the median of the per-repeat ratios
                ratio = median([w["rate"] / r["rate"] for w, r in zip(sel["wq_sql"], sel["raw"])])
                row.value = ratio
                own = ""
                if sel["raw_same"]:
                    same = median([f["rate"] / r["rate"] for f, r in zip(sel["raw_same"], sel["raw"])])
                    own = f"; its own round by the driver {same:.2f}x"
                row.measured = (f"{ratio:.2f}x ({median([r['rate'] for r in sel['wq_sql']]):,.0f} vs "
                                f"{median([r['rate'] for r in sel['raw']]):,.0f} items/s{own})")
                row.verdict = _verdict(ratio >= goal)
                row.load = max(r["load"] for r in sel["wq_sql"] + sel["raw"] + sel["raw_same"])
            out.append(row)
        return out
    return rows


TAIL_GOAL = 1.03


def _tail_target(backend: str) -> str:
    return f"Long tail, {_label(backend)}: 8 workers, one 4x slow, default settings, makespan / ideal"


def tail_rows(backend: str) -> Callable[[Any], list[Row]]:
    def rows(summary: list[dict[str, Any]]) -> list[Row]:
        row = Row(_tail_target(backend), f"<= {TAIL_GOAL:.2f}x")
        for x in summary:
            if x["scenario"] == "slow":
                r, m = x["ratio_to_ideal"], x["median"]
                row.value = r["wq_sql"]
                # The last item done: the makespan less the workers' close() at the end.
                done = f"last item done {r['wq_sql_last_done']:.3f}x, " if "wq_sql_last_done" in r else ""
                row.measured = (f"{r['wq_sql']:.3f}x ({m['wq_sql']:.3f} s vs {m['ideal']:.3f} s; {done}in-memory "
                                f"{r['memory']:.3f}x, static {r['static']:.2f}x)")
                row.verdict = _verdict(r["wq_sql"] <= TAIL_GOAL)
                row.load = max(x.get("load") or [float("nan")])
        return [row]
    return rows


TF_GOALS = {100: 0.90, 1000: 0.94}
TF_RUNS = 7  # runs per side of each TF row (see the module docstring)
TF_FLOOR = 64  # --floor: the rounds of the floor side (tf_textline.py --floor)


def _tf_target(backend: str, lines: int) -> str:
    return f"TF `TextLineDataset(wq.input_dataset())` / plain, {_label(backend)}, 1,000 x {lines:,}-line files, default settings"


def tf_rows(backend: str, lines: int) -> Callable[[Any], list[Row]]:
    def rows(results: list[dict[str, Any]]) -> list[Row]:
        row = Row(_tf_target(backend, lines), f">= {TF_GOALS[lines]:.2f}x")
        for x in results:
            row.value = x["ratio"]
            # The floor (plain reading beside only the durable statements) says what this machine
            # allows; the time inside the shim's hand-outs is the part of the gap that is wq_sql's.
            floor = (f"; floor {median(x['plain_s']) / median(x['floor_s']):.2f}x" if x.get("floor_s") else "")
            waits = (f"; {median(x['handout_s']) * 1e3:.0f} ms per pass in hand-outs" if x.get("handout_s") else "")
            row.measured = (f"{x['ratio']:.2f}x (plain {median(x['plain_s']):.3f} s, wq_sql "
                            f"{median(x['wq_sql_s']):.3f} s; best runs {x['best_ratio']:.2f}x{floor}{waits})")
            row.verdict = _verdict(x["ratio"] >= TF_GOALS[lines])
            row.load = x["load"]
        return [row]
    return rows


ROLLOVER_GOAL_MS = 100.0
ROLLOVER_TARGET = "SQLite, 8 processes, epoch roll-over of 1,000,000 works: longest `take()`"


def rollover_rows(data: dict[str, Any]) -> list[Row]:
    worst_ms = float(data["worst"][1]) * 1e3
    ref = data["ref"]
    per = ", ".join(f"{v * 1e3:.0f}" for _, v in sorted(data["per_worker"].items(), key=lambda kv: int(kv[0])))
    row = Row(ROLLOVER_TARGET, f"<= {ROLLOVER_GOAL_MS:.0f} ms", value=worst_ms,
              measured=(f"{worst_ms:.0f} ms (median claim {median(ref) * 1e3:.2f} ms; longest per worker "
                        f"around the boundary: {per} ms)"),
              verdict=_verdict(worst_ms <= ROLLOVER_GOAL_MS), load=data.get("load"))
    return [row]


# ---------------------------------------------------------------- the set


def steps(pg: str) -> list[Step]:
    out: list[Step] = []
    for b in ("sqlite", "postgresql"):
        pg_args = ["--pg", pg] if b == "postgresql" else []
        out.append(Step("claims", b, [str(BENCH / "claim_throughput.py"), "--backends", b, "--procs", "1",
                                      "--lease-ahead", "1,32", "--variants", "wq_sql,raw,raw_same", "--repeats", "3",
                                      "--seconds", "2", "--size", "100000", *pg_args, "--json", "{json}"],
                        claim_rows(b), [Row(_claim_target(b, n), f">= {CLAIM_GOALS[(b, n)]:.2f}x") for n in (32, 1)]))
    for b in ("sqlite", "postgresql"):
        pg_args = ["--pg", pg] if b == "postgresql" else []
        out.append(Step("tail", b, [str(BENCH / "long_tail.py"), "--backend", b, "--scenarios", "slow",
                                    "--defaults", "--repeats", "3", *pg_args, "--json", "{json}"],
                        tail_rows(b), [Row(_tail_target(b), f"<= {TAIL_GOAL:.2f}x")]))
    for lines in (100, 1000):
        for b in ("sqlite", "postgresql"):
            url = ["--url", "{url}"] if b == "postgresql" else []
            out.append(Step("tf", b, [str(BENCH / "tf_textline.py"), "--files", "1000", "--lines", str(lines),
                                      "--runs", str(TF_RUNS), "--lease-ahead", "default", "--floor", str(TF_FLOOR),
                                      *url, "--json", "{json}"],
                            tf_rows(b, lines), [Row(_tf_target(b, lines), f">= {TF_GOALS[lines]:.2f}x")],
                            needs_tf=True, scratch_url=b == "postgresql"))
    out.append(Step("rollover", "sqlite", [str(BENCH / "scale.py"), "rollover", "--backend", "sqlite",
                                           "--n", "1000000", "--procs", "8", "--no-create-time",
                                           "--json", "{json}"],
                    rollover_rows, [Row(ROLLOVER_TARGET, f"<= {ROLLOVER_GOAL_MS:.0f} ms")]))
    return out


def shown(step: Step, pg: str) -> str:
    """The command as a person would type it (from the repository's root)."""
    argv = [a.replace(str(BENCH.parent) + "/", "") for a in step.argv]
    i = argv.index("--json")
    argv = argv[:i] + argv[i + 2:]
    if "{url}" in argv:
        argv[argv.index("{url}")] = "<a scratch database on " + pg + ">"
    return ".venv/bin/python " + " ".join(shlex.quote(a) if "<" not in a else a for a in argv)


# ---------------------------------------------------------------- running


def pg_reachable(admin: str) -> Optional[str]:
    """None when the server answers, else why not."""
    try:
        eng = sa.create_engine(resolve_url(admin), connect_args={"connect_timeout": 5})
        try:
            with eng.connect() as c:
                c.exec_driver_sql("SELECT 1")
        finally:
            eng.dispose()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


@contextlib.contextmanager
def _maybe_scratch(step: Step, pg: str) -> Iterator[Optional[str]]:
    if step.scratch_url:
        with scratch_pg(pg, tag="headline") as url:
            yield url
    else:
        yield None


def run_step(step: Step, pg: str, tmp: Path, timeout: float) -> tuple[Optional[Any], str, float]:
    """Run one benchmark; its JSON (or None), a note on failure, its wall time."""
    out = tmp / f"{step.name}_{step.backend}_{len(list(tmp.iterdir()))}.json"
    t0 = time.monotonic()
    with _maybe_scratch(step, pg) as url:
        argv = [PY, *(a.replace("{json}", str(out)).replace("{url}", url or "") for a in step.argv)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", WQ_SQL_BENCH_PG=pg)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # TensorFlow's CUDA probing, not ours
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=BENCH.parent, env=env, start_new_session=True)
        timed_out = threading.Event()

        def signal_group(sig: int) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        def stop() -> None:
            # SIGINT first, so that the benchmark's finally blocks drop its scratch databases;
            # SIGKILL if it has not gone 20 s later
            timed_out.set()
            signal_group(signal.SIGINT)
            hard.start()

        hard = threading.Timer(20.0, signal_group, (signal.SIGKILL,))
        timer = threading.Timer(timeout, stop)
        timer.start()
        tail: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(f"    {line}", end="", flush=True)
                tail = (tail + [line.rstrip()])[-5:]
            rc = proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted: take the benchmark's processes with us
                signal_group(signal.SIGKILL)
                proc.wait()
            hard.cancel()
    seconds = time.monotonic() - t0
    if timed_out.is_set():
        return None, f"stopped after the step's time limit ({timeout:.0f} s)", seconds
    if rc != 0 or not out.exists():
        last = next((x for x in reversed(tail) if x.strip()), "")
        return None, f"failed (exit {rc}): {last[:160]}", seconds
    return json.loads(out.read_text()), "", seconds


def table(rows: list[Row]) -> str:
    lines = ["| target | goal | measured (same-run ratio) | verdict | load (1-min) |", "|---|---|---|---|---|"]
    for r in rows:
        provisional = r.load is not None and r.load > CORES and r.verdict in ("met", "MISSED")
        load = "-" if r.load is None else f"{r.load:.1f}"
        lines.append(f"| {r.target} | {r.goal} | {r.measured} | {r.verdict}{'*' if provisional else ''} | {load} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="claims,tail,tf,rollover",
                    help="comma-separated subset of: claims, tail, tf, rollover")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--pg", default=PG_ADMIN, help="Postgres admin URL (default $WQ_SQL_BENCH_PG or the local server)")
    ap.add_argument("--step-timeout", type=float, default=600.0, help="seconds one benchmark may take (default 600)")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    ap.add_argument("--json", default=None, help="also write the table's rows here")
    ap.add_argument("--no-record", action="store_true",
                    help="do not put the figures into bench/results.json and the pages' tables")
    a = ap.parse_args(argv)
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    backends = {x.strip() for x in a.backends.split(",") if x.strip()}
    bad = only - {"claims", "tail", "tf", "rollover"} or backends - {"sqlite", "postgresql"}
    if bad:
        ap.error(f"unknown {'/'.join(sorted(bad))}: --only takes claims,tail,tf,rollover; "
                 "--backends takes sqlite,postgresql")
    todo = [s for s in steps(a.pg) if s.name in only and s.backend in backends]
    if a.list:
        for s in todo:
            print(shown(s, a.pg))
        return 0

    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.monotonic()
    print(f"# headline benchmarks, {started:%Y-%m-%d %H:%M} UTC, rev {git_rev()}", flush=True)
    print("#", machine(), flush=True)
    pg_down = pg_reachable(a.pg) if "postgresql" in backends else None
    no_tf = importlib.util.find_spec("tensorflow") is None
    rows: list[Row] = []
    timings: list[tuple[str, float, str]] = []
    loads: list[float] = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="wq_bench_headline_") as d:
        for s in todo:
            why = ""
            if s.backend == "postgresql" and pg_down:
                why = f"Postgres unreachable at {a.pg}: {pg_down}"
            elif s.needs_tf and no_tf:
                why = "TensorFlow is not installed (pip install -e '.[tf]', or make test-tf once)"
            if why:
                rows.extend(Row(r.target, r.goal, verdict=f"not measured: {why}", step=s.name) for r in s.blank)
                continue
            print(f"\n## {shown(s, a.pg)}", flush=True)
            data, note, seconds = run_step(s, a.pg, Path(d), a.step_timeout)
            loads.append(os.getloadavg()[0])
            timings.append((shown(s, a.pg), seconds, note))
            if data is None:
                rows.extend(Row(r.target, r.goal, verdict=f"not measured: {note}", step=s.name) for r in s.blank)
                continue
            if s.name == "rollover":
                data["load"] = loads[-1]
            got = s.rows(data)
            for r in got:
                r.step = s.name
            rows.extend(got)
    total = time.monotonic() - t0
    # in the order of BENCHMARKS.md's summary (stable: within a group, the order the steps ran)
    order = {"claims": 0, "tf": 1, "tail": 2, "rollover": 3}
    rows.sort(key=lambda r: order.get(r.step, 9))

    print(f"\n\n## Headline run, {started:%Y-%m-%d %H:%M} UTC, rev {git_rev()}: {total / 60:.1f} min, "
          f"load (1-min) {min(loads):.1f}-{max(loads):.1f} on {CORES} cores\n")
    print(table(rows))
    if any(r.load is not None and r.load > CORES for r in rows):
        print(f"\n`*` provisional: the step ran at a load average above the machine's {CORES} cores "
              "(other work shared the CPUs); rerun on a quiet machine before taking the verdict.")
    print("\nCommands (seconds each):\n")
    for cmd, seconds, note in timings:
        print(f"    {cmd}    # {seconds:.0f} s{'; ' + note if note else ''}")
    if not a.no_record:
        import summary  # bench/summary.py: results.json and the tables made from it

        results = summary.load()
        n = summary.record(results, rows, git_rev() or "?")
        summary.save(results)
        summary.write(results)
        print(f"\n{n} row(s) of bench/results.json updated; BENCHMARKS.md's summary and the README's "
              "performance table rewritten from it")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"started": started.isoformat(), "rev": git_rev(), "seconds": total, "loads": loads,
             "rows": [r.__dict__ for r in rows],
             "steps": [{"command": c, "seconds": s, "note": n} for c, s, n in timings]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
