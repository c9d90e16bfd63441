"""A throwaway PostgreSQL cluster that a test or a benchmark starts, restarts, crashes and removes.

``initdb`` in a fresh temporary directory, ``pg_ctl`` on a free TCP port of 127.0.0.1, trust
authentication for the superuser ``postgres``, the unix socket in the same directory: nothing is
shared with the machine's own server, so a test may restart or crash it at will. The directory's
``owner`` file names the process that started it (pid and command line)::

    from pgcluster import PgCluster

    with PgCluster({"fsync": "off", "max_connections": 300}) as pg:
        url = pg.create_database("wq")         # postgresql://postgres@127.0.0.1:<port>/wq
        ...
        pg.restart(mode="immediate")           # a crash: the next start runs crash recovery

``initdb``, ``pg_ctl`` and ``postgres`` refuse to run as root: as root they run as the
``postgres`` user (``runuser -u postgres --``), which owns the temporary directory. Binaries are
looked up in ``bindir=``, ``$WQ_SQL_PG_BINDIR``, ``/usr/lib/postgresql/15/bin``, the newest
``/usr/lib/postgresql/*/bin``, then ``$PATH``; :class:`PgClusterError` says what is missing.

Dependencies: the standard library, plus SQLAlchemy and psycopg2 (wq_sql's own) for
:meth:`PgCluster.sql` and :meth:`PgCluster.create_database`. Benchmark scripts import this file
with ``sys.path.insert(0, "tests")``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["PgCluster", "PgClusterError", "find_bindir"]

Setting = Union[str, int, float, bool]
DEFAULT_VERSION = "15"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_TOOLS = ("initdb", "pg_ctl", "postgres")


class PgClusterError(RuntimeError):
    """The cluster could not be made, started or stopped; the message says why (with the log)."""


def find_bindir(bindir: Optional[str] = None) -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``, or :class:`PgClusterError`."""
    candidates: list[Path] = []
    if bindir:
        candidates.append(Path(bindir))
    elif os.environ.get("WQ_SQL_PG_BINDIR"):
        candidates.append(Path(os.environ["WQ_SQL_PG_BINDIR"]))
    else:
        candidates.append(Path(f"/usr/lib/postgresql/{DEFAULT_VERSION}/bin"))
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                          key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parent.name.split(".")])
        candidates += reversed(versions)
        on_path = shutil.which("pg_ctl")
        if on_path:
            candidates.append(Path(on_path).resolve().parent)
    for d in candidates:
        if all(os.access(d / t, os.X_OK) for t in _TOOLS):
            return d
    raise PgClusterError(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found in "
        f"{', '.join(str(c) for c in candidates) or '$PATH'}: install the server package "
        f"(e.g. postgresql-{DEFAULT_VERSION}) or set $WQ_SQL_PG_BINDIR")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf_value(v: Setting) -> str:
    if isinstance(v, bool):
        v = "on" if v else "off"
    return "'" + str(v).replace("\\", "\\\\").replace("'", "''") + "'"


