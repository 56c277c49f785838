"""Why a request missed the cache: the reason for the part of the prompt that was computed.

Reasons, checked in this order:
- ``disabled``: the server runs without a cache.
- ``none``: everything but the last token was reused (its logits must be computed anyway).
- ``damaged``: a block on disk failed its checks; the hit ends before it (it was quarantined).
- ``snapshot``: the cache held more, but a model with snapshot layers (sliding window, SSM)
  resumes only where a checkpoint was saved (and, where the prompt then differs from what the
  cache holds, which message and role that is).
- ``evicted``: an earlier request of this namespace covered more; its blocks were evicted
  (the eviction log says from which tier and when).
- ``unsaved``: an earlier request covered more, but its blocks are gone and the eviction log does
  not know them (never saved: a full budget of pinned blocks, a cancelled prefill; or evicted
  longer ago than the log remembers).
- ``in_flight``: an earlier request covering more was still running when this one looked up
  (agents fire requests in parallel); its blocks were not all saved yet.
- ``namespace``: another namespace (tenant, salt) holds a longer prefix; caches never cross
  namespaces. Only looked for when tenants are not a security boundary (no API keys).
- ``image``: the closest earlier request has the same tokens there, but an image differs at
  token i (the same placeholder tokens, other pixels): "image differs at token i".
- ``diverged``: the prompt differs from the closest earlier request at token i (which message,
  which role, the text on both sides).
- ``cold``: the missed tokens were never seen (a first request, or new input after a hit).

Only a remembered request that covers the hit can have supplied it; when none does (after a
restart the SSD tier supplies hits no remembered request made), the reasons that name an earlier
request are not looked for and the detail names the tiers that supplied the hit (``supplied_by``).
- ``cancelled``: the client left during prefill (recorded without a diagnosis).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from promptcache.core.images import first_image_difference
from promptcache.core.stats import LookupReport

MISS_REASONS = (
    "none", "cold", "image", "diverged", "evicted", "unsaved", "in_flight", "namespace", "snapshot", "damaged",
    "disabled", "cancelled",
)  # fmt: skip
CONTEXT_TOKENS = 12  # tokens of text shown on each side of a divergence


class Miss(NamedTuple):
    reason: str  # one of MISS_REASONS
    detail: dict[str, Any]


ImageMarks = tuple[tuple[int, bytes], ...]  # (first token, pixel digest) per image


class _Seen(NamedTuple):
    request_id: int
    tokens: np.ndarray  # uint32: prompt + reply
    finished_s: float  # wall clock when it was remembered (its reply saved)
    images: ImageMarks = ()
    session: str = ""  # the request's session ("": none), so deleting a session forgets it


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PromptMemory:
    """Recent requests' tokens (prompt + reply) per namespace, to find the closest earlier one.
    Bounded: ``per_namespace`` sequences each, ``max_tokens`` and ``max_namespaces`` in all
    (the oldest sequence, or the namespace used least recently, goes first). Thread-safe."""

    name = "prompts"  # a SessionHolder (server/session_registry.py)

    def __init__(
        self, per_namespace: int = 32, max_tokens: int = 4_000_000, max_namespaces: int = 1024
    ) -> None:
        self.per_namespace = per_namespace
        self.max_tokens = max_tokens
        self.max_namespaces = max_namespaces
        self._seen: OrderedDict[int, tuple[str, _Seen]] = OrderedDict()  # oldest first
        self._by_ns: OrderedDict[str, deque[int]] = OrderedDict()  # least recently added first
        self.num_tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def add(
        self,
        namespace: str,
        request_id: int,
        tokens: np.ndarray,
        finished_s: float = 0.0,
        images: ImageMarks = (),
        session: str = "",
    ) -> None:
        with self._lock:
            seen = _Seen(request_id, tokens, finished_s, images, session)
            self._seen[request_id] = (namespace, seen)
            self.num_tokens += len(tokens)
            ids = self._by_ns.setdefault(namespace, deque())
            self._by_ns.move_to_end(namespace)
            ids.append(request_id)
            while len(ids) > self.per_namespace:
                self._forget(ids.popleft())
            while len(self._by_ns) > self.max_namespaces:
                _, dropped = self._by_ns.popitem(last=False)
                for rid in dropped:
                    self._forget(rid)
            while self.num_tokens > self.max_tokens and len(self._seen) > 1:
                rid, (ns, _) = next(iter(self._seen.items()))
                self._by_ns[ns].popleft()  # the oldest overall is its namespace's oldest
                if not self._by_ns[ns]:
                    del self._by_ns[ns]
                self._forget(rid)

    def forget(self, namespace: str, session: str | None = None, force: bool = False) -> int:
        """Drop the namespace's remembered requests of ``session`` (None: all of them); returns
        how many. A deleted session's tokens must not outlive its blocks here. (``force``: each
        entry is one request's, never shared: nothing more to remove.)"""
        with self._lock:
            ids = self._by_ns.get(namespace)
            if not ids:
                return 0
            gone = [r for r in ids if session is None or self._seen[r][1].session == session]
            for rid in gone:
                ids.remove(rid)
                self._forget(rid)
            if not ids:
                del self._by_ns[namespace]
            return len(gone)

    def _forget(self, request_id: int) -> None:
        _, seen = self._seen.pop(request_id)
        self.num_tokens -= len(seen.tokens)

    def closest(
        self,
        namespace: str,
        tokens: np.ndarray,
        other_namespaces: bool = False,
        images: ImageMarks = (),
    ) -> tuple[int, _Seen | None, str]:
        """(common prefix, the earlier request sharing it, its namespace): the longest over this
        namespace, or over every other namespace with ``other_namespaces``. A prefix ends where
        an image differs (``images`` against the earlier request's)."""
        with self._lock:
            pools = [
                (ns, [self._seen[rid][1] for rid in ids])
                for ns, ids in self._by_ns.items()
                if (ns != namespace) == other_namespaces
            ]
        best, best_seen, best_ns = 0, None, namespace
        for ns, seen in pools:
            for s in reversed(seen):  # newest first: on ties the latest request is named
                n = common_prefix(s.tokens, tokens)
                if images or s.images:
                    at = first_image_difference(images, s.images, n)
                    n = n if at is None else at
                if n > best:
                    best, best_seen, best_ns = n, s, ns
        return best, best_seen, best_ns


