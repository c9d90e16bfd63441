#!/usr/bin/env bash
# Print the path of a Chromium for the dashboard's browser test, installing Debian's package when missing.
#   1. $WQ_SQL_CHROMIUM if it is executable;
#   2. chromium on $PATH or in /usr/bin;
#   3. apt-get install chromium (as root, or with sudo -n), after apt-get update if needed.
# Playwright drives this system browser (never `playwright install`, which downloads its own).
# Exits non-zero, saying why, when none can be had (the test then skips, or fails under $CI).
set -u
say() { echo "chromium.sh: $*" >&2; }
found() {
  if [ -n "${WQ_SQL_CHROMIUM:-}" ] && [ -x "$WQ_SQL_CHROMIUM" ]; then echo "$WQ_SQL_CHROMIUM"; return 0; fi
  for p in "$(command -v chromium 2>/dev/null)" /usr/bin/chromium; do
    if [ -n "$p" ] && [ -x "$p" ]; then echo "$p"; return 0; fi
  done
  return 1
}

found && exit 0
if [ "$(id -u)" = 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n); else
  say "chromium is not installed and this user cannot install packages (apt-get install chromium)"; exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then say "chromium is not installed and there is no apt-get"; exit 1; fi
say "installing chromium with apt-get"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get install -y -q chromium >&2 \
  || { "${as_root[@]}" apt-get update -q >&2 && "${as_root[@]}" apt-get install -y -q chromium >&2; }
found && exit 0
say "apt-get could not install chromium"
exit 1
