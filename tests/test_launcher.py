"""``ServerProcess`` under parallel tests: ``free_port`` hands a port back before the child binds
it, so another worker's server may take it first. The launcher must not take that server for its
own (a CI run once sent Claude Code to another test's tiny model), and must start on a new port."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from promptcache.server.launcher import ServerProcess

pytest.importorskip("torch")
pytestmark = pytest.mark.server


class OtherServer(BaseHTTPRequestHandler):
    """Another process's healthy server on the port: 200 and a pid that is not the child's, or
    no body at all (vLLM's ``/health``)."""

    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.body
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("body", [json.dumps({"status": "ok", "pid": 1}).encode(), b""])
def test_a_port_taken_by_another_server_is_not_mistaken_for_its_own(body, tiny_llama_dir, tmp_path):
    handler = type("Other", (OtherServer,), {"body": body})
    other = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    args = ["--engine", "torch", "--model", tiny_llama_dir, "--no-ssd"]
    srv = ServerProcess(args, env={"PROMPTCACHE_HOME": str(tmp_path)}, log=tmp_path / "log")
    srv.port, srv.url = taken, f"http://127.0.0.1:{taken}"  # as if free_port had lost the race
    try:
        srv.start()
        assert srv.port != taken
        health = httpx.get(srv.url + "/health", timeout=5).json()
        assert srv.proc is not None and health["pid"] == srv.proc.pid
        assert b"address already in use" in (tmp_path / "log").read_bytes().lower()
    finally:
        srv.stop()
        other.shutdown()
