"""Weight-only quantized linear layers for the torch engine (``--weights int8|int4``).

Decode on a CPU streams every weight once per token: float32 weights make it memory-bound.
These modules replace a model's ``nn.Linear`` layers (through ``Module.set_submodule``, a public
torch API; transformers is never patched) with packed integer weights run by torch's own CPU
kernels: ``aten._weight_int8pack_mm`` (int8, one scale per output channel) and
``aten._weight_int4pack_mm_for_cpu`` (int4, an asymmetric scale + zero per group of inputs).
Both kernels take bfloat16 activations (their float32 paths are scalar and slower than a float32
matmul), so a layer's input is rounded to bfloat16 and its output cast back. A layer whose shape
a kernel refuses keeps its weights at the model's dtype. Embeddings and norms are not touched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from promptcache.errors import ConfigError

log = logging.getLogger("promptcache")

WEIGHT_MODES = ("model", "int8", "int4")  # "model": the weights as the checkpoint's dtype
INT4_GROUP = 32  # inputs per int4 scale/zero (the finest group the CPU kernel takes)
COMPUTE = torch.bfloat16  # the activations' dtype inside both kernels


class Int8Linear(nn.Module):
    """y = x W^T + b with W as int8 levels times one bfloat16 scale per output row (symmetric,
    round to nearest: within half a step of the float weight)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        levels = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", levels.contiguous())
        self.register_buffer("scales", scale.to(COMPUTE))
        self.bias = _keep_bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        return _finish(y, x, self.out_features, self.bias)


class Int4Linear(nn.Module):
    """y = x W^T + b with W in groups of ``INT4_GROUP`` inputs, each 16 levels between its min and
    max (w = (q - 8) * scale + zero, the kernel's convention), packed for the CPU kernel."""

    def __init__(self, linear: nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        self.in_features, self.out_features, self.group = k, n, group
        grouped = w.reshape(n, k // group, group)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        levels = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            levels.to(torch.int32).reshape(n, k), 1
        )
        zero = low + 8 * scale
        # [k // group, n, 2]: scale and zero per (group, output), as the kernel reads them
        self.register_buffer("qweight", packed)
        self.register_buffer(
            "scales_zeros",
            torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(COMPUTE),
        )
        self.bias = _keep_bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.qweight, self.group, self.scales_zeros
        )
        return _finish(y, x, self.out_features, self.bias)


def _keep_bias(linear: nn.Linear) -> nn.Parameter | None:
    return None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)


def _finish(y: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).reshape(*x.shape[:-1], n)
    return y + bias if bias is not None else y


QUANTIZED: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}


def check_weights_mode(mode: str | None, device: str | torch.device = "cpu") -> str:
    """``mode`` normalised (None: ``model``); ConfigError for an unknown mode or a device the
    kernels do not run on."""
    mode = mode or "model"
    if mode not in WEIGHT_MODES:
        raise ConfigError(f"--weights {mode!r}: use int8 or int4 (default: the model's dtype)")
    if mode in QUANTIZED and torch.device(device).type != "cpu":
        raise ConfigError(f"--weights {mode} runs on torch's CPU kernels: use --device cpu")
    return mode


def can_quantize(linear: nn.Linear, mode: str) -> bool:
    k, n = linear.in_features, linear.out_features
    if mode == "int4":  # the packing works on whole groups and pairs of rows
        return k % INT4_GROUP == 0 and n % 16 == 0
    return True


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Replace every quantizable ``nn.Linear`` of ``model`` (in place) by its ``mode`` module;
    the number replaced. ``model`` mode: nothing changes. Tied weights (an LM head sharing the
    embedding) are untied: the embedding keeps its float weights for the lookup."""
    mode = check_weights_mode(mode)
    if mode not in QUANTIZED:
        return 0
    cls = QUANTIZED[mode]
    names = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and can_quantize(module, mode)
    ]
    kept = sum(1 for _, m in model.named_modules() if type(m) is nn.Linear) - len(names)
    with torch.no_grad():
        for name in names:
            model.set_submodule(name, cls(model.get_submodule(name)))
    if kept:
        log.info("--weights %s: %d linear layers of unsupported shape keep their dtype", mode, kept)
    return len(names)


def weights_mode(model: nn.Module) -> str:
    """Which of ``WEIGHT_MODES`` the model's linear layers run in (part of its fingerprint)."""
    for module in model.modules():
        for mode, cls in QUANTIZED.items():
            if isinstance(module, cls):
                return mode
    return "model"


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (what one decode step may stream)."""
    tensors: list[Any] = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
