"""The web console in a real browser: Debian's chromium, headless, driven by playwright."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

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


def test_console_queue_page_follows_the_address(mgmt: Mgmt, tmp_path: Path) -> None:
    """From one queue's page straight to another's (address bar, back/forward, a hash change): the
    heading and the forms are the new queue's, so a message published from the page lands there."""
    leveret_only(mgmt)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    tag = uuid.uuid4().hex[:6]
    first, second = f"first-{tag}", f"second-{tag}"
    for name in (first, second):
        mgmt.ok("PUT", f"/api/queues/%2F/{name}", {"durable": False})

    def messages(name: str) -> int:
        return int(mgmt.get(f"/api/queues/%2F/{name}")["messages"])

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

            def publish_here(payload: str) -> None:
                page.fill("#payload", payload)
                page.click("#publish-button")
                page.wait_for_selector("#status:has-text('Message published')")

            page.click("a[href='#/queues']")
            page.locator("#queues tr", has_text=first).locator("a.queue-link").click()
            page.wait_for_selector(f"#queue-heading:has-text('Queue {first}')")
            publish_here("to the first")
            assert (messages(first), messages(second)) == (1, 0)

            # The address bar: straight to the second queue's page (a hash change in the same document).
            page.goto(mgmt.base + f"/#/queue/%2F/{second}")
            page.wait_for_selector(f"#queue-heading:has-text('Queue {second}')")
            page.wait_for_timeout(300)  # a refresh of the first page still in flight must not come back
            assert page.inner_text("#queue-heading") == f"Queue {second} (vhost /)"
            publish_here("to the second")
            assert (messages(first), messages(second)) == (1, 1)
            shot = tmp_path / "console-second-queue.png"
            page.screenshot(path=str(shot), full_page=True)

            # Back to the first queue, then forward to the second again.
            page.go_back()
            page.wait_for_selector(f"#queue-heading:has-text('Queue {first}')")
            publish_here("back on the first")
            assert (messages(first), messages(second)) == (2, 1)
            page.go_forward()
            page.wait_for_selector(f"#queue-heading:has-text('Queue {second}')")
            publish_here("forward on the second")
            assert (messages(first), messages(second)) == (2, 2)

            # A script's hash change while the 5 s refresh runs: still the page the address names.
            page.evaluate(f"location.hash = '#/queue/%2F/{first}'")
            page.wait_for_selector(f"#queue-heading:has-text('Queue {first}')")
            page.wait_for_timeout(5500)  # one automatic refresh of the page
            assert page.inner_text("#queue-heading") == f"Queue {first} (vhost /)"
            page.click("#get-button")
            page.wait_for_selector("#got:has-text('to the first')")
            # The page's charts come from the node, which keeps this queue's samples from its first view.
            page.wait_for_selector("#queue-depth-chart")
            kept = mgmt.get(f"/api/leveret/samples?vhost=%2F&queue={first}")["samples"]
            assert kept and kept[-1]["messages"] == 2 and "publish_rate" in kept[-1]
            print(f"\nconsole screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()
    for name in (first, second):
        mgmt.ok("DELETE", f"/api/queues/%2F/{name}")


def test_console_charts_come_from_server_samples(mgmt: Mgmt, tmp_path: Path) -> None:
    """The overview's charts (queued messages, rates, memory against the alarm, disk, fds) are drawn
    from the node's samples, so a reload shows the last minutes at once, with a time axis."""
    leveret_only(mgmt)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    history = mgmt.get("/api/leveret/samples")
    assert history["interval"] == 5.0 and history["samples"]
    last = history["samples"][-1]
    assert {"timestamp", "messages", "publish_rate", "mem_used", "mem_limit", "disk_free", "fd_used"} <= last.keys()
    assert 0 <= last["mem_used"] < last["mem_limit"] and last["mem_rss"] > 0
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            for chart in ("queued-chart", "rates-chart", "memory-chart", "disk-chart", "fds-chart"):
                page.wait_for_selector(f"#{chart}")
            page.reload()  # the tab keeps its login; the samples come from the node, not from the page
            page.wait_for_selector("#memory-chart")
            points = int(page.get_attribute("#memory-chart", "data-points") or 0)
            assert points >= len(history["samples"]) >= 1
            shot = tmp_path / "console-overview-charts.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nconsole screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()


def test_console_admin_forms_and_paged_queues(mgmt: Mgmt, tmp_path: Path) -> None:
    """An operator administers the node from the console: users, vhosts, permissions, limits,
    policies and operator policies, exchanges and bindings with arguments, a queue with a type and
    arguments, a publish with properties and headers, moving messages; and pages through queues."""
    leveret_only(mgmt)
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    tag = uuid.uuid4().hex[:6]
    user, vhost, x, qq, src, dst = (f"ops-{tag}", f"vh-{tag}", f"x-{tag}", f"qq-{tag}", f"src-{tag}",
                                    f"dst-{tag}")
    for i in range(120):  # more than one page of 100
        mgmt.ok("PUT", f"/api/queues/%2F/page-{tag}-{i:03d}", {"durable": False})
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(mgmt.base + "/")
            page.fill("input[name=username]", "guest")
            page.fill("input[name=password]", "guest")
            page.click("#login button")
            page.wait_for_selector("#totals")

            def submit(form: str, values: dict[str, str], checks: tuple[str, ...] = ()) -> None:
                for name, value in values.items():
                    field = page.locator(f"#{form} [name={name}]")
                    if field.evaluate("e => e.tagName") == "SELECT":
                        field.select_option(value)
                    else:
                        field.fill(value)
                for name in checks:
                    page.locator(f"#{form} [name={name}]").check()
                page.click(f"#{form} button")
                page.wait_for_selector("#status:has-text(': done')")
                page.evaluate("document.getElementById('status').textContent = ''")

            page.goto(mgmt.base + "/#/users")
            submit("add-vhost", {"name": vhost, "description": "from the console"})
            submit("add-user", {"name": user, "password": "pw-1", "tags": "management,monitoring"})
            submit("set-permissions", {"vhost": vhost, "user": user, "configure": "^c", "write": "^w", "read": "^r"})
            submit("set-topic-permissions", {"vhost": vhost, "user": user, "exchange": "amq.topic", "write": "^a"})
            submit("set-limit", {"vhost": vhost, "name": "max-queues", "value": "7"})
            assert mgmt.get(f"/api/users/{user}")["tags"] == ["management", "monitoring"]
            assert mgmt.get(f"/api/permissions/{vhost}/{user}")["configure"] == "^c"
            assert mgmt.get(f"/api/vhost-limits/{vhost}")[0]["value"] == {"max-queues": 7}
            assert any(t["exchange"] == "amq.topic" and t["write"] == "^a"
                       for t in mgmt.get(f"/api/topic-permissions/{vhost}/{user}"))
            assert mgmt.get(f"/api/vhosts/{vhost}")["description"] == "from the console"

            page.goto(mgmt.base + "/#/policies")
            submit("add-policy", {"name": f"p-{tag}", "pattern": f"^{qq}", "apply": "queues", "priority": "3",
                                  "definition": '{"max-length": 10}'})
            submit("add-policy", {"name": f"op-{tag}", "pattern": f"^{qq}", "apply": "queues",
                                  "definition": '{"max-length": 20}'}, checks=("operator",))
            assert mgmt.get(f"/api/policies/%2F/p-{tag}")["priority"] == 3
            assert mgmt.get(f"/api/operator-policies/%2F/op-{tag}")["definition"] == {"max-length": 20}

            page.goto(mgmt.base + "/#/queues")
            page.wait_for_selector("#add-queue")
            submit("add-queue", {"name": qq, "type": "quorum", "arguments": '{"x-delivery-limit": 5}'})
            submit("add-queue", {"name": src})
            submit("add-queue", {"name": dst})
            assert mgmt.get(f"/api/queues/%2F/{qq}")["type"] == "quorum"
            assert mgmt.get(f"/api/queues/%2F/{qq}")["arguments"]["x-delivery-limit"] == 5

            page.goto(mgmt.base + "/#/exchanges")
            submit("add-exchange", {"name": x, "type": "headers", "arguments": '{"alternate-exchange": "amq.fanout"}'})
            submit("add-binding", {"source": x, "destination": src, "arguments": '{"x-match": "all", "k": "v"}'})
            assert mgmt.get(f"/api/exchanges/%2F/{x}")["arguments"] == {"alternate-exchange": "amq.fanout"}
            assert [b["arguments"] for b in mgmt.get(f"/api/queues/%2F/{src}/bindings") if b["source"] == x] == [
                {"x-match": "all", "k": "v"}]

            # Publish with properties and headers from the source queue's page, then move its messages.
            page.goto(mgmt.base + f"/#/queue/%2F/{src}")
            page.wait_for_selector(f"#queue-heading:has-text('Queue {src}')")
            page.fill("#payload", "with headers")
            page.fill("#pub-properties", '{"content_type": "text/plain", "correlation_id": "c-1"}')
            page.fill("#pub-headers", '{"origin": "console"}')
            page.click("#publish-button")
            page.wait_for_selector("#status:has-text('Message published')")
            got = mgmt.request("POST", f"/api/queues/%2F/{src}/get",
                               {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}).body[0]
            assert got["properties"]["headers"] == {"origin": "console"}
            assert got["properties"]["correlation_id"] == "c-1"
            submit("move-form", {"dest": dst})
            deadline = time.monotonic() + 30
            while mgmt.get(f"/api/queues/%2F/{dst}")["messages"] != 1:
                assert time.monotonic() < deadline, "the messages were not moved"
                time.sleep(0.3)
            assert mgmt.get(f"/api/queues/%2F/{src}")["messages"] == 0

            # 120 queues of this test: two pages of 100 under a name filter, sorted by the node.
            page.goto(mgmt.base + "/#/queues")
            page.fill("#queues-filter [name=name]", f"page-{tag}")
            page.click("#queues-filter button")
            page.wait_for_selector("#queues-pager:has-text('page 1 of 2 (120 of')")
            assert page.locator("#queues tbody tr").count() == 100
            page.click("#queues-next")
            page.wait_for_selector("#queues-pager:has-text('page 2 of 2')")
            assert page.locator("#queues tbody tr").count() == 20
            page.click("#queues th:has-text('Name')")  # sorted by name, then reversed
            page.wait_for_selector("#queues th:has-text('Name ▼')")
            assert page.locator("#queues tbody tr a.queue-link").first.inner_text() == f"page-{tag}-119"
            # The other lists page and filter the same way: connections by name, with their byte rates.
            page.goto(mgmt.base + "/#/connections")
            page.wait_for_selector("#connections-pager:has-text('page 1 of')")
            page.fill("#connections-filter [name=name]", "no-such-connection")
            page.click("#connections-filter button")
            page.wait_for_selector("#connections-pager:has-text('(0 of')")
            page.goto(mgmt.base + "/#/exchanges")
            page.fill("#exchanges-filter [name=name]", x)
            page.click("#exchanges-filter button")
            page.wait_for_selector("#exchanges-pager:has-text('(1 of')")
            assert page.locator("#exchanges tbody tr").count() == 1
            shot = tmp_path / "console-admin.png"
            page.goto(mgmt.base + "/#/users")
            page.wait_for_selector("#add-user")
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nconsole screenshot: {shot}")

            submit("delete-user", {"name": user})
            submit("delete-vhost", {"name": vhost})
            assert mgmt.request("GET", f"/api/users/{user}").status == 404
            assert errors == []
        finally:
            browser.close()
    for i in range(120):
        mgmt.request("DELETE", f"/api/queues/%2F/page-{tag}-{i:03d}")
    for name in (qq, src, dst):
        mgmt.request("DELETE", f"/api/queues/%2F/{name}")
    mgmt.request("DELETE", f"/api/exchanges/%2F/{x}")
    mgmt.request("DELETE", f"/api/policies/%2F/p-{tag}")
    mgmt.request("DELETE", f"/api/operator-policies/%2F/op-{tag}")


def test_console_connection_page_charts_its_rates(mgmt: Mgmt, tmp_path: Path) -> None:
    """A connection's page charts its data and message rates from the node's samples of it (kept
    from the first time the page is shown) while a pika client publishes and gets on it."""
    leveret_only(mgmt)
    import threading

    import pika

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    tag = f"charted-{uuid.uuid4().hex[:6]}"
    stop = threading.Event()
    failures: list[BaseException] = []

    def client() -> None:
        params = pika.URLParameters(mgmt.amqp_url)
        params.client_properties = {"connection_name": tag}
        try:
            conn = pika.BlockingConnection(params)
            ch = conn.channel()
            ch.queue_declare(tag, auto_delete=True)
            ch.confirm_delivery()
            while not stop.is_set():
                for _ in range(5):
                    ch.basic_publish("", tag, b"x" * 512)
                ch.basic_get(tag, auto_ack=True)
                conn.sleep(0.05)
            conn.close()
        except BaseException as exc:  # seen by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15
        name = None
        while name is None and time.monotonic() < deadline:
            for c in mgmt.get("/api/connections"):
                if (c.get("client_properties") or {}).get("connection_name") == tag:
                    name = c["name"]
            time.sleep(0.2)
        assert name is not None, f"the publisher's connection is not listed: {failures}"
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
                page.click("a[href='#/connections']")
                page.locator("#connections tr", has_text=name).locator("a.connection-link").click()
                page.wait_for_selector(f"#connection-heading:has-text('Connection {name}')")
                # The node samples every 5 s and the page refreshes every 5 s: three points within ~20 s.
                # (A polling loop: the console's CSP forbids wait_for_function's string evaluation.)
                deadline = time.monotonic() + 30
                while int(page.get_attribute("#connection-octets-chart", "data-points") or 0) < 3:
                    assert time.monotonic() < deadline, "the connection's chart got no points"
                    page.wait_for_timeout(500)
                assert int(page.get_attribute("#connection-rates-chart", "data-points") or 0) >= 3
                assert page.locator("#connection-channels tbody tr").count() == 1
                kept = mgmt.get(f"/api/leveret/samples?connection={quote(name)}")["samples"]
                assert len(kept) >= 3
                last = kept[-1]
                assert last["recv_oct_rate"] > 0 and last["send_oct_rate"] > 0
                assert last["publish_rate"] > 0 and last["confirm_rate"] > 0 and last["get_no_ack_rate"] > 0
                shot = tmp_path / "console-connection.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"\nconsole screenshot: {shot}")
                assert errors == []
            finally:
                browser.close()
    finally:
        stop.set()
        thread.join(timeout=10)
    assert failures == []
