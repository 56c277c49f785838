"""Typed figures. A stats object declares once, beside each number, whether it is a counter or a
gauge and which label names its keys; the same object gives the JSON of ``/v1/cache/stats``
(``to_dict``) and the series of ``/metrics`` (``series``), so the exposition never guesses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Kind = Literal["counter", "gauge", "histogram"]
_META = "figure"  # dataclass field metadata: (kind, label)


@dataclass(frozen=True, slots=True)
class Series:
    """One metric family: a number, or numbers by the value of one label."""

    name: str
    kind: Kind
    value: float | Mapping[str, float]
    label: str = ""  # the label's name when ``value`` is a mapping
    total: float = 0.0  # a histogram's sum of observations

    def renamed(self, prefix: str) -> Series:
        return dataclasses.replace(self, name=prefix + self.name)

    def lines(self, prefix: str = "") -> list[str]:
        name = prefix + self.name
        out = [f"# TYPE {name} {self.kind}"]
        if self.kind == "histogram":
            assert isinstance(self.value, Mapping)
            return out + _histogram_lines(name, self.value, self.total)
        if isinstance(self.value, Mapping):
            assert self.label, f"{name}: a mapping needs a label name"
            out += [f'{name}{{{self.label}="{k}"}} {_number(v)}' for k, v in self.value.items()]
        else:
            out.append(f"{name} {_number(self.value)}")
        return out


@runtime_checkable
class Figures(Protocol):
    """Stats that render themselves both ways."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values by name, taken consistently (one lock or one snapshot)."""

    def series(self) -> list[Series]:
        """Every number ``/metrics`` shows, with its kind and label; names carry no prefix.
        Texts and flags stay JSON-only."""


def meta(kind: Kind, label: str = "") -> dict[str, tuple[Kind, str]]:
    """Field metadata declaring a figure: ``field(metadata=meta("counter"))`` where the field
    has no default (a checker reads any other call as a default)."""
    return {_META: (kind, label)}


def counter(default: Any = dataclasses.MISSING, *, label: str = "") -> Any:
    """A dataclass field that only grows (a mapping when ``label`` names its keys)."""
    return _field("counter", label, default)


def gauge(default: Any = dataclasses.MISSING, *, label: str = "") -> Any:
    """A dataclass field that goes up and down."""
    return _field("gauge", label, default)


def _field(kind: Kind, label: str, default: Any) -> Any:
    if isinstance(default, dict | list):
        return field(default_factory=lambda: type(default)(default), metadata=meta(kind, label))
    return field(default=default, metadata=meta(kind, label))


def field_series(cls: Any, values: Mapping[str, Any]) -> list[Series]:
    """A series for each field of dataclass ``cls`` declared with ``counter``/``gauge``, its value
    read from ``values`` (a snapshot); a None value (not set) is left out."""
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_META)
        if spec is not None and values.get(f.name) is not None:
            out.append(Series(f.name, spec[0], values[f.name], spec[1]))
    return out


def histogram(name: str, bounds: Iterable[float], counts: Iterable[int], total: float) -> Series:
    """A histogram series from per-bucket counts (the last one past every bound)."""
    keys = [*(str(b) for b in bounds), "+Inf"]
    return Series(name, "histogram", dict(zip(keys, counts, strict=True)), total=total)


def _histogram_lines(name: str, counts: Mapping[str, float], total: float) -> list[str]:
    """Prometheus buckets are cumulative: each counts every observation up to its bound."""
    out, running = [], 0.0
    for bound, n in counts.items():
        running += n
        out.append(f'{name}_bucket{{le="{bound}"}} {_number(running)}')
    return out + [f"{name}_sum {_number(total)}", f"{name}_count {_number(running)}"]


@dataclass(frozen=True, slots=True)
class Snapshot(Mapping[str, Any]):
    """Figures taken at one moment: the JSON values (read as a mapping) and the series built
    from the same values."""

    data: dict[str, Any]
    parts: tuple[Series, ...] = ()

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)

    def series(self) -> list[Series]:
        return list(self.parts)


@dataclass(frozen=True, slots=True)
class Joined:
    """Several figures shown as one: their JSON merged flat, their series in order."""

    parts: tuple[Figures, ...]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.to_dict())
        return out

    def series(self) -> list[Series]:
        return [s for part in self.parts for s in part.series()]


def render_series(series: Iterable[Series], prefix: str = "") -> list[str]:
    return [line for s in series for line in s.lines(prefix)]


def _number(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(int(v))
