"""The web console in a real browser: Debian's chromium, headless, driven by playwright."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from compat_tests.mgmt_http import Mgmt, leveret_only, start_mgmt

CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is not installed (Debian's chromium package)")


@pytest.fixture(scope="module")
def mgmt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mgmt]:
    yield from start_mgmt(tmp_path_factory.mktemp("mgmt-console"))


def test_console_login_queue_appears_after_publish_then_purge(mgmt: Mgmt, tmp_path: Path) -> None:
    leveret_only(mgmt)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    name = f"console-{uuid.uuid4().hex[:6]}"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            # The page's Content-Security-Policy must allow everything the console does: a
            # violation is reported on the browser's console.
            page.on("console", lambda msg: errors.append(msg.text)
                    if "Content Security Policy" in msg.text else None)
            response = page.goto(mgmt.base + "/")
            assert response is not None
            assert response.headers["x-frame-options"] == "DENY"
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
            # A wrong password is refused and the login form stays.
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "nope")
            page.click("#login button")
            page.wait_for_selector("#login-error:has-text('Login failed')")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")
            # Declare and publish over the API, as an application would; the console shows the queue.
            mgmt.ok("PUT", f"/api/queues/%2F/{name}", {"durable": False})
            for i in range(3):
                mgmt.ok("POST", "/api/exchanges/%2F/amq.default/publish",
                        {"routing_key": name, "payload": f"hello {i}", "properties": {}})
            page.click("a[href='#/queues']")
            row = page.locator("#queues tr", has_text=name)
            row.wait_for()
            assert row.locator("td").nth(3).inner_text() == "3"
            row.locator("a.queue-link").click()
            page.wait_for_selector("#q-messages:has-text('3')")
            # Publish one more from the queue page, get one back, then purge.
            page.fill("#payload", "from the console")
            page.click("#publish-button")
            page.wait_for_selector("#status:has-text('Message published')")
            page.wait_for_selector("#q-messages:has-text('4')")
            page.click("#get-button")
            page.wait_for_selector("#got:has-text('hello 0')")
            page.click("#purge-button")
            page.wait_for_selector("#status:has-text('Purged')")
            page.wait_for_selector("#q-messages:has-text('0')")
            screenshot = tmp_path / "console-queue.png"
            page.screenshot(path=str(screenshot), full_page=True)
            page.click("a[href='#/overview']")
            page.wait_for_selector("#rates-chart")
            overview_shot = tmp_path / "console-overview.png"
            page.screenshot(path=str(overview_shot), full_page=True)
            print(f"\nconsole screenshots: {screenshot} {overview_shot}")
            assert screenshot.stat().st_size > 10_000
            assert errors == []
        finally:
            browser.close()
    assert mgmt.get(f"/api/queues/%2F/{name}")["messages"] == 0
    mgmt.ok("DELETE", f"/api/queues/%2F/{name}")


def test_console_lists_and_closes_a_connection(mgmt: Mgmt, tmp_path: Path) -> None:
    leveret_only(mgmt)
    import pika

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    conn = pika.BlockingConnection(pika.URLParameters(mgmt.amqp_url))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page()
            page.goto(mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")
            page.click("a[href='#/connections']")
            page.wait_for_selector("#connections button.close-connection")
            page.once("dialog", lambda dialog: dialog.accept("closed by the console test"))
            page.locator("#connections button.close-connection").first.click()
            page.wait_for_selector("#status:has-text('Closed')")
        finally:
            browser.close()
    with pytest.raises(pika.exceptions.ConnectionClosed) as closed:
        for _ in range(20):
            conn.process_data_events(time_limit=0.5)
    assert closed.value.reply_code == 320 and "closed by the console test" in closed.value.reply_text


def _report() -> dict[str, object]:
    """A report as spark/retention_job.py writes it (the job itself runs in tests/test_retention.py)."""
    def queue(name: str, before: int, removed: int, archived: int) -> dict[str, object]:
        return {"vhost": "/", "queue": name, "fenced": False, "messages_before": before, "bytes_before": before * 1024,
                "removed_messages": removed, "removed_bytes": removed * 1024, "archived_messages": archived,
                "deleted_messages": removed, "kept_messages": before - removed, "kept_bytes": (before - removed) * 1024,
                "oldest_age_seconds": 3600.0}
    queues = [queue("orders", 5000, 1200, 1200), queue("audit-log", 20000, 15000, 0)]
    totals = {k: sum(q[k] for q in queues) for k in ("messages_before", "removed_messages", "removed_bytes",  # type: ignore[misc]
                                                     "archived_messages", "deleted_messages", "kept_messages")}
    return {"run_id": "console-test", "now": 1795000000.0, "dry_run": False, "mark_only": False, "queues": queues,
            "totals": {**totals, "marked_messages": 0}, "timings": {"total_s": 12.5}}


def test_console_shows_the_last_retention_report(mgmt: Mgmt, tmp_path: Path) -> None:
    leveret_only(mgmt)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    assert mgmt.get("/api/leveret/retention") == {"report": None, "chart": False}
    assert mgmt.node is not None
    out = mgmt.node.data_dir / "retention"
    out.mkdir(parents=True, exist_ok=True)
    report = _report()
    from spark.report_chart import render

    render(str(out / "last-report.png"), report)  # the job's own chart renderer
    (out / "last-report.json").write_text(json.dumps(report))
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")
            page.click("a[href='#/retention']")
            page.wait_for_selector("#retention-summary:has-text('removed 16200 of 25000')")
            assert page.locator("#retention tr", has_text="audit-log").locator("td").nth(2).inner_text() == "15000"
            # The chart arrives through an authenticated fetch and is drawn.
            page.wait_for_function("document.getElementById('retention-chart').naturalWidth > 0")
            shot = tmp_path / "console-retention.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nconsole screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()
