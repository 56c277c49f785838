"""Stored responses (``store: true``): what ``previous_response_id`` continues from and
``GET /v1/responses/{id}`` returns.

Each entry keeps the response body and the conversation through it (input and output as chat
messages, the instructions excluded as OpenAI does; message dicts are shared with the entry it
continued, so a long chain costs a list of references per turn). Bounded per tenant (oldest
first) and by age; a tenant only ever sees its own; a session's or tenant's deletion removes
its entries (``forget``).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response as returned
    messages: list[dict[str, Any]]  # the conversation through this response
    session: str
    created_s: float


class ResponseStore:
    name = "responses"  # a SessionHolder (server/session_registry.py)

    def __init__(self, max_per_tenant: int = 1000, ttl_s: float = 24 * 3600) -> None:
        self.max_per_tenant = max_per_tenant
        self.ttl_s = ttl_s
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()  # handlers run on the event loop and on worker threads

    def put(
        self, tenant: str, body: dict[str, Any], messages: list[dict[str, Any]], session: str
    ) -> None:
        entry = StoredResponse(body, messages, session, time.time())
        with self._lock:
            entries = self._by_tenant.setdefault(tenant, OrderedDict())
            entries[str(body["id"])] = entry
            self._expire(entries)
            while len(entries) > self.max_per_tenant:
                entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entries = self._by_tenant.get(tenant)
            if entries is None:
                return None
            self._expire(entries)
            entry = entries.get(response_id)
            if entry is not None:
                entries.move_to_end(response_id)  # a continued chain stays
            return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entries = self._by_tenant.get(tenant)
            return entries is not None and entries.pop(response_id, None) is not None

    def forget(self, tenant: str, session: str | None, force: bool = False) -> int:
        """Remove a session's entries (``None``: the whole tenant's); returns how many (``force``:
        a stored response is one session's, never shared)."""
        with self._lock:
            entries = self._by_tenant.get(tenant)
            if not entries:
                return 0
            if session is None:
                del self._by_tenant[tenant]
                return len(entries)
            gone = [rid for rid, e in entries.items() if e.session == session]
            for rid in gone:
                del entries[rid]
            return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._by_tenant.values())

    def _expire(self, entries: OrderedDict[str, StoredResponse]) -> None:
        cutoff = time.time() - self.ttl_s
        for rid in [rid for rid, e in entries.items() if e.created_s < cutoff]:
            del entries[rid]
