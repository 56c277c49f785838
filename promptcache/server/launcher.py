"""A real ``promptcache serve`` process on a free loopback port: for tests, benchmarks and demos
that drive the server the way a client does (over HTTP, in another process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from promptcache.core.ports import free_port, start_claiming_port

__all__ = ["ServerProcess", "free_port"]


class ServerProcess:
    """``start()`` returns once ``/health`` answers; ``stop()`` terminates (or kills) it."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
        log_level: str = "warning",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.env = {**os.environ, "PROMPTCACHE_LOG_LEVEL": log_level, **(env or {})}
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120) -> ServerProcess:
        """Its own ``/health`` (its pid) counts, not another server's on the port."""
        start_claiming_port(lambda: self._start_once(timeout), self._move_to, "the server")
        return self

    def _move_to(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def _start_once(self, timeout: float) -> bool:
        """True once the child answers; False when it exited while another process held its
        port; raises on any other exit or after ``timeout``."""
        import httpx

        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
        cmd = [sys.executable, "-m", "promptcache.cli", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, *self.args], env=self.env, stdout=out, stderr=subprocess.STDOUT
        )
        is_port_taken = False
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if is_port_taken:
                    return False
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.args}")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                if _answer_pid(r) == self.proc.pid:
                    return True
                is_port_taken = True  # another server (ours or not) holds the port
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stats(self) -> dict[str, Any]:
        import httpx

        return dict(httpx.get(self.url + "/v1/cache/stats", timeout=10).json())


def _answer_pid(r: Any) -> int | None:
    """The pid a ``/health`` answer reports: None for a server that reports none."""
    try:
        body = r.json()
    except ValueError:
        return None
    return body.get("pid") if isinstance(body, dict) else None
