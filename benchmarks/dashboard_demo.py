"""Drive the bundled model like an agent client, then screenshot /dashboard in headless Chromium.

Run: .venv/bin/python benchmarks/dashboard_demo.py [--out docs/dashboard.png] [--turns 4]
Two sessions of a multi-turn conversation: the second's system prompt carries a different
per-session header near its start (as Claude Code's billing header does when it is kept), so its
first request diverges at that header; later turns reuse their own history.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import ServerProcess  # noqa: E402

SYSTEM = (
    "x-session-header: cc_version=2.1; cch={tag};\n"
    "You are an airline customer service agent. Follow the policy: authenticate the user, "
    "confirm every change before calling a tool, one tool call at a time. " * 6
)
QUESTIONS = [
    "I need to change my flight from Boston to Seattle to next Tuesday.",
    "My reservation number is ZFA04Y. Can you check the fare rules?",
    "Keep the same seat if possible. What will it cost?",
    "Yes, go ahead and book it, and add one checked bag.",
]


def run_session(url: str, tag: str, turns: int) -> None:
    messages = [{"role": "system", "content": SYSTEM.format(tag=tag)}]
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 24, "temperature": 0},
            timeout=300,
        )
        r.raise_for_status()
        messages.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/dashboard.png")
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    home = Path(tempfile.mkdtemp())
    srv = ServerProcess(["--no-ssd", "--hit-rate-window", "6"], env={"PROMPTCACHE_HOME": str(home)})
    srv.start(timeout=600)
    try:
        run_session(srv.url, "3f1a", args.turns)
        run_session(srv.url, "9c27", args.turns)
        time.sleep(2.5)  # two dashboard polls: the evictions chart gets points
        out = Path(args.out).resolve()
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={home / 'chromium'}",
             "--virtual-time-budget=8000", "--window-size=1400,1250", f"--screenshot={out}",
             srv.url + "/dashboard"],
            check=True, capture_output=True, env={**os.environ},
        )  # fmt: skip
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    finally:
        srv.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
