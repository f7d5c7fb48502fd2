"""`llmgw report` (issue 14, part 6): one HTML page from a real run's ledger and metrics, rendered in
headless Chromium (Debian's `chromium`); the screenshot is not blank and every plot has data. No
content or credential of any request reaches the page."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from matplotlib import image

from llmgw.local.stack import Stack
from tests.conftest import DEMO_KEYS, ledger_of, start_stack
from tests.helpers import chat_body, clear_faults, inject_fault, llmgw, request, unique_marker

pytestmark = pytest.mark.e2e
CANARY = unique_marker("CANARYCONTENT")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("report"), simulate_providers=True)
    yield s
    s.stop()


def _send(s: Stack, tenant: str, body: dict[str, object], **headers: str) -> tuple[str, int]:
    r = request(f"{s.url}/v1/chat/completions", "POST", body,
                {"authorization": f"Bearer {DEMO_KEYS[tenant]}", **headers}, timeout=30)
    return str(r.headers.get("x-request-id", "")), r.status


@pytest.fixture(scope="module")
def page(gw: Stack, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The report of a run with every kind of outcome the page draws."""
    settled = []
    for i in range(6):  # streams and answers on the pool, with the canary in their content
        stream = {"stream": True, "stream_options": {"include_usage": True}} if i % 2 == 0 else {}
        rid, status = _send(gw, "acme", chat_body(content=f"{CANARY} {i}", max_tokens=6, **stream))
        assert status == 200
        settled.append(("acme", rid))
    rid, status = _send(gw, "globex", chat_body(content="hello from globex", max_tokens=4))
    assert status == 200
    settled.append(("globex", rid))
    pool = gw.engine_urls("engine-pool")
    for _ in range(2):  # the pool fails before its first byte: the hosted candidate serves
        marker = inject_fault(pool, "status=503")
        rid, status = _send(gw, "acme", chat_body("chat-fallback", content=marker, max_tokens=4))
        assert status == 200
        settled.append(("acme", rid))
    marker = inject_fault(pool, "delay_ms=3000")  # past the caller's deadline
    rid, status = _send(gw, "acme", chat_body(content=marker, max_tokens=4), **{"x-llmgw-deadline-ms": "300"})
    assert status == 504
    settled.append(("acme", rid))
    clear_faults(pool)
    rid, status = _send(gw, "acme", {**chat_body(content=CANARY), "bogus": 1})  # refused at intake
    assert status == 400
    for tenant, rid in settled:
        ledger_of(gw, rid, tenant)
    out = tmp_path_factory.mktemp("page") / "report.html"
    done = llmgw("report", "--store-url", str(gw.store_url), "--metrics-url", gw.metrics_url, "-o", str(out))
    assert done.returncode == 0, done.stderr
    return out.read_text(), out


def _points(html: str) -> list[tuple[str, int]]:
    """(caption, points) of every figure."""
    return [(cap, int(n)) for n, cap in re.findall(
        r'<figure data-points="(\d+)">.*?<figcaption>(.*?)</figcaption>', html, re.S)]


def test_every_plot_has_data_and_the_tables_count_the_run(page: tuple[str, Path]) -> None:
    html, _ = page
    figures = dict(_points(html))
    drawn = {cap: n for cap, n in figures.items() if not cap.startswith("budget globex")}
    assert drawn and all(n > 0 for n in drawn.values()), figures
    assert any(cap.startswith("chat-default / read_only_chat") for cap in figures)
    assert any(cap.startswith("chat-fallback / read_only_chat") for cap in figures)
    assert "budget acme-monthly (money) burn-down" in figures
    assert html.count("data:image/png;base64,") == sum(n > 0 for n in figures.values())
    # chat-default: 7 requests (6 acme + 1 globex) + the deadline; the deadline is 1 of 8 timed out.
    row = re.search(r"<tr><td>chat-default</td><td>read_only_chat</td><td>(\d+)</td><td>([\d.]+)%</td>"
                    r"<td>([\d.]+)%</td><td>([\d.]+)%</td>", html)
    assert row is not None
    assert (int(row[1]), row[4]) == (8, "12.5")
    # Two requests fell back.
    assert re.search(r"<tr><td>chat-fallback</td><td>2</td><td>2</td></tr>", html), html
    # The gateway's counters came from the metrics endpoint.
    assert "llmgw_settlements_total" in html


def test_no_content_and_no_credential_reaches_the_page(page: tuple[str, Path]) -> None:
    html, _ = page
    assert CANARY not in html
    assert not any(key in html for key in DEMO_KEYS.values())


def test_the_page_renders_in_chromium_with_plots(page: tuple[str, Path], tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is required (Debian's `chromium`; .ci/run installs it)"
    _, path = page
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1400,2400", path.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = image.imread(str(shot))[:, :, :3]
    white = (pixels > 0.97).all(axis=2)
    assert white.mean() < 0.97, "the screenshot is blank"
    # matplotlib's first line colour (C0, #1f77b4) is drawn: plots with data rendered, not empty axes.
    c0 = (abs(pixels[:, :, 0] - 0x1F / 255) < 0.03) & (abs(pixels[:, :, 1] - 0x77 / 255) < 0.03) & \
        (abs(pixels[:, :, 2] - 0xB4 / 255) < 0.03)
    assert c0.sum() > 500, c0.sum()
