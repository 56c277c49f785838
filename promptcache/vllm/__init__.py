"""promptcache as vLLM's KV connector (``kv_connector_module_path: promptcache.vllm``).

vLLM imports this package and reads ``PromptcacheConnector`` from it; the attribute is resolved
lazily so the vLLM-free parts (``settings``, ``layout``) import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PromptcacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "PromptcacheConnector":
        from promptcache.vllm.connector import PromptcacheConnector

        return PromptcacheConnector
    raise AttributeError(name)
