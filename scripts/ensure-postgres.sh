#!/usr/bin/env bash
# Print the URL of a reachable PostgreSQL for the tests, starting one if needed.
#   1. $WQ_SQL_TEST_PG if it answers;
#   2. the machine's cluster on 127.0.0.1:5432 (started with pg_ctlcluster if it is down);
#   3. a throwaway cluster (initdb + pg_ctl) in a temp dir on port 5439.
# Exits non-zero, saying why, when none can be had.
set -u
say() { echo "ensure-postgres: $*" >&2; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
ready() { pg_isready -q -h "$1" -p "$2" -t 3 >/dev/null 2>&1; }

if [ -n "${WQ_SQL_TEST_PG:-}" ]; then echo "$WQ_SQL_TEST_PG"; exit 0; fi
if ready 127.0.0.1 5432; then echo "postgresql://postgres@127.0.0.1:5432/postgres"; exit 0; fi

if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  say "127.0.0.1:5432 is down; starting cluster $ver/main"
  pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2 2>&1 \
    || as_pg pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2 2>&1 || true
  for _ in $(seq 1 30); do ready 127.0.0.1 5432 && break; sleep 1; done
  if ready 127.0.0.1 5432; then echo "postgresql://postgres@127.0.0.1:5432/postgres"; exit 0; fi
fi

bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$bindir/initdb" ] || bindir=$(dirname "$(command -v initdb 2>/dev/null || echo /nonexistent/initdb)")
if [ -x "$bindir/initdb" ]; then
  dir=$(mktemp -d /tmp/wq_sql_pg.XXXXXX)
  [ "$(id -u)" = 0 ] && chown postgres "$dir"
  say "starting a throwaway cluster in $dir on port 5439"
  as_pg "$bindir/initdb" -D "$dir/data" -A trust -U postgres >/dev/null \
    && as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/log" -w \
         -o "-p 5439 -k $dir -c listen_addresses=127.0.0.1 -c max_connections=300" start >&2
  if ready 127.0.0.1 5439; then echo "postgresql://postgres@127.0.0.1:5439/postgres"; exit 0; fi
fi
say "no PostgreSQL could be reached or started (install postgresql, or set WQ_SQL_TEST_PG)"
exit 1
