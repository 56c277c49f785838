"""``promptcache models``: the models this machine already has (HF cache, LM Studio, the bundled
one and its conversion), with size, format, the engine ``--engine auto`` would pick, and whether
the installed libraries can serve it (and why not).

The check is static: the config's ``model_type`` (or a GGUF's architecture) known to the installed
transformers / mlx-lm, and the weights' format readable by that engine. Nothing is loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any, NamedTuple

from promptcache.models.sources import (
    folder_bytes,
    hub_cache_dir,
    is_mlx_folder,
    is_mlx_quantized,
    lmstudio_dirs,
)


class Verdict(NamedTuple):
    fmt: str  # safetensors | mlx | gguf | none
    model_type: str | None
    engine: str  # what --engine auto picks for it here
    can_serve: bool
    reason: str | None  # why not, when it cannot


def find_local_models() -> list[dict[str, Any]]:
    """Every model found locally, one dict per (model, revision): what to pass as ``--model``
    (and ``--revision``), source, path, size_bytes and the ``Verdict`` fields."""
    rows = [*_hf_cache_rows(), *_lmstudio_rows(), *_bundled_rows()]
    for row in rows:
        row.update(check_servable(Path(row["path"]))._asdict())
    return rows


def _hf_cache_rows() -> list[dict[str, Any]]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            refs = sorted(rev.refs)
            revision = None if "main" in refs else (refs[0] if refs else rev.commit_hash)
            rows.append(
                dict(
                    model=repo.repo_id,
                    revision=revision,
                    commit=rev.commit_hash,
                    refs=refs,
                    source="hf-cache",
                    path=str(rev.snapshot_path),
                    size_bytes=rev.size_on_disk,
                )  # fmt: skip
            )
    return rows


def _lmstudio_rows() -> list[dict[str, Any]]:
    rows = []
    for root in lmstudio_dirs():
        for folder in sorted(p for p in root.glob("[!.]*/[!.]*") if p.is_dir()):
            name = f"{folder.parent.name}/{folder.name}"
            ggufs = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
            if (folder / "config.json").is_file() or not ggufs:
                items = [(name, folder)]
            else:  # one entry per quant file: --model PUBLISHER/NAME/FILE.gguf picks one
                items = [(name if len(ggufs) == 1 else f"{name}/{g.name}", g) for g in ggufs]
            for model, path in items:
                rows.append(dict(model=model, revision=None, source="lmstudio", path=str(path),
                                 size_bytes=folder_bytes(path)))  # fmt: skip
    return rows


def _bundled_rows() -> list[dict[str, Any]]:
    from promptcache.models import bundled_gguf, cache_root
    from promptcache.models.convert import is_converted

    rows = []
    try:
        gguf = bundled_gguf()
        rows.append(dict(model=None, revision=None, source="bundled", path=str(gguf),
                         size_bytes=gguf.stat().st_size))  # fmt: skip
    except FileNotFoundError:
        pass
    converted = cache_root() / "models"
    for folder in sorted(converted.glob("*")) if converted.is_dir() else []:
        if folder.is_dir() and is_converted(folder):
            rows.append(dict(model=str(folder), revision=None, source="converted",
                             path=str(folder), size_bytes=folder_bytes(folder)))  # fmt: skip
    return rows


def check_servable(path: Path) -> Verdict:
    """Can the installed libraries serve the model at ``path`` (a folder or a .gguf), and on
    which engine would ``--engine auto`` put it."""
    from promptcache.engines.factory import pick_engine
    from promptcache.models.sources import FoundModel

    if path.is_file() and path.suffix == ".gguf":
        arch = gguf_architecture(path)
        ok, reason = _torch_knows_gguf(arch)  # converted by transformers for either engine
        return Verdict("gguf", arch, pick_engine("auto", FoundModel(path, "gguf", "")), ok, reason)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return Verdict("none", None, "-", False, "no config.json or .gguf file")
    model_type = config.get("model_type")
    fmt = "mlx" if is_mlx_folder(path) else "safetensors"
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        return Verdict(fmt, model_type, "-", False, "no weights (*.safetensors) in the folder")
    engine = pick_engine("auto", FoundModel(path, "folder", path.name))
    if engine == "mlx":
        ok, reason = _mlx_knows(model_type)
    elif is_mlx_quantized(path):
        ok, reason = False, "mlx-lm quantized weights need the mlx engine (not installed)"
    else:
        ok, reason = _torch_knows(model_type)
        ok, reason = (ok, reason) if not ok else _torch_reads_quant(config)
    return Verdict(fmt, model_type, engine, ok, reason)


# transformers' quantized checkpoints that need a package of their own to load
_QUANT_PACKAGES = {"gptq": "gptqmodel", "awq": "awq", "bitsandbytes": "bitsandbytes",
                   "compressed-tensors": "compressed_tensors", "hqq": "hqq", "quanto": "optimum.quanto",
                   "aqlm": "aqlm", "eetq": "eetq", "torchao": "torchao"}  # fmt: skip


def _torch_reads_quant(config: dict[str, Any]) -> tuple[bool, str | None]:
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    package = _QUANT_PACKAGES.get(str(method))
    if package is None or importlib.util.find_spec(package.split(".")[0]) is not None:
        return True, None
    return False, f"{method}-quantized weights need the {package} package (not installed)"


def _torch_knows(model_type: str | None) -> tuple[bool, str | None]:
    if importlib.util.find_spec("transformers") is None:
        return False, 'the torch engine needs transformers: pip install "promptcache[torch]"'
    import transformers
    from transformers.models.auto import modeling_auto as auto

    known = {
        **auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    }
    if model_type in known:
        return True, None
    return False, (
        f"model_type {model_type!r} is not a text-generation model in transformers "
        f"{transformers.__version__}"
    )


def _mlx_knows(model_type: str | None) -> tuple[bool, str | None]:
    import mlx_lm
    from mlx_lm.utils import MODEL_REMAPPING

    name = MODEL_REMAPPING.get(model_type or "", model_type or "")
    if name and importlib.util.find_spec(f"mlx_lm.models.{name}") is not None:
        return True, None
    return False, f"model_type {model_type!r} is not in mlx-lm {mlx_lm.__version__}"


def _torch_knows_gguf(arch: str | None) -> tuple[bool, str | None]:
    if importlib.util.find_spec("transformers") is None:
        return False, 'GGUF conversion needs transformers: pip install "promptcache[torch]"'
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if arch in GGUF_SUPPORTED_ARCHITECTURES:
        return True, None
    return False, f"transformers {transformers.__version__} cannot read {arch!r} GGUF files"


def gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` from a GGUF file's header."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except Exception:  # noqa: BLE001 (any unreadable file: listed as unknown, not a crash)
        return None


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n:.1f} TB"


def run_models_command(args: argparse.Namespace) -> int:
    rows = find_local_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no models found (HF cache {hub_cache_dir()}, LM Studio {lmstudio_dirs() or '-'})")
        return 0
    table = [("MODEL (--model)", "SOURCE", "FORMAT", "TYPE", "ENGINE", "SIZE", "SERVES")]
    for r in rows:
        model = r["model"] or "(default, no --model)"
        if r["revision"]:
            model += f" --revision {r['revision']}"
        serves = "yes" if r["can_serve"] else f"no: {r['reason']}"
        table.append((model, r["source"], r["fmt"], r["model_type"] or "?", r["engine"],
                      human_bytes(r["size_bytes"]), serves))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0
