"""A throwaway PgBouncer in transaction mode, in front of a PostgreSQL server, for tests and benches.

Its own config, auth and log files in a temporary directory, a free port of 127.0.0.1, no unix
socket, ``pool_mode = transaction``; every database of the server is reachable through it
(``[databases] * = host=... port=...``)::

    from pgbouncer import PgBouncer

    with PgBouncer("127.0.0.1", 5432, pool_size=10) as bouncer:
        url = bouncer.url("wq")          # postgresql://postgres@127.0.0.1:<port>/wq
        ...
        bouncer.show("pools")            # SHOW POOLS on the admin console, as dicts

The binary is ``$WQ_SQL_PGBOUNCER``, else ``pgbouncer`` on ``$PATH`` or in ``/usr/sbin``;
``scripts/pgbouncer.sh`` installs it (Debian's ``pgbouncer`` package) and prints its path.
PgBouncer refuses to run as root: as root it runs as the ``postgres`` user (``-u postgres``),
which owns the directory. Authentication is ``trust`` for the user ``postgres`` (the test
servers trust local connections too). :class:`PgBouncerError` says what is missing.

Dependencies: the standard library, and psycopg2 (wq_sql's own) for :meth:`PgBouncer.show`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["PgBouncer", "PgBouncerError", "find_pgbouncer"]


class PgBouncerError(RuntimeError):
    """PgBouncer could not be found, started or stopped; the message says why (with its log)."""


def find_pgbouncer() -> str:
    """The path of the ``pgbouncer`` binary, or :class:`PgBouncerError`."""
    given = os.environ.get("WQ_SQL_PGBOUNCER")
    for candidate in ([given] if given else []) + [shutil.which("pgbouncer") or "", "/usr/sbin/pgbouncer"]:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise PgBouncerError("pgbouncer not found ($WQ_SQL_PGBOUNCER, $PATH, /usr/sbin): install it with "
                         "bash scripts/pgbouncer.sh (Debian's pgbouncer package)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """PgBouncer in front of ``server_host:server_port`` (see the module docstring).

    ``pool_size``: server connections per (database, user) pair (``default_pool_size``);
    ``max_client_conn``: client connections it accepts; ``settings``: more ``[pgbouncer]`` lines
    (e.g. ``{"max_db_connections": 20}``)."""

    def __init__(self, server_host: str, server_port: int, *, pool_size: int = 10,
                 max_client_conn: int = 10_000, settings: Optional[dict[str, Any]] = None,
                 user: str = "postgres", base_dir: Optional[str] = None) -> None:
        self.binary = find_pgbouncer()
        self.server = (server_host, server_port)
        self.pool_size, self.max_client_conn = pool_size, max_client_conn
        self.settings = dict(settings or {})
        self.user = user
        self.port = 0
        self.dir: Optional[Path] = None
        self._base_dir = base_dir
        self._proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def log_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "pgbouncer.log"

    def _log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        except (OSError, AssertionError):
            return ""
        return "\npgbouncer log (last lines):\n  " + "\n  ".join(lines) if lines else ""

    def _write_config(self) -> Path:
        assert self.dir is not None
        host, port = self.server
        conf = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": "transaction", "default_pool_size": self.pool_size,
            "max_client_conn": self.max_client_conn, "admin_users": self.user,
            "logfile": str(self.log_path), "pidfile": str(self.dir / "pgbouncer.pid"),
            # psycopg2 sends none of these; JDBC-style clients do. Not "options": wq_sql must
            # cope with a pooler that refuses it, which is what this fixture is for.
            "ignore_startup_parameters": "extra_float_digits",
            # Server connections of dropped test databases go away soon.
            "server_idle_timeout": 10, "server_lifetime": 300,
            "log_connections": 0, "log_disconnections": 0,
        }
        conf.update(self.settings)
        text = (f"[databases]\n* = host={host} port={port}\n\n[pgbouncer]\n"
                + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        path = self.dir / "pgbouncer.ini"
        path.write_text(text)
        (self.dir / "userlist.txt").write_text(
            "".join(f'"{u}" ""\n' for u in dict.fromkeys(["postgres", self.user])))
        return path

    def start(self, timeout: float = 20.0) -> PgBouncer:
        """Write the files, start PgBouncer on a free port and wait until it accepts connections
        (retrying on another port when the chosen one was taken meanwhile)."""
        if self._proc is not None:
            return self
        self.dir = Path(tempfile.mkdtemp(prefix="wq_sql_pgbouncer.", dir=self._base_dir))
        as_root = os.geteuid() == 0
        for attempt in range(3):
            self.port = _free_port()
            config = self._write_config()
            cmd = [self.binary, str(config)]
            if as_root:
                import pwd

                uid = pwd.getpwnam("postgres").pw_uid
                for p in [self.dir, *self.dir.iterdir()]:
                    os.chown(p, uid, -1)
                cmd = [self.binary, "-u", "postgres", str(config)]
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return self
                except OSError:
                    time.sleep(0.05)
            err = self._proc.stderr.read().decode(errors="replace") if self._proc.poll() is not None \
                and self._proc.stderr else ""
            self._kill()
            if attempt == 2 or "Address already in use" not in (err + self._log_tail(40)):
                raise PgBouncerError(f"pgbouncer did not start on 127.0.0.1:{self.port}: "
                                     f"{err.strip()}{self._log_tail()}")
        raise AssertionError("unreachable")

    def _kill(self) -> None:
        p, self._proc = self._proc, None
        if p is None:
            return
        if p.poll() is None:
            p.terminate()  # SIGTERM: immediate shutdown, client connections dropped
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if p.stderr:
            p.stderr.close()

    def close(self) -> None:
        """Stop PgBouncer and delete its directory. Safe to call twice."""
        self._kill()
        if self.dir is not None and not os.environ.get("WQ_SQL_KEEP_PGBOUNCER"):
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PgBouncer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def url(self, dbname: str = "postgres") -> str:
        """``postgresql://<user>@127.0.0.1:<port>/<dbname>``: a plain URL, as a user would write."""
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (``pools``, ``stats``, ``clients``, ``servers``...)."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, dbname="pgbouncer", user=self.user)
        conn.autocommit = True  # the console takes no BEGIN
        try:
            with conn.cursor() as cur:
                cur.execute(f"SHOW {what}")
                names = [d[0] for d in cur.description or ()]
                return [dict(zip(names, row)) for row in cur.fetchall()]
        finally:
            conn.close()

    def __repr__(self) -> str:
        return f"PgBouncer(port={self.port}, server={self.server}, dir={str(self.dir)!r})"


if __name__ == "__main__":  # smoke check: python tests/support/pgbouncer.py
    import psycopg2

    with PgBouncer("127.0.0.1", 5432) as b:
        c = psycopg2.connect(b.url())
        with c.cursor() as cur:
            cur.execute("SELECT version()")
            print(b, cur.fetchone())
        c.close()
        print(b.show("pools"))
