"""The architecture conformance table: every tiny family on every engine that has it, 4 chat
turns and an edited one, cached vs uncached (cached/prompt tokens per turn, equal x/4, the
edited turn). Same checks as tests/test_architectures.py, printed as a markdown table.

    python benchmarks/conformance_table.py [--engines torch,mlx] [--families llama,qwen3_5-vl]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import tempfile
from pathlib import Path

from promptcache.testing.conformance import format_row, run_conversation
from promptcache.testing.tiny_families import FAMILY_NAMES, save_family, save_mlx_family

# transformers 5 writes these families' experts in a layout mlx-lm 0.32.2 does not read
MLX_CONVERTED = ("gpt_oss", "qwen3_5_moe", "qwen3_5_moe-vl")


def engine_class(engine: str):
    if engine == "torch":
        from promptcache.engines.torch.engine import TorchEngine

        return TorchEngine
    from promptcache.engines.mlx.engine import MlxEngine

    return MlxEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="torch,mlx")
    parser.add_argument("--families", default=",".join(FAMILY_NAMES))
    args = parser.parse_args()
    logging.getLogger("promptcache").setLevel(logging.ERROR)
    engines = [
        e for e in args.engines.split(",") if e != "mlx" or importlib.util.find_spec("mlx_lm")
    ]
    rows = ["| engine family (layer kinds) | cached/prompt per turn | equal | edited turn | |",
            "|---|---|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            cls = engine_class(engine)
            for name in args.families.split(","):
                layout = "mlx" if engine == "mlx" and name in MLX_CONVERTED else "hf"
                save = save_mlx_family if layout == "mlx" else save_family
                folder = save(name, Path(tmp) / f"{engine}-{name}")
                model, tokenizer = cls.load_weights(folder)
                cached = cls(model, tokenizer, block_size=8, prefill_chunk=16, ram_budget=10**8)
                plain = cls(model, tokenizer, block_size=8, prefill_chunk=16, cache_enabled=False)
                turns = run_conversation(cached, plain, tokenizer)
                kinds = ",".join(sorted(set(cached.layout.kinds)))
                label = f"{engine} {name}{' (mlx layout)' * (layout == 'mlx')} ({kinds})"
                rows.append(format_row(label, turns))
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
