#!/usr/bin/env bash
# Print the path of a pgbouncer binary for the tests, installing Debian's package when missing.
#   1. $WQ_SQL_PGBOUNCER if it is executable;
#   2. pgbouncer on $PATH or in /usr/sbin;
#   3. apt-get install pgbouncer (as root, or with sudo -n), after apt-get update if needed.
# The package's own service is left alone: the tests start their own PgBouncer (tests/pgbouncer.py).
# Exits non-zero, saying why, when none can be had (the tests then skip, or fail under $CI).
set -u
say() { echo "pgbouncer.sh: $*" >&2; }
found() {
  if [ -n "${WQ_SQL_PGBOUNCER:-}" ] && [ -x "$WQ_SQL_PGBOUNCER" ]; then echo "$WQ_SQL_PGBOUNCER"; return 0; fi
  for p in "$(command -v pgbouncer 2>/dev/null)" /usr/sbin/pgbouncer; do
    if [ -n "$p" ] && [ -x "$p" ]; then echo "$p"; return 0; fi
  done
  return 1
}

found && exit 0
if [ "$(id -u)" = 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n); else
  say "pgbouncer is not installed and this user cannot install packages (apt-get install pgbouncer)"; exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then say "pgbouncer is not installed and there is no apt-get"; exit 1; fi
say "installing pgbouncer with apt-get"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get install -y -q pgbouncer >&2 \
  || { "${as_root[@]}" apt-get update -q >&2 && "${as_root[@]}" apt-get install -y -q pgbouncer >&2; }
found && exit 0
say "apt-get could not install pgbouncer"
exit 1
