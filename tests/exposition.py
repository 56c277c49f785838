"""A strict reader of the Prometheus text format as ``/metrics`` writes it: each family has one
``# TYPE`` line before its samples, no name twice, numbers only, histogram buckets cumulative
with ``+Inf`` equal to ``_count``."""

from __future__ import annotations

import math
import re

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_]+)="([^"]*)"(,|$)')
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("",), "gauge": ("",)}


def read_exposition(text: str) -> dict[str, dict]:
    """``{family: {"kind": ..., "samples": {(name, labels, their values): number}}}`` (several
    labels joined by commas); raises
    AssertionError on anything a Prometheus scraper would reject or misread."""
    families: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in SUFFIXES, line
            assert name not in families, f"{name} declared twice"
            families[name] = current = {"kind": kind, "samples": {}}
            current["name"] = name
            continue
        assert not line.startswith("#"), line
        m = SAMPLE.match(line)
        assert m, f"not a sample: {line!r}"
        name, _, labels, number = m.groups()
        label = label_value = None
        if labels is not None:
            pairs = LABEL.findall(labels)
            assert "".join(f'{k}="{v}"{c}' for k, v, c in pairs) == labels, line
            label, label_value = ",".join(k for k, _, _ in pairs), ",".join(v for _, v, _ in pairs)
        assert current is not None, f"{name} before any # TYPE"
        suffix = name[len(current["name"]) :]
        assert name.startswith(current["name"]) and suffix in SUFFIXES[current["kind"]], (
            f"{name} under the family {current['name']} ({current['kind']})"
        )
        value = float(number)  # raises on anything else
        assert not math.isinf(value), line
        key = (name, label, label_value)
        assert key not in current["samples"], f"{line!r} twice"
        current["samples"][key] = value
    for name, fam in families.items():
        if fam["kind"] == "histogram":
            buckets = [v for (n, _, _), v in fam["samples"].items() if n.endswith("_bucket")]
            assert buckets == sorted(buckets), f"{name}: buckets not cumulative"
            assert (
                fam["samples"][(name + "_bucket", "le", "+Inf")]
                == fam["samples"][(name + "_count", None, None)]
            )
        if fam["kind"] == "counter":
            assert all(v >= 0 for v in fam["samples"].values()), f"{name}: a negative counter"
    return families
