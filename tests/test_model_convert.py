"""GGUF conversion when several servers start at once: one converts (in its own temp folder,
under a file lock, renamed into place), the others wait and reuse the finished folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
CONVERT = (
    "import sys; from pathlib import Path\n"
    "from promptcache.models.convert import convert_gguf\n"
    "print(convert_gguf(Path(sys.argv[1]), Path(sys.argv[2])))\n"
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-F32.gguf")


def test_two_processes_convert_at_once(tiny_gguf, tmp_path):
    from promptcache.models.convert import conversion_lock

    out = tmp_path / "models" / "tiny"
    stale = out.parent / f".{out.name}.tmp-999999-dead"  # left by a converter that was killed
    (stale / "half").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    # hold the lock so both processes are inside convert_gguf, waiting, when it is released
    with conversion_lock(out):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONVERT, str(tiny_gguf), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=open(log, "wb"),  # noqa: SIM115 (the child owns it)
                text=True,
            )  # fmt: skip
            for log in logs
        ]
        deadline = time.time() + 120
        while not all("waiting for it" in log.read_text() for log in logs):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log.read_text() for log in logs]
    assert outputs == [str(out), str(out)]
    converters = [log for log in logs if "converting tiny-F32.gguf" in log.read_text()]
    assert len(converters) == 1  # the second reused the first one's folder
    names = {p.name for p in out.iterdir()}
    assert {".complete", "config.json", "model.safetensors", "tokenizer.json"} <= names
    assert [p.name for p in out.parent.iterdir() if ".tmp-" in p.name] == []  # stale one too

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 2


def test_a_finished_conversion_is_reused_without_the_lock(tiny_gguf, tmp_path):
    from promptcache.models.convert import conversion_lock, convert_gguf

    out = convert_gguf(tiny_gguf, tmp_path / "tiny")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    with conversion_lock(out):  # held: a second call must not need it
        assert convert_gguf(tiny_gguf, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
