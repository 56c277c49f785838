"""The dashboard page in a real headless Chromium: it renders, its charts have data after a few
requests, the alert banner shows under the threshold, and a screenshot is kept as an artifact."""

import os
import random
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.server
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(
    os.environ.get("PROMPTCACHE_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts")
)
# headless on a machine without a network: no background connections, no sandbox as root
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=8000", "--window-size=1400,1800"]  # fmt: skip


class _Dom(HTMLParser):
    """Element attributes by id, plus counts of table rows and chart points."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.num_rows = 0
        self.num_points = 0
        self.body: dict[str, str | None] = {}
        self._in_body_rows = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.by_id[a["id"]] = a
        if tag == "body":
            self.body = a
        if tag == "tbody":
            self._in_body_rows = True
        if tag == "tr" and self._in_body_rows:
            self.num_rows += 1
        if "point" in (a.get("class") or "").split():
            self.num_points += 1

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body_rows = False


def chromium(url: str, *extra: str, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp}", *extra, url],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (make test installs it)")
def test_dashboard_renders_with_data_and_banner(tiny_llama_dir, server_factory, tmp_path):
    srv = server_factory(
        "--engine", "torch", "--model", tiny_llama_dir, "--no-ssd", "--block-size", "16",
        "--hit-rate-alert", "0.95", "--hit-rate-window", "5",
    )  # fmt: skip
    rng = random.Random(0)
    history = [rng.randrange(3, 300) for _ in range(120)]
    for _ in range(4):  # a conversation: each turn reuses the last
        history += [rng.randrange(3, 300) for _ in range(30)]
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": "m", "prompt": history, "max_tokens": 3, "temperature": 0})  # fmt: skip
        assert r.status_code == 200
    for _ in range(3):  # and cold requests that pull the window under 95%
        cold = [rng.randrange(3, 300) for _ in range(200)]
        httpx.post(
            srv.url + "/v1/completions",
            json={"model": "m", "prompt": cold, "max_tokens": 3},
            timeout=120,
        )

    page = chromium(srv.url + "/dashboard", "--dump-dom", tmp=tmp_path / "a")
    assert page.returncode == 0, page.stderr[-2000:]
    dom = _Dom()
    dom.feed(page.stdout)
    assert dom.body.get("data-ready") == "1", page.stdout[:2000]  # the data calls succeeded
    assert "hidden" in dom.by_id["error"]  # no error shown
    assert "hidden" not in dom.by_id["banner"]  # hit rate under the threshold: the banner shows
    for chart in ("chart-hit", "chart-saved", "chart-ttft", "tiers"):
        assert int(dom.by_id[chart].get("data-points") or 0) > 0, chart
    assert dom.num_rows == 7 and dom.num_points > 20
    assert "diverged" in page.stdout or "cold" in page.stdout

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    run = chromium(srv.url + "/dashboard", f"--screenshot={shot}", tmp=tmp_path / "b")
    assert run.returncode == 0 and shot.stat().st_size > 20_000  # a real rendering, not blank

    metrics = httpx.get(srv.url + "/metrics").text
    assert "promptcache_hit_rate_alert 1" in metrics
    assert 'promptcache_requests_by_miss_reason_total{reason="cold"}' in metrics
    assert httpx.get(srv.url + "/dashboard/nope.js").status_code == 404
