"""The report page and the model card rendered by a real headless Chromium: the text a
reader sees carries the key figures, and no request leaves the machine (Chromium's own
network log lists every URL the page asked for). Skipped where no Chromium is installed
(Debian: apt-get install chromium).

With NCAKNN_SCREENSHOT_DIR set, the screenshots are written there too: that is how
docs/report-page.png and docs/model-card.png were made
(NCAKNN_SCREENSHOT_DIR=docs python -m pytest tests/integration/test_pages_in_browser.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from service.core.artifact import read_artifact
from tests.service.servers import free_port, start_server, wait_ready
from training.cli import main as train

BROWSER = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium installed")
# the flags a sandboxed, offline machine needs (no background traffic of Chromium's own)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--disable-features=NetworkTimeServiceQuerying",
]


def render(url: str, work: Path, name: str, size: str = "1100,2600") -> tuple[str, set[str]]:
    """(the DOM as Chromium rendered it, every URL its network log shows); a screenshot of
    the page is left at work/name.png. One Chromium run does all three (headless Chromium
    carries out --dump-dom and --screenshot on the same page load)."""
    netlog = work / f"{name}.netlog.json"
    dom = subprocess.run(
        [
            BROWSER,
            *FLAGS,
            f"--user-data-dir={work / ('profile-' + name)}",
            f"--log-net-log={netlog}",
            f"--screenshot={work / (name + '.png')}",
            f"--window-size={size}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return dom, page_requests(netlog)


def page_requests(netlog: Path) -> set[str]:
    """The URLs the page asked for: the net log's request jobs, less Chromium's own (its
    time and update checks, which carry the initiator "not an origin")."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return {
        event["params"]["url"]
        for event in log["events"]
        if event["type"] == start
        and "url" in event.get("params", {})
        and event["params"].get("initiator") != "not an origin"
    }


def only_local(urls: set[str]) -> set[str]:
    """The URLs that would leave the machine."""
    local = ("http://127.0.0.1", "file://", "data:", "chrome:", "about:")
    return {u for u in urls if not u.startswith(local)}


def test_the_network_log_sees_a_page_that_fetches(tmp_path):
    """The check below works: a page with one external image is caught."""
    page = tmp_path / "fetching.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png">hello</body></html>')
    dom, urls = render(page.as_uri(), tmp_path, "fetching", size="200,200")
    assert "hello" in dom
    assert only_local(urls) == {"http://example.invalid/x.png"}
    assert (tmp_path / "fetching.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def keep(work: Path, name: str) -> None:
    target = os.environ.get("NCAKNN_SCREENSHOT_DIR")
    if target:
        shutil.copy(work / f"{name}.png", Path(target) / f"{name}.png")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser") / "digits"
    code = train(
        [
            "--data",
            "digits",
            "--n-components",
            "8",
            "--out",
            str(out),
            "--max-iter",
            "40",
            "--quiet",
        ]
    )
    assert code == 0
    return out


def test_the_report_page_in_a_browser(trained, tmp_path):
    dom, urls = render((trained / "report.html").as_uri(), tmp_path, "report-page")
    manifest = read_artifact(trained).manifest
    k = str(manifest["default_k"])
    assert "nca-knn model report: digits" in dom
    assert f"{manifest['metrics']['test_accuracy'][k]:.4g}" in dom
    assert "Confusion matrix" in dom and "Outlier calibration" in dom
    assert "<svg" in dom and "data:image/png;base64," in dom
    assert not only_local(urls), only_local(urls)
    assert (tmp_path / "report-page.png").stat().st_size > 10_000
    keep(tmp_path, "report-page")


def test_the_model_card_in_a_browser(trained, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(trained, port, NCAKNN_DOCS="public")
    try:
        wait_ready(url, proc)
        import httpx

        for _ in range(5):
            httpx.post(f"{url}/v1/classify", json={"instances": [[0.0] * 64]}, timeout=5)
        dom, urls = render(f"{url}/", tmp_path, "model-card", size="1100,1900")
        version = httpx.get(f"{url}/v1/model", timeout=5).json()["model_version"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "nca-knn model card" in dom and version in dom
    accuracy = json.loads((trained / "report.json").read_text())["metrics"]["test_accuracy"]
    assert f"{accuracy[str(read_artifact(trained).default_k)]:.4g}" in dom
    assert re.search(r"<th>requests</th><td>[5-9]</td>", dom)
    assert not only_local(urls), only_local(urls)
    keep(tmp_path, "model-card")
