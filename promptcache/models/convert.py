"""GGUF -> safetensors folder, once per machine, safe when several processes start together.

Invariant: ``out`` exists only complete. A converter works in its own temp folder
(``.NAME.tmp-PID-RANDOM`` beside ``out``) while holding an exclusive ``flock`` on ``.NAME.lock``,
then renames the folder into place; a second process blocks on the lock and, once it gets it,
finds ``out`` complete and reuses it. Temp folders left by a killed converter are removed by the
next lock holder (nobody else can be writing them).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("promptcache")

COMPLETE_MARK = ".complete"


def is_converted(out: Path) -> bool:
    return (out / COMPLETE_MARK).exists()


@contextmanager
def conversion_lock(out: Path) -> Iterator[None]:
    """An exclusive lock on converting into ``out``; waits (and says so) while another process
    holds it. The lock is the kernel's: it goes when its holder exits, however it exits."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a+b") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"promptcache: another process is converting {out.name}; waiting for it",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF into ``out`` (float32 safetensors + config + tokenizer); no-op if done."""
    if is_converted(out):
        return out
    with conversion_lock(out):
        if is_converted(out):  # another process finished it while we waited
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _write_conversion(gguf, tmp)
            shutil.rmtree(out, ignore_errors=True)  # an incomplete folder from an older version
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s into %s", gguf.name, out)
    return out


def _write_conversion(gguf: Path, tmp: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        (tmp / COMPLETE_MARK).write_text(gguf.name)  # last: the folder is whole
        bar.update()
