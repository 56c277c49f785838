"""`promptcache cache stats|ls|verify|clear|delete --shared-tier URL`: the shared (Valkey) tier.

No model needed: the models are found on the server (each namespace index names its model's
first 16 hex; a stored value's header names the full fingerprint). Servers may run beside it:
every change goes through the same scripts a server uses, so indexes stay consistent, and a
server's RAM and SSD copies are theirs to delete (``DELETE /v1/cache/sessions/{id}``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from promptcache.core.block_file import (
    CorruptBlockError,
    check_block,
    parse_meta,
    read_header,
    verify_identity,
)
from promptcache.core.hashing import Namespace
from promptcache.core.sessions import session_key
from promptcache.core.tiers.shared.check import namespace_index, roots
from promptcache.core.tiers.shared.link import ValkeyLink
from promptcache.core.tiers.shared.store import ValkeyStore


def find_models(url: str) -> list[str]:
    """Each model with an index on the server: its full fingerprint when a value of it is
    still there, else the 16 hex its keys carry."""
    link = ValkeyLink(url, timeout_s=5.0)
    try:
        if not link.probe():
            raise ConnectionError(f"shared tier {url} unreachable: {link.describe()}")
        keys = link.call(lambda cl: list(cl.scan_iter(match="pc:{*}:m", count=1000))) or []
        by_model: dict[str, list[bytes]] = {}
        for k in keys:
            name = k.decode() if isinstance(k, bytes) else k
            model, root = name[len("pc:{") : name.index("}")].split(":", 1)
            by_model.setdefault(model, []).append(bytes.fromhex(root))
        return [_full_fingerprint(link, m, rs) for m, rs in sorted(by_model.items())]
    finally:
        link.close()


def _full_fingerprint(link: ValkeyLink, model16: str, namespace_roots: list[bytes]) -> str:
    for root in namespace_roots:
        fields = link.call(lambda cl, r=root: cl.hkeys(f"pc:{{{model16}:{r.hex()}}}:m")) or []
        for h in (f for f in fields if len(f) == 16):
            value = link.call(
                lambda cl, h=h: cl.getrange(f"pc:{{{model16}:{h.hex()}}}:d", 0, 65535)
            )
            try:
                model = parse_meta(read_header(value)).model if value else ""
            except (CorruptBlockError, ValueError, KeyError):
                continue
            if model.startswith(model16):
                return model
    return model16


def _stores(url: str) -> list[ValkeyStore]:
    return [ValkeyStore(url, m, timeout_s=5.0) for m in find_models(url)]


def cmd_stats(store: ValkeyStore) -> None:
    namespaces = roots(store)
    blocks = nbytes = 0
    for root in namespaces:
        entries = [e for e in namespace_index(store, root)[0].values() if e is not None]
        blocks += len(entries)
        nbytes += sum(e.data_bytes for e in entries)
    pattern = store.keys.prefix.replace("{", "\\{") + "*}:s"
    sessions = store.link.call(lambda cl: sum(1 for _ in cl.scan_iter(match=pattern))) or 0
    print(f"{store.model[:16]:<18} {len(namespaces):>10} {blocks:>8} {nbytes:>14,} {sessions:>9}")


def cmd_ls(store: ValkeyStore, limit: int) -> None:
    rows = []
    for root in roots(store):
        entries, _, recency = namespace_index(store, root)
        rows += [(recency.get(h, 0.0), root, e) for h, e in entries.items() if e is not None]
    rows.sort(key=lambda r: -r[0])
    print(f"# model {store.model[:16]}: {len(rows)} blocks")
    print(f"{'hash':<34} {'namespace':<14} {'depth':>7} {'tokens':>6} {'bytes':>10} {'ckpt':>4}"
          "  last use")  # fmt: skip
    for used, root, e in rows[:limit]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(used / 1000))
        m = e.meta
        print(f"{m.block_hash.hex():<34} {root.hex()[:12]:<14} {m.depth:>7} {m.num_tokens:>6} "
              f"{e.data_bytes:>10,} {'yes' if e.has_checkpoint else '':>4}  {when}")  # fmt: skip


def cmd_verify(store: ValkeyStore) -> tuple[int, int, int]:
    """Every value checked (checksum, chained hash, model, namespace, its entry); a bad one
    is deleted with its entry, an entry whose value is gone loses its entry. (checked, bad,
    missing)."""
    checked = bad = missing = 0
    for root in roots(store):
        for h, e in namespace_index(store, root)[0].items():
            if e is None:
                print(f"bad: unparsable index entry {h.hex()}")
                bad += 1
                continue
            value = store.link.call(lambda cl, h=h: cl.get(store.keys.data(h)))
            checked += 1
            try:
                if value is None:
                    missing += 1
                    store.delete([e.meta], data=False)
                    continue
                info = check_block(value)
                verify_identity(info, h.hex())
                if info.model != store.model or info.meta != e.meta:
                    raise CorruptBlockError("value does not match its index entry")
            except CorruptBlockError as exc:
                bad += 1
                print(f"bad: {h.hex()}: {exc}")
                store.delete([e.meta])
    return checked, bad, missing


def cmd_clear(store: ValkeyStore) -> int:
    """Every key of this model: indexes, values, tags, session sets."""
    pattern = store.keys.prefix.replace("{", "\\{") + "*"

    def run(cl: Any) -> int:
        n = 0
        for k in list(cl.scan_iter(match=pattern, count=1000)):
            n += int(cl.delete(k))  # one key per call: cluster-safe
        return n

    return int(store.link.call(run) or 0)


def cmd_delete(
    store: ValkeyStore, session: str | None, tenant: str, force: bool
) -> tuple[int, int]:
    """(blocks removed, shared blocks kept) of a session, or of a whole tenant."""
    if session is None:
        if len(store.model) < 32:
            print(f"{store.model}: no value left to name the model: tenant not found")
            return 0, 0
        return store.delete_namespace(Namespace(store.model, tenant).root_hash())[0], 0
    key = session_key(tenant, session)
    tagged = store.session_blocks(key)
    shared = [h for h, is_shared in tagged.items() if is_shared]
    targets = list(tagged) if force else [h for h in tagged if not tagged[h]]
    removed = store.delete_blocks(targets)[0]
    store.forget_session(key)
    return removed, 0 if force else len(shared)


def run_shared_command(args: argparse.Namespace) -> int:
    try:
        stores = _stores(args.shared_tier)
    except (ConnectionError, ValueError) as exc:
        print(f"promptcache cache {args.action}: {exc}")
        return 2
    if args.action == "delete" and args.session is None and args.tenant is None:
        print("promptcache cache delete: give --session ID and/or --tenant NAME")
        return 2
    try:
        if args.action == "stats":
            print(f"{'model':<18} {'namespaces':>10} {'blocks':>8} {'bytes':>14} {'sessions':>9}")
        total = [0, 0, 0]
        for store in stores:
            if args.action == "stats":
                cmd_stats(store)
            elif args.action == "ls":
                cmd_ls(store, args.limit)
            elif args.action == "verify":
                total = [a + b for a, b in zip(total, cmd_verify(store), strict=True)]
            elif args.action == "clear":
                total[0] += cmd_clear(store)
            else:
                removed, kept = cmd_delete(store, args.session, args.tenant or "", args.force)
                total[0] += removed
                total[1] += kept
        if args.action == "stats" and stores:
            info = stores[0].server_info(max_age_s=0.0)
            print(f"server: {int(info.get('used_memory', 0)):,} bytes used, maxmemory "
                  f"{int(info.get('maxmemory', 0)):,} ({info.get('maxmemory_policy', '?')})")  # fmt: skip
        if args.action == "verify":
            print(f"{total[0]} blocks checked, {total[1]} bad (deleted), {total[2]} expired")
            return 1 if total[1] else 0
        if args.action == "clear":
            print(f"cleared {len(stores)} model(s) from the shared tier: {total[0]} keys")
        if args.action == "delete":
            what = f"session {args.session!r}" if args.session is not None else "every session"
            print(f"deleted {total[0]} blocks of {what} of tenant {args.tenant or '(default)'!r} "
                  f"from the shared tier; {total[1]} shared blocks kept")  # fmt: skip
        return 0
    finally:
        for store in stores:
            store.close()
