"""``wq-sql dashboard`` in a real browser: headless Chromium (Debian's package, found or installed
by ``scripts/chromium.sh``, ``$WQ_SQL_CHROMIUM``) driven by Playwright, loading the page while
real worker processes drain a queue. The progress bar advances, the slow worker is marked as a
straggler, a failed item appears with its error, the password never reaches the page, and
(Postgres) an outage is shown and recovered from. A screenshot is saved under tests/artifacts/.

Without a browser the test skips with the reason, except under CI (``$CI``), where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from backends import is_pg  # noqa: E402
from watch_support import (  # noqa: E402
    create_queue,
    database_away,
    start_server,
    start_worker,
    stop,
    wait_exhausted,
)

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PASSWORD = "S3cretPw9"
N, POISON_EVERY = 1200, 100
WINDOW = 3.0
# The page's epoch 0 bar shows at least n items finished.
AT_LEAST = """(n) => {
  const b = document.querySelector('section[data-queue="train"] progress[data-epoch="0"]');
  return b !== null && Number(b.getAttribute("value")) >= n;
}"""
# The timeline picture was asked for again (its src changed) and has loaded.
NEW_PICTURE = """(old) => {
  const i = document.querySelector('section[data-queue="train"] .timeline img');
  return i !== null && i.getAttribute("src") !== old && i.complete && i.naturalWidth > 0;
}"""


def chromium() -> str:
    for path in (os.environ.get("WQ_SQL_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if path and os.access(path, os.X_OK):
            return path
    why = "no Chromium (bash scripts/chromium.sh installs Debian's package, or set WQ_SQL_CHROMIUM)"
    if os.environ.get("CI"):
        pytest.fail(why + "; the dashboard's browser test is required in CI", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def browser() -> Iterator[Any]:
    path = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("playwright is not installed (pip install -e '.[test]')", pytrace=False)
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, headless=True)
        try:
            yield b
        finally:
            b.close()


def with_password(url: str) -> str:
    """The URL the dashboard gets: on Postgres with a password (the test server trusts any)."""
    if not url.startswith("postgresql"):
        return url
    return sa.engine.make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def get(address: str) -> str:
    with urllib.request.urlopen(address, timeout=30) as r:
        return str(r.read().decode())


def timeline_span(svg: str) -> float:
    """The seconds a timeline picture spans (its title says "over S s")."""
    m = re.search(r" over ([0-9.]+) s, ", svg)
    assert m is not None, svg[:500]
    return float(m.group(1))


def test_dashboard_in_chromium(backend: str, db_url: str, tmp_path: Path, browser: Any) -> None:
    create_queue(db_url, tmp_path, "train", N, poison_every=POISON_EVERY)
    server, address = start_server("dashboard", "--url", with_password(db_url), "--port", "0", "--window",
                                   str(WINDOW), "--minutes", "5", tmp_path=tmp_path)
    workers = [start_worker(db_url, "train", f"fast{k}", 40, tmp_path) for k in range(3)]
    workers.append(start_worker(db_url, "train", "slow", 600, tmp_path))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(address)
        bar = page.locator('section[data-queue="train"] progress[data-epoch="0"]')
        bar.wait_for(timeout=60_000)
        first = int(bar.get_attribute("value") or 0)
        page.wait_for_function(AT_LEAST, arg=first + 20, timeout=60_000)

        # The slow worker works 15x longer per item than the others: below half the median rate.
        page.locator('tr[data-worker="slow"].straggler').wait_for(timeout=60_000)
        assert page.locator('tr[data-worker="slow"] .badge.straggler').inner_text() == "straggler"
        fast = page.locator('tr[data-worker^="fast"].straggler').count()
        assert fast < 3, "every fast worker marked: the rule is relative to the median"
        # The workers' loops measure their waits for items (watch_support): a share and seconds
        # per worker, and the queue's share with the most waiting worker in its summary line.
        page.wait_for_function("""() => [...document.querySelectorAll(
            'section[data-queue="train"] td.input-wait')].some(td => /% \\(/.test(td.textContent))""",
                               timeout=60_000)
        meta = page.locator('section[data-queue="train"] .meta').first.inner_text()
        assert "waiting on data" in meta
        # Items still pending while the workers drain: how long ago the oldest was made claimable.
        assert "oldest pending item made claimable" in meta, meta

        error = page.locator("table.failures td.error", has_text="boom: cannot parse poison")
        error.first.wait_for(timeout=60_000)
        assert page.locator("#outage").is_hidden()
        # The timeline picture of the last minutes has the deliveries so far: wait for its next
        # refresh, then look at what the server draws.
        img = page.locator('section[data-queue="train"] .timeline img')
        page.wait_for_function(NEW_PICTURE, arg=img.get_attribute("src"), timeout=60_000)
        svg = get(address + "api/timeline.svg?queue=train")
        assert 'class="bar"' in svg and 'data-worker="slow"' in svg
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"dashboard-{backend}.png"), full_page=True)

        # Read-only, and the password is on no page, in no answer.
        state = get(address + "api/state")
        for text in (page.content(), state, get(address), get(address + "api/timeline.svg?queue=train")):
            assert PASSWORD not in text
        if is_pg(backend):
            assert "***" in json.loads(state)["database"]
        req = urllib.request.Request(address + "api/state", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 405

        for w in workers:
            wait_exhausted(w, timeout=180)
        page.wait_for_function(AT_LEAST, arg=N, timeout=60_000)
        # A finished queue's picture ends at its last event: drawn again later, the same span.
        first_span = timeline_span(get(address + "api/timeline.svg?queue=train"))
        time.sleep(1.5)
        assert timeline_span(get(address + "api/timeline.svg?queue=train")) == first_span
        if is_pg(backend):
            outage(page, db_url)
    finally:
        page.close()
        stop(workers)
        stop([server])


def outage(page: Any, db_url: str) -> None:
    """The database goes away: the page says so and keeps the last figures; it comes back: the
    page clears the alert by itself."""
    with database_away(db_url) as back:
        page.locator("#outage", has_text="database unreachable").wait_for(timeout=30_000)
        assert page.locator('section[data-queue="train"] progress[data-epoch="0"]').count() == 1
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-outage.png"), full_page=True)
        back()
        page.locator("#outage").wait_for(state="hidden", timeout=30_000)
