"""A loopback stand-in for the Hugging Face Hub's HTTP API: the few endpoints huggingface_hub's
own ``snapshot_download`` calls (repo info, tree listing, file resolve with HEAD and ranged GET).

Point ``HF_ENDPOINT`` at it and the real huggingface_hub client writes a real HF cache (blobs/,
snapshots/<commit>/, refs/<branch or tag>) exactly as it does from huggingface.co: the tests then
resolve models from that cache offline, through huggingface_hub, with no mock of the resolver.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """``add(repo, folder, refs)`` publishes a folder's files as one commit of ``repo`` under
    each ref (branch or tag name); ``url`` is the endpoint."""

    def __init__(self) -> None:
        self.commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> commit -> files
        self.refs: dict[str, dict[str, str]] = {}  # repo -> ref -> commit
        self.requests: list[str] = []
        self.missing: set[str] = set()  # file names answered 404, as a download cut short
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, repo: str, folder: Path, refs: list[str]) -> str:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
                 if p.is_file()}  # fmt: skip
        commit = hashlib.sha1(repr(sorted((k, git_blob_sha1(v)) for k, v in files.items())).encode()).hexdigest()  # fmt: skip
        self.commits.setdefault(repo, {})[commit] = files
        for ref in refs:
            self.refs.setdefault(repo, {})[ref] = commit
        return commit

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _resolve(self, repo: str, rev: str) -> str | None:
        if rev in self.commits.get(repo, {}):
            return rev
        return self.refs.get(repo, {}).get(rev)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, obj: object) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _missing(self, code: str) -> None:
                self._send(404, b'{"error": "not found"}', {"X-Error-Code": code})

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) >= 6:
                    repo, kind, rev = "/".join(parts[2:4]), parts[4], parts[5]
                    if repo not in hub.commits:
                        return self._missing("RepoNotFound")
                    commit = hub._resolve(repo, rev)
                    if commit is None:
                        return self._missing("RevisionNotFound")
                    files = hub.commits[repo][commit]
                    if kind == "revision":
                        return self._json({"id": repo, "modelId": repo, "sha": commit, "private": False,
                                           "siblings": [{"rfilename": f} for f in files]})  # fmt: skip
                    if kind == "tree":
                        return self._json([_tree_entry(p, d) for p, d in files.items()])
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                    commit = hub._resolve(repo, rev)
                    data = hub.commits.get(repo, {}).get(commit or "", {}).get(name)
                    if data is None or name in hub.missing:
                        return self._missing("EntryNotFound")
                    etag = _etag(name, data)
                    start = 0
                    if (rng := self.headers.get("Range", "")).startswith("bytes="):
                        start = int(rng[6:].split("-")[0] or 0)
                    headers = {"X-Repo-Commit": commit or "", "ETag": f'"{etag}"'}
                    if _is_lfs(name):
                        headers.update(
                            {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
                        )
                    return self._send(206 if start else 200, data[start:], headers)
                return self._missing("NotFound")

        return Handler


def _is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".gguf", ".bin"))


def _etag(name: str, data: bytes) -> str:
    return hashlib.sha256(data).hexdigest() if _is_lfs(name) else git_blob_sha1(data)


def _tree_entry(path: str, data: bytes) -> dict[str, object]:
    entry: dict[str, object] = {
        "type": "file",
        "path": path,
        "size": len(data),
        "oid": git_blob_sha1(data),
    }
    if _is_lfs(path):
        entry["lfs"] = {
            "oid": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            "pointerSize": 134,
        }
    return entry
