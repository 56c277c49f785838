"""``PromptcacheConnector``: promptcache's tiers, tenants and verified reads under vLLM.

Scheduler side (vLLM's engine-core process): ``get_num_new_matched_tokens`` asks the
``ChainProbe`` how far our tiers hold the prompt beyond vLLM's own hit (block-aligned, never the
last token, no tensor read); ``build_connector_meta`` turns each step into load and save ops
(``plan.StepPlanner``). Worker side: loads go through ``PromptCache.lookup`` (RAM first; a
promotion from SSD or Valkey reserves RAM and verifies each block's checksum and chained hash)
and are copied into vLLM's paged KV; a promised block that does not come back is reported by
``get_block_ids_with_load_errors`` and vLLM recomputes it. Saves copy each newly computed full
block out of the paged KV into RAM after the forward; the SSD and shared tiers write it behind
on their bounded queues (a full queue drops and counts).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from promptcache.core.hashing import Namespace
from promptcache.core.sequence import TokenSeq
from promptcache.vllm.layout import (
    KvLayout,
    UnsupportedModelError,
    model_fingerprint,
    namespace_fingerprint,
)
from promptcache.vllm.plan import LoadOp, SaveOp, StepPlanner
from promptcache.vllm.settings import ConnectorSettings, request_tags
from promptcache.vllm.stats import PromptcacheProm, PromptcacheStats, Tally

if TYPE_CHECKING:
    import torch

log = logging.getLogger("vllm.promptcache")  # under vLLM's logger: its handlers and level
STATS_EVERY_S = 1.0
BACKGROUND_NICE = 10  # our writer and reader threads' niceness (Linux: per thread)  # how often the worker samples its tiers' dropped-write counters


@dataclass
class PromptcacheMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


class PromptcacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.layout = kv_layout(vllm_config, kv_cache_config)
        model = vllm_config.model_config
        config = model.hf_config.to_dict() if hasattr(model.hf_config, "to_dict") else {}
        self.fingerprint = namespace_fingerprint(
            model_fingerprint(model.model, model.revision, config), self.layout
        )
        self.block_size = self.layout.block_size
        self.tally = Tally()
        if role == KVConnectorRole.SCHEDULER:
            # a block that fails verification is recomputed, never a failed request: the
            # scheduler reads this policy after building its connector
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            from promptcache.vllm.store import ChainProbe

            self.probe = ChainProbe(self.fingerprint, self.settings)
            self.planner = StepPlanner(self.block_size)
        else:
            from promptcache.core.worker_threads import add_start_hook
            from promptcache.vllm.store import open_cache

            # our writer and reader threads copy tensors: on vLLM's thread count each would
            # start an OpenMP team of its own, and libgomp then stops spinning between the
            # forward's parallel regions (every region waits on a futex: decode slows down)
            add_start_hook(_one_torch_thread)
            # and off the cores vLLM bound its OpenMP team to, onto the ones it reserved for
            # its other processes (a writer on a forward's core takes turns with it)
            add_start_hook(_spare_cores_hook(os.sched_getaffinity(0)))
            _check_reserved_cpus(vllm_config)
            self.cache = open_cache(self.fingerprint, self.block_size, self.settings)
            self.paged: Any = None
            self.load_errors: set[int] = set()
            self._dropped_seen = 0
            self._stats_at = 0.0
        log.info(
            "promptcache connector (%s): namespace %s, layout %s, %s",
            role.name.lower(), self.fingerprint[:16], self.layout, self.settings,
        )  # fmt: skip

    # -- scheduler side ----------------------------------------------------------------------

    def _seq(self, tokens: list[int], tenant: str) -> TokenSeq:
        root = Namespace(self.fingerprint, tenant).root_hash()
        return TokenSeq(root, tokens, self.block_size)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if _is_unhashable(request):
            return 0, False
        tags = request_tags(request.cache_salt, _extra_args(request))
        self.planner.track(request.request_id, request, tags)
        tokens = list(request.all_token_ids)
        bs = self.block_size
        if len(tokens) <= bs or num_computed_tokens >= (len(tokens) - 1) // bs * bs:
            return 0, False  # vLLM's own hit already covers every block we could add
        reach, source = self.probe.reach(self._seq(tokens, tags.tenant))
        extra = max(0, reach // bs * bs - num_computed_tokens)
        self.tally.add(lookups=1, hit_requests=int(extra > 0), miss_requests=int(extra == 0),
                       hit_tokens=extra)  # fmt: skip
        if extra:
            log.debug("promptcache: %s: %d tokens from %s beyond vLLM's %d",
                      request.request_id, extra, source, num_computed_tokens)  # fmt: skip
        else:
            log.debug("promptcache: %s: miss past vLLM's %d of %d tokens (held: %d)",
                      request.request_id, num_computed_tokens, len(tokens), reach)  # fmt: skip
        return extra, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.planner.plan_load(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled: list[tuple[str, list[int] | None, bool, int, int]] = []
        counts = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            blocks = list(r.block_ids[0]) if r.block_ids else []
            scheduled.append((r.req_id, blocks, True, r.num_computed_tokens, counts[r.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            replace = req_id in cached.resumed_req_ids
            scheduled.append((req_id, list(new[0]) if new else None, replace,
                              cached.num_computed_tokens[i], counts[req_id]))  # fmt: skip
        ops = self.planner.step(scheduled)
        for op in ops.saves:
            self.probe.note_saved(self._seq(op.tokens, op.tags.tenant), len(op.block_ids))
        return PromptcacheMetadata(ops.loads, ops.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # the last step's save already covered every full block the reply computed
        self.planner.forget(request.request_id)
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from promptcache.vllm.paged import PagedKv

        self.paged = PagedKv(kv_caches)
        log.info("promptcache connector: %d KV layers, block %s (%d bytes)",
                 len(self.paged.layers), self.paged.block_shape, self.paged.block_nbytes)  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PromptcacheMetadata) or self.paged is None:
            return
        for op in meta.loads:
            try:
                self._load(op)
            except Exception as exc:  # never fail vLLM's step: the blocks are recomputed
                log.warning("promptcache: load for %s failed: %s", op.req_id, exc)
                self._fail(op.block_ids[op.start_block : op.start_block + op.num_blocks])

    def _load(self, op: LoadOp) -> None:
        seq = self.cache.sequence(op.tokens, tenant=op.tags.tenant, session=op.tags.session,
                                  ttl_s=op.tags.ttl_s)  # fmt: skip
        wanted = op.block_ids[op.start_block : op.start_block + op.num_blocks]
        with self.cache.lookup(seq) as lease:
            if lease.report is not None and lease.report.num_damaged:
                self.tally.add(damaged_blocks=lease.report.num_damaged)
            held = lease.num_tokens // self.block_size
            loaded = 0
            for i, block_id in enumerate(wanted, start=op.start_block):
                if i >= held or not self.paged.write_block(block_id, lease.blocks[i].payload):
                    self._fail(op.block_ids[i : op.start_block + op.num_blocks])
                    break
                loaded += 1
        self.tally.add(loaded_blocks=loaded, loaded_bytes=loaded * self.paged.block_nbytes)

    def _fail(self, block_ids: list[int]) -> None:
        self.load_errors.update(block_ids)
        self.tally.add(load_errors=len(block_ids))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # saves run once per step, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PromptcacheMetadata) or self.paged is None:
            return
        for op in meta.saves:
            try:
                self._save(op)
            except Exception as exc:  # a cache that cannot save costs a future miss, no more
                log.warning("promptcache: save for %s failed: %s", op.req_id, exc)

    def _save(self, op: SaveOp) -> None:
        seq = self.cache.sequence(op.tokens, tenant=op.tags.tenant, session=op.tags.session,
                                  ttl_s=op.tags.ttl_s)  # fmt: skip
        bs = self.block_size

        def slice_block(start: int, end: int) -> Any:
            return self.paged.read_block(op.block_ids[start // bs])

        result = self.cache.save(seq, len(op.tokens), slice_block)
        self.tally.add(saved_blocks=result.num_new_blocks, saved_bytes=result.num_new_bytes)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._role != KVConnectorRole.WORKER or not self.load_errors:
            return set()
        out, self.load_errors = self.load_errors, set()
        return out

    def get_kv_connector_stats(self) -> PromptcacheStats | None:
        if (
            self._role == KVConnectorRole.WORKER
            and time.monotonic() - self._stats_at > STATS_EVERY_S
        ):
            self._stats_at = time.monotonic()
            # the tiers' own counters: describe() would ask Valkey for INFO on vLLM's step
            dropped = sum(
                int(getattr(getattr(t, "stats", None), "dropped_writes", 0))
                for t in self.cache.tiers.lower_tiers
            )
            self.tally.add(dropped_writes=max(0, dropped - self._dropped_seen))
            self._dropped_seen = dropped
        return self.tally.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PromptcacheStats:
        return PromptcacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: Any,
                           per_engine_labelvalues: Any) -> PromptcacheProm:  # fmt: skip
        return PromptcacheProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self.cache.tiers.flush(timeout=10.0)
            self.cache.close()
        else:
            self.probe.close()


def kv_layout(vllm_config: Any, kv_cache_config: Any) -> KvLayout:
    """vLLM's KV layout; UnsupportedModelError (naming the model) for anything but plain full
    attention in one group: hybrid Mamba / linear-attention, sliding-window and MLA models."""
    model = vllm_config.model_config.model
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    specs = [g.kv_cache_spec for g in groups]
    plain = [
        s for s in specs if isinstance(s, FullAttentionSpec) and not isinstance(s, MLAAttentionSpec)
    ]
    if len(groups) != 1 or len(plain) != 1 or type(specs[0]) is not FullAttentionSpec:
        kinds = sorted({type(s).__name__ for s in specs}) or ["none"]
        raise UnsupportedModelError(
            f"promptcache connector: {model} has KV cache groups {kinds}; only models whose "
            "layers are all plain full attention are supported (hybrid Mamba / linear-attention, "
            "sliding-window and MLA models are not): run it without the promptcache connector"
        )
    spec = specs[0]
    from vllm.platforms import current_platform

    return KvLayout(
        dtype=str(spec.dtype),
        block_size=int(spec.block_size),
        num_layers=len(groups[0].layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        device=str(current_platform.device_type),
    )


def _one_torch_thread() -> None:
    import torch

    torch.get_num_threads()  # a thread's first parallel op would reset a count set before it
    torch.set_num_threads(1)


def _spare_cores_hook(forward_cpus: set[int]) -> Callable[[], None]:
    """A start hook moving a thread to this machine's CPUs outside ``forward_cpus`` (none
    left: it stays where it is), at a lower priority."""
    spare = set(range(os.cpu_count() or 1)) - forward_cpus

    def move_off_forward() -> None:
        try:  # background work: the engine core and the API server come first on those cores
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        except OSError as exc:
            log.debug("promptcache: thread priority unchanged: %s", exc)
        if spare:
            try:
                os.sched_setaffinity(0, spare)  # 0: the calling thread
            except OSError as exc:  # CPUs outside this cgroup's set
                log.debug("promptcache: thread affinity unchanged: %s", exc)

    return move_off_forward


def _check_reserved_cpus(vllm_config: Any) -> None:
    """vLLM's CPU backend reserves one more core per rank whenever a KV connector is set (for
    NIXL's transfers); on a small machine that leaves its OpenMP team sharing cores with the
    engine core's busy wait (decode ran 3x slower on 2 cores). Our connector needs no core of
    its own: say how to give vLLM back the layout it picks alone."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu" or "VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ:
        return
    ranks = vllm_config.parallel_config.world_size
    log.warning(
        "promptcache connector: vLLM reserves %d more CPU core(s) for KV connectors, which "
        "this one does not use; set VLLM_CPU_NUM_OF_RESERVED_CPU=%d (vLLM's count without "
        "a connector) to keep them for the forward",
        ranks, ranks,
    )  # fmt: skip


def _extra_args(request: Any) -> dict[str, Any] | None:
    params = getattr(request, "sampling_params", None)
    return getattr(params, "extra_args", None) if params is not None else None


def _is_unhashable(request: Any) -> bool:
    """Prompts whose KV is not a function of token ids alone (images, embeddings): skipped."""
    return (
        bool(getattr(request, "mm_features", None))
        or getattr(request, "prompt_embeds", None) is not None
    )
