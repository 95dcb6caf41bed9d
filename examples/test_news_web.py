"""The news web application (examples/news_web/) in headless chromium, against a real Leveret node process.

The pusher and the consumer run as their own processes (``python -m
examples.news_web.pusher`` / ``consumer``), as the README starts them; playwright
drives Debian's chromium (never a downloaded browser). A headline pushed on
one page shows on the other within a second; a comment goes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node import REPO_ROOT, NodeProcess
from harness.ports import free_ports

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")]


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited: {log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within 30 s: {log.read_text()[-3000:]}")


@pytest.fixture
def pages(tmp_path: Path) -> Iterator[tuple[str, str]]:
    node = NodeProcess(tmp_path / "data", tmp_path / "logs")
    node.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        pusher_port, consumer_port = free_ports(2)
        for module, port, extra in (("pusher", pusher_port, []),
                                    ("consumer", consumer_port, ["--topics", "sports,tech", "--reader", "ana"])):
            log = tmp_path / f"{module}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", f"examples.news_web.{module}", "--grpc", f"127.0.0.1:{node.grpc_port}",
                     "--port", str(port), *extra], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
            procs.append(proc)
            url = f"http://127.0.0.1:{port}/"
            wait_http(url, proc, log)
            urls.append(url)
        yield urls[0], urls[1]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        node.cleanup()


def test_headline_reaches_the_consumer_page_within_a_second_and_a_comment_comes_back(
        pages: tuple[str, str], tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    pusher_url, consumer_url = pages
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            errors: list[str] = []
            pusher = browser.new_page(viewport={"width": 1100, "height": 650})
            consumer = browser.new_page(viewport={"width": 1100, "height": 650})
            for page in (pusher, consumer):
                page.on("pageerror", lambda exc: errors.append(str(exc)))
            pusher.goto(pusher_url)
            consumer.goto(consumer_url)
            for page in (pusher, consumer):
                page.wait_for_selector("body[data-live=yes]")  # the event stream is open
            consumer.wait_for_selector("#subscribed:has-text('sports, tech')")

            # A sports headline pushed through the form shows on the consumer page within a second.
            pusher.fill("#topic", "sports")
            pusher.fill("#headline", "Leverets win the cup")
            pusher.fill("#body", "A late goal settles the final.")
            started = time.monotonic()
            pusher.click("#push-button")
            item = consumer.locator("li.news", has_text="Leverets win the cup")
            item.wait_for(timeout=5000)
            elapsed = time.monotonic() - started
            print(f"headline shown on the consumer page {elapsed * 1000:.0f} ms after the click")
            assert elapsed < 1.0, f"the headline took {elapsed:.2f} s"
            assert "sports" in item.locator(".topic").inner_text()
            pusher.wait_for_selector("#push-status:has-text('Pushed to sports')")

            # A topic the consumer did not subscribe to never shows; the next tech one does.
            for topic, headline in (("weather", "Rain all week"), ("tech", "New broker released")):
                pusher.fill("#topic", topic)
                pusher.fill("#headline", headline)
                pusher.click("#push-button")
                pusher.wait_for_selector(f"#push-status:has-text('Pushed to {topic}')")
            consumer.locator("li.news", has_text="New broker released").wait_for(timeout=5000)
            assert "Rain all week" not in consumer.inner_text("#news")

            # Bad input is refused with the reason, nothing pushed.
            pusher.fill("#topic", "Not A Topic!")
            pusher.fill("#headline", "x")
            pusher.click("#push-button")
            pusher.wait_for_selector("#push-status.error:has-text('topic')")

            # A comment on the consumer page comes back to the pusher page, live.
            item.locator("input[name=comment]").fill("What a match!")
            started = time.monotonic()
            item.locator("button").click()
            comment = pusher.locator("li.comment", has_text="What a match!")
            comment.wait_for(timeout=5000)
            print(f"comment shown on the pusher page {(time.monotonic() - started) * 1000:.0f} ms after the click")
            assert "ana" in comment.inner_text() and "Leverets win the cup" in comment.inner_text()

            for name, page in (("pusher", pusher), ("consumer", consumer)):
                shot = tmp_path / f"news-{name}.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot: {shot}")
            assert errors == []
        finally:
            browser.close()
