import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A real `promptcache serve` process on a free loopback port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = args
        self.env = {**os.environ, "PROMPTCACHE_LOG_LEVEL": "warning", **(env or {})}
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> "ServerProcess":
        import httpx

        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
        cmd = [
            sys.executable,
            "-m",
            "promptcache.cli",
            "serve",
            "--port",
            str(self.port),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.args}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from promptcache.engines.tiny_models import save_tiny_model

    return save_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def server_factory(tmp_path):
    started: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(
            list(args),
            env={"PROMPTCACHE_HOME": str(tmp_path / "home"), **(env or {})},
            log=tmp_path / "server.log",
        )
        started.append(srv.start())
        return srv

    yield make
    for srv in started:
        srv.stop()