def diagnose(
    tokens: np.ndarray,
    report: LookupReport | None,
    memory: PromptMemory,
    namespace: str,
    *,
    may_name_namespaces: bool,
    decode: Callable[[list[int]], str],
    locate: Callable[[int], tuple[int, str]] | None = None,
    now_s: float = 0.0,
    started_s: float = float("inf"),
    images: ImageMarks = (),
) -> Miss:
    """The reason for the computed part of ``tokens`` (the prompt), before it is remembered."""
    n = len(tokens)
    if report is None:
        return Miss("disabled", {})
    hit = report.num_tokens
    missed = {"missed_tokens": n - hit}
    if n - hit <= 1:
        return Miss("none", {})
    if report.num_damaged:
        return Miss("damaged", {**missed, "damaged_blocks": report.num_damaged})
    if report.requires_checkpoint and report.num_matched > hit + 1:
        detail = {**missed, "cached_tokens": min(report.num_matched, n), "checkpoint_at": hit}
        if report.num_matched < n - 1 and locate is not None:  # where the prompt left the cache
            message, role = locate(report.num_matched)
            detail |= {"token_index": report.num_matched, "message_index": message, "role": role}
        return Miss("snapshot", detail)
    reach = max(hit, report.num_matched)
    same, seen, _ = memory.closest(namespace, tokens, images=images)
    supplier: dict[str, Any] = {}
    if seen is not None and same < hit:
        # no remembered request covers the hit, so none of them supplied it (a tier written
        # before a restart did, or a request forgotten since): compare with the cache instead
        same, seen = 0, None
        supplier = {"supplied_by": dict(report.tokens_by_tier)}
    elif seen is None and hit:
        supplier = {"supplied_by": dict(report.tokens_by_tier)}
    # the tokens go on agreeing past ``same``: an image there differs (the blocks holding it
    # key by its pixels, so the hit ends at or before its first token)
    if (
        seen is not None
        and reach <= same < min(len(seen.tokens), n - 1)
        and common_prefix(seen.tokens, tokens) > same
    ):
        message, role = locate(same) if locate is not None else (-1, "")
        return Miss(
            "image",
            {**missed, "token_index": same, "message_index": message, "role": role,
             "earlier_request": seen.request_id, "message": f"image differs at token {same}"},
        )  # fmt: skip
    if same > reach + 1 and seen is not None:
        detail = {**missed, "earlier_request": seen.request_id, "earlier_tokens": same}
        if seen.finished_s > started_s:  # it was still running when this one looked up
            return Miss("in_flight", detail)
        if report.evicted is not None:
            ago = round(max(0.0, now_s - report.evicted.time_s), 3)
            return Miss("evicted", {**detail, "tier": report.evicted.tier, "seconds_ago": ago})
        return Miss("unsaved", detail)
    if supplier and report.evicted is not None:  # the cache held the continuation once
        ago = round(max(0.0, now_s - report.evicted.time_s), 3)
        return Miss(
            "evicted", {**missed, **supplier, "tier": report.evicted.tier, "seconds_ago": ago}
        )
    if may_name_namespaces:
        other, other_seen, other_ns = memory.closest(namespace, tokens, other_namespaces=True)
        if other > max(same, reach) + 1 and other_seen is not None:
            return Miss(
                "namespace",
                {**missed, "namespace": other_ns, "shared_tokens": other,
                 "earlier_request": other_seen.request_id},
            )  # fmt: skip
    if seen is not None and 0 < same < min(len(seen.tokens), n - 1):
        at = same
        message, role = locate(at) if locate is not None else (-1, "")
        lo, hi = max(0, at - CONTEXT_TOKENS), at + CONTEXT_TOKENS
        return Miss(
            "diverged",
            {
                **missed,
                "token_index": at,
                "message_index": message,
                "role": role,
                "earlier_request": seen.request_id,
                "before": decode([int(t) for t in tokens[lo:at]]),
                "found": decode([int(t) for t in tokens[at:hi]]),
                "expected": decode([int(t) for t in seen.tokens[at:hi]]),
            },
        )
    return Miss("cold", {**missed, "first_seen": hit == 0, **supplier})
