"""The vLLM connector's vLLM-free parts: settings, request tags, the step planner, layout
fingerprints (no vLLM needed; the end-to-end tests are tests/test_vllm_connector.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from promptcache.vllm.layout import KvLayout, namespace_fingerprint
from promptcache.vllm.plan import StepPlanner
from promptcache.vllm.settings import ConnectorSettings, RequestTags, request_tags


def test_settings_parse_sizes_and_refuse_unknown_keys():
    s = ConnectorSettings.from_extra({"cache_dir": "/x", "ram_budget": "1GB", "shared_ttl": 60})
    assert (s.cache_dir, s.ram_budget, s.shared_ttl, s.shared_tier) == ("/x", 10**9, 60.0, None)
    with pytest.raises(ValueError, match="cahce_dir"):
        ConnectorSettings.from_extra({"cahce_dir": "/x"})


def test_request_tags_tenant_is_the_salt_session_from_xargs():
    tags = request_tags("alpha", {"promptcache_session": "s1", "promptcache_ttl": "1h"})
    assert tags == RequestTags("alpha", "s1", 3600.0)
    assert request_tags(None, {"promptcache_ttl": "soon"}) == RequestTags("", "", None)


def test_layout_changes_the_namespace():
    a = KvLayout("torch.float32", 32, 30, 3, 64, "cpu")
    b = KvLayout("torch.bfloat16", 32, 30, 3, 64, "cpu")
    assert namespace_fingerprint("m", a) != namespace_fingerprint("m", b)
    assert namespace_fingerprint("m", a) == namespace_fingerprint("m", a)
    assert namespace_fingerprint("m", a) != namespace_fingerprint("n", a)


def test_planner_loads_past_vllms_hit_and_saves_each_full_block_once():
    p = StepPlanner(block_size=4)
    req = SimpleNamespace(all_token_ids=list(range(18)))
    p.track("r", req, RequestTags("t"))
    p.plan_load("r", num_external=8)  # 2 blocks from us beyond vLLM's 1-block hit
    # first step: 12 tokens computed (4 vLLM's + 8 ours), the remaining 6 scheduled
    ops = p.step([("r", [10, 11, 12, 13, 14], True, 12, 6)])
    (load,) = ops.loads
    assert (load.start_block, load.num_blocks, load.block_ids) == (1, 2, [10, 11, 12])
    assert load.tokens == list(range(13))  # one token past the loaded blocks
    (save,) = ops.saves
    assert (save.start_block, save.block_ids, len(save.tokens)) == (0, [10, 11, 12, 13], 16)
    # decoding: a new block is saved only once its KV is complete (the reply's blocks too)
    req.all_token_ids.append(99)
    assert p.step([("r", None, False, 18, 1)]).saves == []
    req.all_token_ids.append(98)
    (save,) = p.step([("r", [15], False, 19, 1)]).saves
    assert (save.start_block, save.block_ids, save.tokens[-2:]) == (
        4,
        [10, 11, 12, 13, 14],
        [99, 98],
    )
    assert p.step([("r", None, False, 20, 1)]).loads == []
    p.forget("r")
    assert p.step([("r", None, False, 20, 1)]).saves == []