class PgCluster:
    """A PostgreSQL cluster in a temporary directory, on a free port of 127.0.0.1.

    ``settings`` go into ``postgresql.conf`` (e.g. ``{"autovacuum": "on", "max_connections":
    300, "fsync": "off"}``); ``port``, ``listen_addresses`` and ``unix_socket_directories`` are
    ours. Nothing runs until :meth:`start`; :meth:`close` stops the server and deletes the
    directory (also on leaving a ``with`` block, which starts it on entry)."""

    def __init__(self, settings: Optional[dict[str, Setting]] = None, *, bindir: Optional[str] = None,
                 port: Optional[int] = None, base_dir: Optional[str] = None) -> None:
        self.settings = dict(settings or {})
        for key in self.settings:
            if not re.match(r"^[a-z_][a-z0-9_.]*$", key):
                raise ValueError(f"not a PostgreSQL setting name: {key!r}")
        self.bindir = find_bindir(bindir)
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            try:
                import pwd

                self._pg_uid = pwd.getpwnam("postgres").pw_uid
            except KeyError:
                raise PgClusterError("running as root, but there is no 'postgres' user to run "
                                     "initdb and pg_ctl as (they refuse to run as root)") from None
        self._port_fixed = port
        self.port = port or _free_port()
        self._base_dir = base_dir
        self.dir: Optional[Path] = None
        self._initialized = False
        self._running = False

    # ------------------------------------------------------------------ paths and commands

    @property
    def data_dir(self) -> Path:
        return self._dir() / "data"

    @property
    def log_path(self) -> Path:
        """The server log (``pg_ctl -l``); its tail is in every error this class raises."""
        return self._dir() / "server.log"

    def _dir(self) -> Path:
        if self.dir is None:
            raise PgClusterError("the cluster has no directory (not started, or closed)")
        return self.dir

    def _run(self, tool: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        try:
            # cwd: runuser keeps it, and postgres must be able to enter it.
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  cwd=self._dir(), stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise PgClusterError(f"{tool} {' '.join(args)} did not finish within {timeout}s"
                                 f"{self._log_tail()}") from e

    def _check(self, p: subprocess.CompletedProcess[str], what: str) -> None:
        if p.returncode != 0:
            out = p.stderr.strip() or p.stdout.strip()
            raise PgClusterError(f"{what} failed (exit {p.returncode}): {out}{self._log_tail()}")

    def _log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except (OSError, PgClusterError):
            return ""
        return "\nserver log (last lines):\n  " + "\n  ".join(lines) if lines else ""

    # ------------------------------------------------------------------ lifecycle

    def _init(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="wq_sql_pgcluster.", dir=self._base_dir))
        if self._as_postgres:
            os.chown(self.dir, self._pg_uid, -1)
        # Who started it: a cluster left behind by a killed process can be told from a live one's.
        (self.dir / "owner").write_text(f"{os.getpid()} {' '.join(sys.argv)}\n")
        p = self._run("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                      "--locale=C", "--no-sync")
        self._check(p, "initdb")
        lines = [f"{k} = {_conf_value(v)}" for k, v in self.settings.items()]
        lines += [f"port = {self.port}", "listen_addresses = '127.0.0.1'",
                  f"unix_socket_directories = {_conf_value(str(self.dir))}"]
        # Appended lines override initdb's defaults (the last occurrence wins).
        with open(self.data_dir / "postgresql.conf", "a", encoding="utf-8") as f:
            f.write("\n# PgCluster\n" + "\n".join(lines) + "\n")
        self._initialized = True

    def start(self, timeout: float = 60.0) -> PgCluster:
        """``initdb`` (first call only), then ``pg_ctl start``, waiting until it accepts
        connections (after a crash that includes recovery). Retries on a new port when the
        chosen one was taken meanwhile (unless ``port=`` was given)."""
        if self._running:
            return self
        if not self._initialized:
            self._init()
        for attempt in range(3):
            p = self._run("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_path), "-w",
                          "-t", str(int(timeout)), timeout=timeout + 10)
            if p.returncode == 0:
                self._running = True
                return self
            if self._port_fixed or attempt == 2 or "Address already in use" not in self._log_tail(40):
                self._check(p, "pg_ctl start")
            self.port = _free_port()
            with open(self.data_dir / "postgresql.conf", "a", encoding="utf-8") as f:
                f.write(f"port = {self.port}\n")
        raise AssertionError("unreachable")

    def stop(self, mode: str = "fast", timeout: float = 60.0) -> None:
        """``pg_ctl stop -m mode``: ``smart`` waits for clients to leave, ``fast`` rolls back
        open transactions and ends every session, ``immediate`` kills the server processes
        without a checkpoint (a crash; the next start runs recovery)."""
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"mode must be smart, fast or immediate, got {mode!r}")
        if not self._running:
            return
        p = self._run("pg_ctl", "stop", "-D", str(self.data_dir), "-m", mode, "-w", "-t", str(int(timeout)),
                      timeout=timeout + 10)
        self._check(p, f"pg_ctl stop -m {mode}")
        self._running = False

    def restart(self, mode: str = "fast", timeout: float = 60.0) -> float:
        """Stop with ``mode`` (see :meth:`stop`), start again, and return the seconds it took
        until the server accepted connections."""
        t0 = time.monotonic()
        self.stop(mode, timeout)
        self.start(timeout)
        return time.monotonic() - t0

    @property
    def running(self) -> bool:
        return self._running

    def postmaster_pid(self) -> int:
        """The server's main process id (first line of ``postmaster.pid``)."""
        return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])

    def close(self) -> None:
        """Stop the server (``immediate``: its data is thrown away) and delete the directory.
        Safe to call twice."""
        try:
            if self._running:
                self.stop("immediate")
        finally:
            self._running = False
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None
                self._initialized = False

    def __enter__(self) -> PgCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PgCluster(port={self.port}, dir={str(self.dir)!r}, running={self._running})"

    # ------------------------------------------------------------------ databases

    def url(self, dbname: str = "postgres") -> str:
        """``postgresql://postgres@127.0.0.1:<port>/<dbname>`` (no password: trust auth). wq_sql
        and psycopg2 take it as is; plain SQLAlchemy needs ``postgresql+psycopg2://``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def sql(self, statement: str, dbname: str = "postgres", **params: Any) -> list[Any]:
        """Run one statement in autocommit mode on a short-lived connection; its rows (``[]`` when
        it returns none). ``params`` are bound (``:name``)."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.url(dbname).replace("postgresql://", "postgresql+psycopg2://", 1),
                                  isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool,
                                  connect_args={"connect_timeout": 10})
        try:
            with engine.connect() as c:
                result = c.execute(sa.text(statement), params)
                return list(result.all()) if result.returns_rows else []
        finally:
            engine.dispose()

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name`` (a plain identifier) and return its :meth:`url`."""
        if not _IDENT.match(name):
            raise ValueError(f"database name must be a plain identifier, got {name!r}")
        self.sql(f'CREATE DATABASE "{name}"')
        return self.url(name)


if __name__ == "__main__":  # smoke check: python tests/support/pgcluster.py
    with PgCluster({"fsync": "off"}) as pg:
        print(pg, pg.sql("SELECT version()")[0][0])
        print(f"restart fast: {pg.restart('fast'):.2f}s")
        print(f"restart immediate: {pg.restart('immediate'):.2f}s")
        print(pg.create_database("smoke"), pg.sql("SELECT 1", "smoke"))
