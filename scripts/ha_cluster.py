#!/usr/bin/env python3
"""A real PostgreSQL HA pair on this one machine: etcd, and Patroni managing a primary and a
synchronous streaming standby of PostgreSQL 15, all on free ports of 127.0.0.1, all data in one
temporary directory. wq_sql's failover drill (``bench/failover.py``, ``make failover``) runs on
it; ``docs/operations/failover.md`` explains the settings it uses and why they matter in production.

    python3 scripts/ha_cluster.py check          # start, show, tear down (about 20 s)
    python3 scripts/ha_cluster.py up             # start and leave running; prints the URL and the dir
    python3 scripts/ha_cluster.py status --dir D # members, roles, replication
    python3 scripts/ha_cluster.py down --dir D   # stop everything, delete D

The URL in front is a libpq multi-host URL that connects to whichever node is the primary::

    postgresql://postgres@127.0.0.1:P0,127.0.0.1:P1/postgres?target_session_attrs=read-write&connect_timeout=2

Missing packages (``patroni``, ``etcd-server``, ``postgresql-15``) are installed with apt-get
when running as root (``apt-get update`` once first); otherwise the error names the command.
Patroni and PostgreSQL run as the ``postgres`` user (PostgreSQL refuses root). Every wait is
bounded, and :meth:`HACluster.close` ends every process it started (Patroni, etcd, and each
postmaster's process group, orphaned backends included), then checks that none is left.

Only the standard library: the system's ``python3`` runs it, and so does wq_sql's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

__all__ = ["HACluster", "HAClusterError", "ensure_packages"]

PG_BINDIR = Path(os.environ.get("WQ_SQL_PG_BINDIR", "/usr/lib/postgresql/15/bin"))
PACKAGES = {"patroni": "patroni", "etcd": "etcd-server"}  # executable -> Debian package
SCOPE = "wq_sql_ha"

# Patroni's timing, chosen for a drill on one machine (production defaults: ttl 30, loop_wait 10,
# retry_timeout 10; see docs/operations/failover.md). ttl: how long the leader key lives without renewal (a
# whole node lost is noticed after this); loop_wait: the pause between two HA cycles (a crashed
# postmaster is noticed within this); retry_timeout: how long etcd and PostgreSQL operations
# are retried before Patroni demotes a primary it cannot confirm.
TIMING = {"ttl": 20, "loop_wait": 2, "retry_timeout": 5}

# fsync off: the drill crashes processes, never the machine, so the kernel keeps every write;
# synchronous_commit stays on, so a commit is acknowledged only once the standby has it.
PG_PARAMETERS: dict[str, Any] = {
    "max_connections": 100, "fsync": "off", "wal_level": "replica", "hot_standby": "on",
    "wal_log_hints": "on", "max_wal_senders": 10, "max_replication_slots": 10,
    "synchronous_commit": "on", "wal_keep_size": "256MB",
}


class HAClusterError(RuntimeError):
    """The pair could not be installed, started, or brought to the state asked for; the message
    says why, with the tail of the relevant log."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return f"\n{path} (last lines):\n  " + "\n  ".join(lines) if lines else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _procs_under(root: Path) -> list[int]:
    """Live processes whose working directory is ``root`` or below it. Every process of the
    cluster has one there: Patroni and etcd are started in their directories, and PostgreSQL's
    postmaster moves into its data directory, which its children (and orphans, once it died)
    inherit. PostgreSQL's children call setsid(), so process groups would miss them."""
    top = str(root.resolve())
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(d / "cwd").removesuffix(" (deleted)")
            state = (d / "stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (cwd == top or cwd.startswith(top + "/")):
            out.append(int(d.name))
    return out


def _kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait(what: str, ok: Any, timeout: float, interval: float = 0.1, log: Optional[Path] = None) -> Any:
    """Call ``ok()`` until it returns something truthy that is not a string (a string says why
    not yet), for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = ok()
        except Exception as e:  # noqa: BLE001 - the condition's own failure is "not yet"
            last = f"{type(e).__name__}: {e}"
        if last and not isinstance(last, str):
            return last
        if time.monotonic() >= deadline:
            raise HAClusterError(f"{what}: not within {timeout:.0f}s (last: {last!r})"
                                 + (_tail(log) if log else ""))
        time.sleep(interval)


def ensure_packages(*, quiet: bool = False) -> list[str]:
    """Install what is missing of Patroni, etcd and the PostgreSQL 15 server with apt-get (as
    root; ``apt-get update`` once first). Returns the packages installed (empty: nothing to do)."""
    missing = [pkg for exe, pkg in PACKAGES.items() if shutil.which(exe) is None]
    if not (PG_BINDIR / "postgres").exists():
        missing.append("postgresql-15")
    if not missing:
        return []
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if os.geteuid() != 0:
        raise HAClusterError(f"missing {', '.join(missing)}: run  sudo apt-get update && sudo "
                             f"{' '.join(cmd)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (["apt-get", "update", "-q"], cmd):
        if not quiet:
            print("+", " ".join(step), flush=True)
        p = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise HAClusterError(f"{' '.join(step)} failed (exit {p.returncode}):\n{p.stdout[-2000:]}"
                                 f"\n{p.stderr[-2000:]}")
    still = [exe for exe in PACKAGES if shutil.which(exe) is None]
    if still or not (PG_BINDIR / "postgres").exists():
        raise HAClusterError(f"apt-get installed {missing}, but {still or [str(PG_BINDIR / 'postgres')]} "
                             "is still missing")
    return missing


def _yaml(value: Any, indent: int = 0) -> str:
    """A small YAML writer for the config (JSON scalars are valid YAML)."""
    pad = "  " * indent
    if isinstance(value, dict):
        lines = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")
        return "\n".join(lines)
    if isinstance(value, list):
        return "\n".join(f"{pad}- {json.dumps(v)}" for v in value)
    return pad + json.dumps(value)


class HACluster:
    """etcd plus ``nodes`` Patroni-managed PostgreSQL nodes named ``pg0``, ``pg1``, ... ::

        with HACluster() as ha:              # installs what is missing, starts, waits
            url = ha.url("postgres")         # the multi-host URL
            ha.kill_postmaster(ha.leader())  # SIGKILL: Patroni fails over to the standby
            ha.wait_healthy(60)

    ``timing`` overrides :data:`TIMING`; ``parameters`` adds to :data:`PG_PARAMETERS`."""

    def __init__(self, nodes: int = 2, *, base_dir: Optional[str] = None,
                 timing: Optional[dict[str, int]] = None, parameters: Optional[dict[str, Any]] = None,
                 synchronous: bool = True, install: bool = True) -> None:
        if nodes < 2:
            raise ValueError("an HA pair needs at least 2 nodes")
        self.names = [f"pg{i}" for i in range(nodes)]
        self.timing = {**TIMING, **(timing or {})}
        self.parameters = {**PG_PARAMETERS, **(parameters or {})}
        self.synchronous = synchronous
        self.install = install
        self._base_dir = base_dir
        self.dir: Optional[Path] = None
        self.pg_port: dict[str, int] = {}
        self.api_port: dict[str, int] = {}
        self.etcd_ports: tuple[int, int] = (0, 0)
        self.etcd_pid = 0
        self.patroni_pid: dict[str, int] = {}
        self._procs: list[subprocess.Popen[bytes]] = []

    # ------------------------------------------------------------------ paths, URLs

    def _d(self) -> Path:
        if self.dir is None:
            raise HAClusterError("the cluster has no directory (not started, or closed)")
        return self.dir

    def node_dir(self, name: str) -> Path:
        return self._d() / name

    def data_dir(self, name: str) -> Path:
        return self.node_dir(name) / "data"

    def config_path(self, name: str) -> Path:
        return self.node_dir(name) / "patroni.yml"

    def log_path(self, name: str) -> Path:
        """Patroni's log and, after it, PostgreSQL's (both write to the node's stderr)."""
        return self.node_dir(name) / "patroni.log"

    def url(self, dbname: str = "postgres", *, connect_timeout: int = 2) -> str:
        """The libpq multi-host URL of every node, ``target_session_attrs=read-write``: libpq
        tries the hosts in order and keeps the first that accepts writes (the primary)."""
        hosts = ",".join(f"127.0.0.1:{self.pg_port[n]}" for n in self.names)
        return (f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"
                f"&connect_timeout={connect_timeout}")

    def node_url(self, name: str, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port[name]}/{dbname}"

    # ------------------------------------------------------------------ start

    def start(self, timeout: float = 120.0) -> HACluster:
        """Install what is missing, write the configs, start etcd and every Patroni node, and
        wait until one node leads and every other streams from it (one synchronously)."""
        if self.install:
            ensure_packages()
        for exe in PACKAGES:
            if shutil.which(exe) is None:
                raise HAClusterError(f"{exe} not found: apt-get install {PACKAGES[exe]}")
        import pwd

        try:
            pg_user = pwd.getpwnam("postgres")
        except KeyError:
            raise HAClusterError("there is no 'postgres' user to run Patroni and PostgreSQL as "
                                 "(the postgresql-15 package creates it)") from None
        self._uid, self._gid = pg_user.pw_uid, pg_user.pw_gid
        self.dir = Path(tempfile.mkdtemp(prefix="wq_sql_ha.", dir=self._base_dir))
        try:
            os.chmod(self.dir, 0o755)
            (self.dir / "owner").write_text(f"{os.getpid()} {' '.join(sys.argv)}\n")
            self.etcd_ports = (_free_port(), _free_port())
            for n in self.names:
                self.pg_port[n], self.api_port[n] = _free_port(), _free_port()
                self.node_dir(n).mkdir()
                if os.geteuid() == 0:
                    os.chown(self.node_dir(n), self._uid, self._gid)
                self.config_path(n).write_text(_yaml(self._config(n)) + "\n")
            self._start_etcd()
            for n in self.names:
                self.start_node(n)
            self._save_state()
            self.wait_healthy(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _config(self, name: str) -> dict[str, Any]:
        nd = self.node_dir(name)
        hba = ["local all all trust", "host all all 127.0.0.1/32 trust",
               "host replication all 127.0.0.1/32 trust"]
        return {
            "scope": SCOPE, "namespace": "/wq_sql/", "name": name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{self.api_port[name]}",
                        "connect_address": f"127.0.0.1:{self.api_port[name]}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_ports[0]}"]},
            "bootstrap": {
                "dcs": {
                    **self.timing,
                    "maximum_lag_on_failover": 1048576,
                    # A crashed primary fails over at once instead of being restarted in place
                    # (Patroni's default waits 300 s for it to come back).
                    "primary_start_timeout": 0,
                    "synchronous_mode": self.synchronous,
                    # Not strict: with the standby gone, the primary goes on alone (async).
                    "synchronous_mode_strict": False,
                    "postgresql": {"use_pg_rewind": True, "use_slots": True,
                                   "parameters": self.parameters},
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port[name]}",
                "connect_address": f"127.0.0.1:{self.pg_port[name]}",
                "data_dir": str(self.data_dir(name)),
                "bin_dir": str(PG_BINDIR),
                "pgpass": str(nd / "pgpass"),
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"},
                                   "rewind": {"username": "postgres"}},
                "parameters": {"unix_socket_directories": str(nd)},
                "pg_hba": hba,
                # A node whose data cannot be rewound onto the new timeline is copied afresh.
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
            "watchdog": {"mode": "off"},  # no /dev/watchdog here; see docs/operations/failover.md
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def _spawn(self, cmd: list[str], log: Path, *, as_postgres: bool, cwd: Path) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PATRONI", "ETCD", "PG"))}
        env["HOME"] = str(self._d())
        kw: dict[str, Any] = {}
        if as_postgres and os.geteuid() == 0:
            kw = {"user": self._uid, "group": self._gid, "extra_groups": []}
        with open(log, "ab") as out:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 cwd=cwd, env=env, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def _start_etcd(self) -> None:
        client, peer = self.etcd_ports
        data = self._d() / "etcd"
        data.mkdir()
        log = self._d() / "etcd.log"
        p = self._spawn(["etcd", "--name", "etcd0", "--data-dir", str(data),
                         "--listen-client-urls", f"http://127.0.0.1:{client}",
                         "--advertise-client-urls", f"http://127.0.0.1:{client}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-cluster", f"etcd0=http://127.0.0.1:{peer}",
                         "--initial-cluster-state", "new", "--log-level", "warn"],
                        log, as_postgres=False, cwd=data)
        self.etcd_pid = p.pid

        def healthy() -> bool:
            if p.poll() is not None:
                raise HAClusterError(f"etcd exited ({p.returncode}){_tail(log)}")
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=2) as r:
                return bool(json.load(r).get("health") == "true")
        _wait("etcd healthy", healthy, 30, log=log)

    def start_node(self, name: str) -> None:
        """Start (or restart, after :meth:`kill_node`) the Patroni of ``name``; it starts its
        PostgreSQL (bootstraps, clones from the leader, or rewinds onto its timeline)."""
        if self.patroni_pid.get(name) and _alive(self.patroni_pid[name]):
            raise HAClusterError(f"Patroni of {name} is already running (pid {self.patroni_pid[name]})")
        p = self._spawn(["patroni", str(self.config_path(name))], self.log_path(name), as_postgres=True,
                        cwd=self.node_dir(name))
        self.patroni_pid[name] = p.pid
        self._save_state()

    # ------------------------------------------------------------------ state

    def api(self, name: str, path: str = "patroni", timeout: float = 2.0) -> Any:
        """GET ``path`` from the node's Patroni REST API (JSON); raises if it does not answer."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.api_port[name]}/{path}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:  # /primary answers 503 on a replica, with a body
            return json.load(e)

    def members(self) -> list[dict[str, Any]]:
        """The cluster's members as any live node's Patroni reports them (``GET /cluster``)."""
        last: Optional[Exception] = None
        for n in self.names:
            if not _alive(self.patroni_pid.get(n, 0)):
                continue
            try:
                return list(self.api(n, "cluster")["members"])
            except (OSError, ValueError, KeyError) as e:
                last = e
        raise HAClusterError(f"no Patroni REST API answers ({last})")

    def leader(self) -> Optional[str]:
        """The node holding the leader key and running as primary, if any."""
        for m in self.members():
            if m.get("role") == "leader" and m.get("state") == "running":
                return str(m["name"])
        return None

    def psql(self, name: str, sql: str, dbname: str = "postgres", timeout: float = 10.0) -> list[list[str]]:
        """Rows of ``sql`` on node ``name`` (``psql -At``, fields split on ``|``)."""
        p = subprocess.run([str(PG_BINDIR / "psql"), "-X", "-At", "-h", "127.0.0.1",
                            "-p", str(self.pg_port[name]), "-U", "postgres", "-d", dbname,
                            "-v", "ON_ERROR_STOP=1", "-c", sql],
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env={**os.environ, "PGCONNECT_TIMEOUT": "3"})
        if p.returncode != 0:
            raise HAClusterError(f"psql on {name}: {p.stderr.strip()}")
        return [line.split("|") for line in p.stdout.splitlines() if line]

    def replication(self, name: str) -> list[list[str]]:
        """``application_name, state, sync_state`` of each standby streaming from ``name``."""
        return self.psql(name, "SELECT application_name, state, sync_state FROM pg_stat_replication "
                               "ORDER BY application_name")

    def wait_healthy(self, timeout: float = 60.0, *, nodes: Optional[list[str]] = None) -> str:
        """Until a leader runs and every other node of ``nodes`` (default: all) streams from it,
        one of them synchronously when synchronous mode is on. Returns the leader."""
        want = nodes or self.names

        def ok() -> Any:
            leader = self.leader()
            if leader is None:
                return "no leader yet"
            rows = {r[0]: r for r in self.replication(leader)}
            others = [n for n in want if n != leader]
            waiting = [n for n in others if rows.get(n, [n, ""])[1] != "streaming"]
            if waiting:
                return f"leader {leader}; not streaming yet: {waiting}"
            if self.synchronous and others:
                # Patroni fails over only to the standby named in its /sync key (role
                # sync_standby), which it writes a cycle after the standby went sync.
                roles = {m["name"]: m.get("role") for m in self.members()}
                if not any(rows[n][2] == "sync" and roles.get(n) == "sync_standby" for n in others):
                    return f"leader {leader}; no synchronous standby yet: {rows} {roles}"
            return [leader]
        return str(_wait("a leader with streaming standbys", ok, timeout, interval=0.2,
                         log=self.log_path(want[-1]) if self.dir else None)[0])

    def postmaster_pid(self, name: str) -> int:
        """The node's postmaster (first line of ``postmaster.pid``)."""
        return int((self.data_dir(name) / "postmaster.pid").read_text().split("\n", 1)[0])

    # ------------------------------------------------------------------ faults

    def kill_postmaster(self, name: str) -> int:
        """SIGKILL the node's postmaster (a crash of PostgreSQL; Patroni lives on and, with
        ``primary_start_timeout: 0``, fails over instead of restarting it). Returns its pid."""
        pid = self.postmaster_pid(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill_node(self, name: str) -> None:
        """SIGKILL the node's Patroni and every PostgreSQL process of it (a machine lost)."""
        _kill_all([self.patroni_pid.get(name, 0)] if self.patroni_pid.get(name) else [])
        _kill_all(_procs_under(self.node_dir(name)))
        self._reap()
        _wait(f"{name}'s processes gone", lambda: not _procs_under(self.node_dir(name)) or "", 10)

    def patronictl(self, *args: str, timeout: float = 60.0) -> str:
        p = subprocess.run(["patronictl", "-c", str(self.config_path(self.names[0])), *args],
                           capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env={**os.environ, "HOME": str(self._d())})
        if p.returncode != 0:
            raise HAClusterError(f"patronictl {' '.join(args)} failed ({p.returncode}): "
                                 f"{p.stdout.strip()} {p.stderr.strip()}")
        return p.stdout

    def switchover(self, candidate: Optional[str] = None) -> str:
        """A planned switchover (``patronictl switchover --force``) from the current leader to
        ``candidate`` (default: the first other node). Returns the new leader's name."""
        leader = self.leader()
        if leader is None:
            raise HAClusterError("no leader to switch over from")
        candidate = candidate or next(n for n in self.names if n != leader)
        self.patronictl("switchover", SCOPE, "--leader", leader, "--candidate", candidate, "--force")
        return candidate

    # ------------------------------------------------------------------ teardown

    def _reap(self) -> None:
        for p in self._procs:
            p.poll()

    def _save_state(self) -> None:
        if self.dir is None:
            return
        state = {"names": self.names, "pg_port": self.pg_port, "api_port": self.api_port,
                 "etcd_ports": self.etcd_ports, "etcd_pid": self.etcd_pid, "patroni_pid": self.patroni_pid,
                 "synchronous": self.synchronous}
        (self.dir / "state.json").write_text(json.dumps(state))

    @classmethod
    def load(cls, directory: str) -> HACluster:
        """The cluster that ``up`` left running in ``directory``."""
        d = Path(directory)
        try:
            s = json.loads((d / "state.json").read_text())
        except OSError as e:
            raise HAClusterError(f"{d} holds no cluster started by this script ({e})") from None
        ha = cls(len(s["names"]), synchronous=s["synchronous"], install=False)
        ha.dir = d
        ha.pg_port, ha.api_port = s["pg_port"], s["api_port"]
        ha.etcd_ports, ha.etcd_pid = tuple(s["etcd_ports"]), s["etcd_pid"]
        ha.patroni_pid = s["patroni_pid"]
        return ha

    def close(self, timeout: float = 30.0) -> list[int]:
        """Stop everything and delete the directory: each Patroni gets SIGTERM (it shuts its
        PostgreSQL down), then every process still working in the directory (Patroni, any
        postmaster and its children, orphans included, etcd) gets SIGKILL. Returns the pids
        still alive after that (none, or something is badly wrong). Safe to call twice."""
        if self.dir is None:
            return []
        _kill_all([p for p in self.patroni_pid.values() if _alive(p)], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in self.patroni_pid.values()):
            self._reap()
            time.sleep(0.1)
        left: list[int] = []
        deadline = time.monotonic() + 10
        while True:
            left = _procs_under(self.dir)
            _kill_all(left)
            self._reap()
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        left = _procs_under(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None
        return left

    def __enter__(self) -> HACluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        left = self.close()
        if left:
            raise HAClusterError(f"processes left after teardown: {left}")

    def describe(self) -> str:
        lines = [f"dir {self._d()}", f"URL {self.url()}"]
        for m in self.members():
            lines.append(f"  {m['name']}: {m.get('role')} {m.get('state')} 127.0.0.1:{m.get('port')} "
                         f"timeline {m.get('timeline')} lag {m.get('lag', '-')}")
        leader = self.leader()
        if leader:
            lines.append(f"  replication from {leader}: {self.replication(leader)}")
        return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["check", "up", "status", "down", "install"])
    ap.add_argument("--dir", help="the cluster's directory (status, down; up: where to make it)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--async", dest="asynchronous", action="store_true",
                    help="asynchronous replication (default: synchronous_mode on)")
    a = ap.parse_args(argv)
    try:
        if a.command == "install":
            print("installed:", ensure_packages() or "nothing (all present)")
        elif a.command == "check":
            t0 = time.monotonic()
            ha = HACluster(a.nodes, base_dir=a.dir, synchronous=not a.asynchronous)
            with ha:
                print(f"up in {time.monotonic() - t0:.1f}s")
                print(ha.describe())
                t1 = time.monotonic()
            print(f"torn down in {time.monotonic() - t1:.1f}s, no process left")
        elif a.command == "up":
            ha = HACluster(a.nodes, base_dir=a.dir, synchronous=not a.asynchronous)
            ha.start()
            print(ha.describe())
            print(f"stop it with: python3 {sys.argv[0]} down --dir {ha.dir}")
        else:
            if not a.dir:
                ap.error(f"{a.command} needs --dir (printed by up)")
            ha = HACluster.load(a.dir)
            if a.command == "status":
                print(ha.describe())
            else:
                left = ha.close()
                if left:
                    print(f"processes still alive: {left}", file=sys.stderr)
                    return 1
                print("stopped; no process left")
    except HAClusterError as e:
        print(f"ha_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
