"""Sibling projections of one input in one matmul (``fuse_projections``): q/k/v, gate/up.

A one-token decode step is ~200 small matmuls whose fixed cost (oneDNN's dispatch, a thread
barrier) is a large part of each; an attention's q, k and v projections (and an MLP's gate and
up) read the same input, so one matmul over their weights stacked gives all of them. The stack
is built once and each module's ``weight`` becomes a view of its rows: same values, same
state-dict keys and fingerprint, no extra memory.

At run time the first sibling called computes the whole stack and keeps it for the others, which
return their columns when called with the very same input tensor before the group is used up
(every sibling served once); a sibling fed another input recomputes the stack for it. The
models' attention and MLP code never modifies a projection's input in place between siblings
(inference tensors carry no version counter to check it).

Groups of int4 siblings (``--weights int4``) get an ``Int4Stack``: the packed weights
concatenated, the siblings' ``qweight`` views of it. Every sibling of either kind has ``stack``
(called on an input: all the siblings' outputs) and ``start``, which the lean decode step
(``torch.lean``) calls once per group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from promptcache.engines.torch.onednn import OneDnnLinear, onednn_linear
from promptcache.engines.torch.weights import Int4Linear

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class StackedWeights:
    """The stacked weights of a group of siblings and the last input's full output."""

    __slots__ = ("weight", "bias", "x", "out", "num_left")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.num_left = 0  # siblings not yet served from ``out``

    def __deepcopy__(self, memo: dict[int, Any]) -> StackedWeights:
        return self  # the weights are shared, never written (compiled.plain_twin copies modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's output for ``x``, side by side (nothing kept)."""
        return onednn_linear(x, self.weight, self.bias)

    def take(self, x: torch.Tensor, start: int, stop: int, size: int) -> torch.Tensor:
        if self.x is not x or self.num_left == 0:
            self.out = self(x)
            self.x, self.num_left = x, size
        self.num_left -= 1
        out = self.out
        if self.num_left == 0:  # every sibling served: drop the references
            self.x = self.out = None
        assert out is not None
        return out[..., start:stop]


class StackedLinear(OneDnnLinear):
    """One sibling: its rows ``start:stop`` of a ``StackedWeights`` (its ``weight`` a view)."""

    def __init__(self, linear: OneDnnLinear, stack: StackedWeights, start: int, size: int) -> None:
        super().__init__(linear)
        self.stack, self.start, self.size = stack, start, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.take(x, self.start, self.start + self.out_features, self.size)


def fuse_projections(model: Any) -> int:
    """Stack every group of sibling ``OneDnnLinear`` projections (same input width, all with or
    all without bias) in place, and give groups of ``Int4Linear`` siblings an ``Int4Stack``;
    idempotent. Returns how many groups were stacked."""
    num_groups = 0
    for module in model.modules():
        for names in SIBLINGS:
            found = [getattr(module, n, None) for n in names]
            for kind, stack in ((OneDnnLinear, _stack), (Int4Linear, _stack_int4)):
                members = [m for m in found if type(m) is kind]
                if len(members) < len(names) or len({m.in_features for m in members}) != 1:
                    continue
                if len({m.bias is None for m in members}) != 1:
                    continue
                num_groups += bool(stack(module, names, members))
    return num_groups


@torch.no_grad()
def _stack(parent: nn.Module, names: tuple[str, ...], members: list[Any]) -> bool:
    weight = torch.cat([m.weight for m in members])
    bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
    stack = StackedWeights(weight, bias)
    start = 0
    for name, member in zip(names, members, strict=True):
        stop = start + member.out_features
        member.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            member.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        setattr(parent, name, StackedLinear(member, stack, start, len(members)))
        start = stop
    return True


class Int4Stack:
    """The packed int4 weights of a group of ``Int4Linear`` siblings as one matrix, for the lean
    decode step (``torch.lean``): each sibling's ``qweight`` is a view of its rows (the packing
    is in blocks of rows, checked when stacked); the siblings' own forwards are unchanged."""

    __slots__ = ("qweight", "scales_zeros", "bias", "group", "in_features", "out_features")

    def __init__(self, members: list[Int4Linear]) -> None:
        self.qweight = torch.cat([m.qweight for m in members])
        self.scales_zeros = torch.cat([m.scales_zeros for m in members], dim=1)
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.cat(biases)
        self.group, self.in_features = members[0].group, members[0].in_features
        self.out_features = sum(m.out_features for m in members)

    def __deepcopy__(self, memo: dict[int, Any]) -> Int4Stack:
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return Int4Linear.forward(self, x)  # type: ignore[arg-type]


@torch.no_grad()
def _stack_int4(parent: nn.Module, names: tuple[str, ...], members: list[Any]) -> bool:
    if len({m.group for m in members}) != 1 or any(hasattr(m, "stack") for m in members):
        return False
    stack = Int4Stack(members)
    probe = torch.randn(3, stack.in_features, generator=torch.Generator().manual_seed(0))
    want = torch.cat([m(probe) for m in members], -1)
    if not torch.equal(stack(probe), want):  # sizes off the packing's row blocks: not exact
        return False
    start = 0
    for member in members:
        stop = start + member.out_features
        member.qweight = stack.qweight[start:stop]  # a view: the separate copy is freed
        member.stack, member.start = stack, start
        start = stop
    return True
