"""Images and the caches: TTFT per turn of a 4-turn conversation with two images on a small
random-weight LLaVA built offline, with the prompt cache on, off, and on without the
vision-embedding cache.

The conversation: (1) a question about image A; (2) image B added; (3) a follow-up without an
image; (4) the client edits the first instruction and sends the whole history again (both images):
the prompt cache misses from the edit, the embedding cache still skips both encoder runs.

Run: PYTHONPATH=. .venv/bin/python benchmarks/vlm_bench.py [--size small] [--reps 3] [--threads N]
     [--json out.json]
Medians over ``--reps`` fresh engines (caches empty at each repetition's first turn); one model;
the three modes run turn by turn, interleaved, so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from promptcache.core.images import ImageInput, image_from_pixels
from promptcache.engines.base import Finished, PrefillDone, SamplingParams
from promptcache.engines.torch.engine import TorchEngine
from promptcache.testing.tiny_vlm import SIZES, tiny_llava

MODES = {
    "cache on": {},
    "cache off": {"cache_enabled": False},
    "embedding cache off": {"vision_cache_bytes": 0},
}
REPLY_TOKENS = 8


def picture(seed: int, h: int, w: int) -> ImageInput:
    rng = np.random.default_rng(seed)
    return image_from_pixels(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def turns(a: ImageInput, b: ImageInput) -> list[tuple[list[dict[str, Any]], list[ImageInput]]]:
    """Each turn's new messages and the images they add; turn 4 replaces the first instruction."""

    def user(text: str, image: bool) -> dict[str, Any]:
        parts = [{"type": "text", "text": text}] + ([{"type": "image"}] if image else [])
        return {"role": "user", "content": parts}

    return [
        ([user("Here is the first photo. What does it show? ", True)], [a]),
        ([user("And this second photo: how does it differ from the first? ", True)], [b]),
        ([user("Which of the two would suit a travel brochure better, and why?", False)], []),
        ([], []),  # the edit: built in run_conversation
    ]


def run_conversation(
    engine: TorchEngine, a: ImageInput, b: ImageInput
) -> Iterator[tuple[float, int, int]]:
    """Yields each turn's (TTFT, prompt tokens, cached tokens): a generator, so modes can be
    interleaved turn by turn."""
    system = {"role": "system", "content": "You are a careful photo critic. Answer briefly."}
    messages: list[dict[str, Any]] = [system]
    images: list[ImageInput] = []
    for i, (new, added) in enumerate(turns(a, b)):
        if i == 3:  # the client edits its first instruction and resends everything
            messages = [{**system, "content": "You are a photo critic. Answer in one line."},
                        *messages[1:-1]]  # fmt: skip
        else:
            messages = [*messages, *new]
            images = [*images, *added]
        ids, spans = engine.encode_chat_images(messages, None, images)
        first: PrefillDone | None = None
        text = ""
        for ev in engine.generate(ids, SamplingParams(max_tokens=REPLY_TOKENS), images=spans):
            if isinstance(ev, PrefillDone):
                first = ev
            elif isinstance(ev, Finished):
                text = ev.text
        assert first is not None
        yield first.ttft_s, first.prompt_tokens, first.cached_tokens
        messages = [*messages, {"role": "assistant", "content": text}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="small", choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:  # one thread suffers least from a CPU shared with other jobs
        import torch

        torch.set_num_threads(args.threads)

    model, processor = tiny_llava(args.size, seed=0)
    model = model.to(args.device)
    a, b = picture(1, 480, 640), picture(2, 600, 400)
    t0 = time.perf_counter()
    engine = TorchEngine(model, processor.tokenizer, processor, cache_enabled=False)
    engine.vision.encode(a)  # warm-up, and the encoder's cost alone
    encoder_s = min(_timed(lambda: engine.vision.encode(a)) for _ in range(3))
    results: dict[str, list[list[float]]] = {m: [] for m in MODES}
    encoder_runs: dict[str, int] = {}
    tokens: dict[str, list[tuple[int, int]]] = {m: [(0, 0)] * 4 for m in MODES}
    names = list(MODES)
    for rep in range(args.reps):
        engines = {m: TorchEngine(model, processor.tokenizer, processor, block_size=64,
                                  ram_budget="2GB", **MODES[m]) for m in names}  # fmt: skip
        convs = {m: run_conversation(engines[m], a, b) for m in names}
        runs: dict[str, list[float]] = {m: [] for m in names}
        for turn in range(4):  # modes interleaved per turn (rotated per rep): noise hits alike
            for m in names[rep % 3 :] + names[: rep % 3]:
                ttft_s, prompt_tokens, cached_tokens = next(convs[m])
                runs[m].append(ttft_s)
                tokens[m][turn] = (prompt_tokens, cached_tokens)
        for m in names:
            results[m].append(runs[m])
            feeder = engines[m].feeder
            encoder_runs[m] = feeder.num_encoder_runs if feeder else 0
            engines[m].close()
    medians = {m: [statistics.median(r[t] for r in runs) for t in range(4)]
               for m, runs in results.items()}  # fmt: skip
    # the least of the runs too: on a shared machine noise only ever adds time
    mins = {m: [min(r[t] for r in runs) for t in range(4)] for m, runs in results.items()}
    ids, spans = engine.encode_chat_images(
        [{"role": "user", "content": [{"type": "image"}]}], None, [a]
    )
    print(f"LLaVA {args.size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{spans[0].length} tokens per image, encoder {encoder_s * 1e3:.0f} ms per image, "
          f"{args.reps} reps on {args.device} ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    for label, table in (("median", medians), ("min", mins)):
        print(f"TTFT {label}:")
        print(f"{'turn':<6}{'prompt/cached':>16}" + "".join(f"{m:>22}" for m in MODES))
        for t in range(4):
            prompt, cached = tokens["cache on"][t]
            cells = "".join(f"{table[m][t] * 1e3:>19.0f} ms" for m in MODES)
            print(f"{t + 1:<6}{f'{prompt}/{cached}':>16}{cells}")
    print("encoder runs in the last rep: " + ", ".join(f"{m} {n}" for m, n in encoder_runs.items()))
    off = medians["cache off"]
    for m in ("cache on", "embedding cache off"):
        ratios = ", ".join(f"{off[t] / medians[m][t]:.1f}x" for t in range(4))
        print(f"speed-up vs cache off ({m}): {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "device": args.device, "reps": args.reps,
                       "tokens_per_image": spans[0].length, "encoder_s": encoder_s,
                       "ttft_s_median": medians, "ttft_s_min": mins, "ttft_s_runs": results,
                       "prompt_cached_tokens": tokens,
                       "encoder_runs_last_rep": encoder_runs}, f, indent=2)  # fmt: skip


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
