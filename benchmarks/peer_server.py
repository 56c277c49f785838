"""One OpenAI-compatible server under benchmark: start it (its own process group), stop it,
and time a streamed chat request at the client (TTFT, cached tokens, decode rate)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from promptcache.core.ports import free_port

__all__ = ["PeerServer", "free_port"]


class PeerServer:
    """``cmd`` started with HOME and PROMPTCACHE_HOME inside ``work`` (no server's on-disk cache
    leaks between runs; a restart keeps them) and the hub offline."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        work: Path,
        env: dict[str, str] | None = None,
        model: str | None = None,
    ) -> None:
        """``model``: the id requests name (None: the first of ``/v1/models``)."""
        self.name, self.cmd, self.port, self.work = name, cmd, port, work
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.model = model
        # one client for every request and thread: a fresh one per request builds an SSL
        # context (~23 ms of the client's CPU), and 32 sessions starting together put ~0.8 s
        # of that into every first turn's TTFT, whichever server answers
        self.client = httpx.Client(
            timeout=1800, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
        )

    def start(self, timeout: float = 900) -> float:
        home = self.work / "home"
        (home / ".cache/huggingface/hub").mkdir(parents=True, exist_ok=True)  # mlx_lm lists it
        # torch's extension builds stay where a user's are (built once, as on their machine)
        ext = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache/torch_extensions")
        env = {**os.environ, "HOME": str(home), "PROMPTCACHE_HOME": str(home),
               "TORCH_EXTENSIONS_DIR": ext, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **self.env}  # fmt: skip
        log = open(self.work / f"{self.name}.log", "ab")  # noqa: SIM115 (owned by the child)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = (self.work / f"{self.name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{tail}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                r = httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    self.model = self.model or (data[0]["id"] if data else None)
                    return time.perf_counter() - t0
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up in {timeout} s")

    def stop(self, crash: bool = False) -> None:
        """SIGTERM (servers may save state on the way out), SIGKILL after 60 s; ``crash``:
        SIGKILL at once (what a crash or an OOM kill leaves behind)."""
        if self.proc is None:
            return
        for sig in (signal.SIGKILL,) if crash else (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(60)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers in the group
        self.proc = None

    def chat(self, messages: list[dict[str, Any]], max_tokens: int,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        """``extra``: more body fields (``ignore_eos``: every reply ``max_tokens`` long)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}  # fmt: skip
        if self.model is not None:  # the served model's id (None: the server's only model)
            body["model"] = self.model
        t0 = time.perf_counter()
        first = last = None
        text, usage, pieces, gaps = "", None, 0, []
        url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        with self.client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.name}: HTTP {r.status_code}: {r.read().decode()[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        first = first or last
                        pieces += 1
                        text += piece
                usage = chunk.get("usage") or usage
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        tokens = usage.get("completion_tokens") or pieces
        span = (last - first) if first is not None and last is not None else 0.0
        return {"ttft_s": (first or time.perf_counter()) - t0, "text": text,
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": details.get("cached_tokens"), "completion_tokens": tokens,
                "decode_tok_s": (tokens - 1) / span if span > 0 and tokens > 1 else None,
                # between content pieces at the client: a stall shows in the largest
                "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else None,
                "gap_max_ms": 1e3 * max(gaps) if gaps else None}  # fmt: skip
