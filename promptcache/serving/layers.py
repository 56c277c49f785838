"""Layer kinds: one adapter per cache class, found in a registry by the class itself.

A model library keeps one cache object per layer, of a kind that decides how the prompt cache
can store it: *positional* state (attention keys/values) can be sliced per block and
concatenated back, *snapshot* state (a sliding-window ring, an SSM's recurrent state) is only
valid at the position it was taken and travels whole in a checkpoint. The per-library state
modules (``torch_state``, ``mlx_state``) define the adapters and register them; supporting a new
cache class is registering one adapter, never another ``isinstance`` branch.
"""

from __future__ import annotations

from typing import Generic, NamedTuple, Protocol, TypeVar


class LayerKind(Protocol):
    """What every adapter declares about the layers it handles."""

    @property
    def positional(self) -> bool:
        """Its state is sliced per block along the sequence and can be cut back (crop)."""

    @property
    def snapshot(self) -> bool:
        """Some of its state is copied whole into checkpoints (valid at one position only)."""


A = TypeVar("A", bound=LayerKind)


class AdapterRegistry(Generic[A]):
    """Cache class -> adapter. The lookup is by exact class: a subclass may add state its base's
    adapter would not save, so an unregistered class gets ``default``, which must be the safe
    choice (snapshot everything: restorable at checkpoints only, but always restored whole)."""

    __slots__ = ("_by_class", "default")

    def __init__(self, default: A) -> None:
        self._by_class: dict[type, A] = {}
        self.default = default

    def register(self, cls: type, adapter: A) -> None:
        self._by_class[cls] = adapter

    def lookup(self, obj: object) -> A:
        return self._by_class.get(type(obj), self.default)


class Layout(NamedTuple):
    """Where each kind of state sits in one model's cache (``S`` is a layer index or slot)."""

    positional: tuple  # layers/slots whose state is sliced per block, in payload order
    snapshot: tuple  # layers/slots copied into checkpoints, in checkpoint order
    kinds: tuple[str, ...]  # class name per layer/slot, for tests and the logs

    @property
    def requires_checkpoint(self) -> bool:
        """True when some state is snapshot state (a hit must end at a checkpoint)."""
        return bool(self.snapshot)

    @property
    def has_positional(self) -> bool:
        """True when some state is sliced per block."""
        return bool(self.positional)
