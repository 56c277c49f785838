"""What identifies vLLM's KV blocks in our cache: the model and vLLM's KV layout.

The namespace fingerprint joins the model's fingerprint (its config and a digest of its weight
files) with vLLM's KV layout (dtype, block size, layers, KV heads, head size, device kind), so
blocks of another layout, or our own server's blocks of the same model, never share a chain or
an SSD folder. Plain data only: no vLLM import, the connector fills ``KvLayout`` in.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from promptcache.core.hashing import digest_bytes

_SAMPLE_BYTES = 1 << 20  # of each weight file, head and tail: changed weights change the digest


@dataclass(slots=True, frozen=True)
class KvLayout:
    dtype: str  # the KV cache's torch dtype, e.g. "torch.float32"
    block_size: int  # tokens per vLLM block: one cache block per vLLM block
    num_layers: int
    num_kv_heads: int
    head_size: int
    device: str  # "cpu", "cuda": paged views differ between platforms


class UnsupportedModelError(ValueError):
    """A model whose KV the connector cannot hold (hybrid Mamba / linear attention, ...)."""


def weights_digest(folder: Path) -> str:
    """A digest of a model folder's weight files (names, sizes, first and last MiB of each):
    cheap at start-up, and different for other weights of the same config."""
    h = xxhash.xxh3_128()
    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                fh.seek(size - _SAMPLE_BYTES)
                h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def model_fingerprint(model: str, revision: str | None, config: dict) -> str:
    """The model's identity: its config and, for a local folder, its weights' digest (a hub
    name with its revision otherwise)."""
    folder = Path(model)
    weights = weights_digest(folder) if folder.is_dir() else f"{model}@{revision or 'main'}"
    canonical = json.dumps({"config": config, "weights": weights}, sort_keys=True, default=str)
    return digest_bytes(canonical.encode()).hex()


def namespace_fingerprint(model_fp: str, layout: KvLayout) -> str:
    """The fingerprint every block of this vLLM deployment hashes under (and its SSD folder)."""
    canonical = json.dumps(["vllm-kv/v1", model_fp, asdict(layout)], sort_keys=True)
    return digest_bytes(canonical.encode()).hex()
