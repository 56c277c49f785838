import os

import pytest

from promptcache.server.launcher import ServerProcess, free_port  # noqa: F401 (tests import them here)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on two cores: a worker's own forwards on one thread each (two pools of two
    # stall at every op's barrier); the servers it starts pick theirs from the load
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass

try:  # the tiny models' KV buffers are far below the pool's threshold: pool them all here, so
    # every engine test also checks the pooled buffers (engines/torch/buffers.py)
    from promptcache.engines.torch.buffers import POOL

    POOL.min_bytes = 1
except ImportError:
    pass


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    from promptcache.testing.tiny_models import save_tiny_model

    return save_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def server_factory(tmp_path):
    started: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(
            list(args),
            env={"PROMPTCACHE_HOME": str(tmp_path / "home"), **(env or {})},
            log=tmp_path / "server.log",
        )
        started.append(srv.start())
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory) -> str:
    """A tiny llama with the bundled model's real tokenizer (real token counts, ChatML) and room
    for an agent CLI's long prompts: the model behind ``serve --scripted-replies``."""
    pytest.importorskip("torch")
    from promptcache.testing.tiny_models import bundled_tokenizer, save_tiny_model

    folder = str(tmp_path_factory.mktemp("scripted-llama"))
    return save_tiny_model("llama", folder, tokenizer=bundled_tokenizer(), max_context=65536)
