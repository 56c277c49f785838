"""Images for transformers families whose image tokens are plain causal positions but whose
expansion is more than one token repeated (``VisionModel`` on torch): Mistral 3 and Pixtral 12B
(a LLaVA) rows with break and end tokens, LLaVA-NeXT / OneVision anyres tiles (the count depends
on the size), Idefics3 / SmolVLM tile markers, Aya Vision, InternVL, and VipLLaVA / DeepSeek-VL
(one token repeated, a count only their processor knows).

The processor is the family's own: its ``replace_image_token`` (the transformers 5 hook every
processor implements) gives an image's text, its image processor the pixels, and
``get_image_features`` the rows, scattered at the model's ``image_token_id`` positions as the
model itself does. An image's span runs from its first image token to its last; the marker
tokens inside it (row breaks, tile names) are part of the image's rows (their text embeddings),
so the rows are a function of the image alone and a span can be cut anywhere.
"""

from __future__ import annotations

import inspect
import json
import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from promptcache.core.hashing import digest_bytes
from promptcache.core.images import ImageInput, ImageSpan
from promptcache.engines.torch.vision import spliced_forward
from promptcache.errors import ConfigError, RequestError
from promptcache.serving.vision import VisionChunk, chat_text

EXPANDED = ("mistral3", "pixtral", "llava_next", "llava_onevision", "idefics3", "smolvlm",
            "aya_vision", "internvl", "vipllava", "deepseek_vl")  # fmt: skip
# ("pixtral": a llava checkpoint with a Pixtral tower, as ``layout_kind`` names it)
# family -> its template's placeholder, where its layout is ours when the processor cannot load
# (PixtralProcessor and InternVL's and OneVision's video processors need torchvision)
OWN_LAYOUT = {"mistral3": "[IMG]", "pixtral": "[IMG]", "internvl": "<IMG_CONTEXT>",
              "llava_onevision": "<image>"}  # fmt: skip
MAX_LAYOUTS = 4096  # images whose expansion is remembered (render needs it on every turn)
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
             "text_replacement_offsets")  # fmt: skip


class ExpandedVision:
    """``VisionModel`` through the family's processor (a ``ProcessorMixin`` with a tokenizer)."""

    whole_images = False

    def __init__(
        self, model: Any, processor: Any, tokenizer: Any, device: Any, dtype: Any, cache_arg: str
    ) -> None:
        self.kind = kind = layout_kind(model.config)
        self.is_full = getattr(processor, "tokenizer", None) is not None
        if not self.is_full and kind not in OWN_LAYOUT:
            raise ConfigError(f"images for {kind} need its processor, which did not load")
        self.model, self.processor = model, processor
        self.device, self.dtype, self.cache_arg = device, dtype, cache_arg
        self.images = getattr(processor, "image_processor", processor)
        self.tokenizer = processor.tokenizer if self.is_full else tokenizer
        self.template = getattr(processor, "chat_template", None) or self.tokenizer.chat_template
        # what the template emits for an image part
        self.placeholder = processor.image_token if self.is_full else OWN_LAYOUT[kind]
        self.image_token_id = int(model.config.image_token_id)  # where the model scatters rows
        self.hidden = int(model.config.get_text_config().hidden_size)
        # on the outer model, or (DeepSeek-VL) only on its inner one
        self.features = getattr(model, "get_image_features", None) or model.model.get_image_features
        params = inspect.signature(self.features).parameters
        self.pixel_args = {n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD}
        self._layouts: dict[bytes, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()
        # the layout's own settings too (tile size, tokens per tile: the markers in the rows)
        layout = {k: v for k, v in vars(processor).items()
                  if isinstance(v, int | float | str) and k != "chat_template"}  # fmt: skip
        settings = {"image_processor": self.images.to_dict(), "layout": layout,
                    "kind": type(self).__name__, "placeholder": self.placeholder}  # fmt: skip
        raw = json.dumps(settings, sort_keys=True, default=str).encode()
        self.settings_key = digest_bytes(raw).hex()

    def _expand(self, image: ImageInput) -> tuple[str, list[int], Any]:
        """The processor on one placeholder: the image's text, its span's ids, the pixels."""
        try:
            if self.is_full:
                out = self.processor(
                    text=[self.placeholder], images=[image.to_pil()], return_tensors="pt",
                    add_special_tokens=False, return_text_replacement_offsets=True,
                )  # fmt: skip
            else:
                build = LAYOUTS[self.kind]
                out = build(self.model, self.images, self.tokenizer, image)
        except Exception as exc:  # the client's image (a size or shape the processor refuses)
            raise RequestError(f"the image processor refused an image: {exc}") from exc
        ids = [int(t) for t in out["input_ids"][0]]
        marks = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if not marks:
            raise RequestError("the processor's image text holds no image token")
        offsets = out.get("text_replacement_offsets")
        text = offsets[0][0]["replacement"] if offsets else self.tokenizer.decode(ids)
        layout = (text, ids[marks[0] : marks[-1] + 1])
        with self._lock:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[image.digest] = layout
        return text, layout[1], out

    def layout(self, image: ImageInput) -> tuple[str, list[int]]:
        """(the image's text in the prompt, the ids of its span)."""
        with self._lock:
            found = self._layouts.get(image.digest)
        return found if found is not None else self._expand(image)[:2]

    def num_tokens(self, image: ImageInput) -> int:
        return len(self.layout(image)[1])

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: Sequence[ImageInput],
    ) -> tuple[list[int], list[ImageSpan]]:
        text = chat_text(self.tokenizer, self.template, messages, tools)
        pieces = text.split(self.placeholder)
        if len(pieces) != len(images) + 1:
            raise RequestError(
                f"the prompt holds {len(pieces) - 1} image placeholders for {len(images)} images "
                "(the text may not contain the model's image token)"
            )
        layouts = [self.layout(image) for image in images]
        # the processor's own order: the k-th placeholder becomes the k-th image's text
        full = pieces[0] + "".join(t + p for (t, _), p in zip(layouts, pieces[1:], strict=True))
        ids = list(self.tokenizer.encode(full, add_special_tokens=False))
        spans: list[ImageSpan] = []
        at = 0
        for image, (_, want) in zip(images, layouts, strict=True):
            at = _find(ids, want, at)
            if at < 0:
                raise RequestError("the prompt's image tokens do not match its images")
            spans.append(ImageSpan(at, len(want), image))
            at += len(want)
        total = sum(w.count(self.image_token_id) for _, w in layouts)
        if ids.count(self.image_token_id) != total:
            raise RequestError("the prompt holds image tokens outside its images")
        return ids, spans

    @torch.inference_mode()
    def encode(self, image: ImageInput) -> torch.Tensor:
        _, span_ids, out = self._expand(image)
        pixels = {k: v for k, v in out.items() if k not in TEXT_KEYS and k in self.pixel_args}
        for k, v in pixels.items():
            if torch.is_tensor(v):
                pixels[k] = v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
        got = self.features(**pixels, return_dict=True)
        feats = got.pooler_output if hasattr(got, "pooler_output") else got
        parts = feats if isinstance(feats, list | tuple) else [feats]
        feats = torch.cat([p.reshape(-1, self.hidden) for p in parts])
        x = torch.tensor(span_ids, dtype=torch.long, device=self.device)
        rows = self.model.get_input_embeddings()(x[None])[0]  # the markers inside the image
        mask = x == self.image_token_id
        if int(mask.sum()) != feats.shape[0]:
            raise RequestError(
                f"the encoder gave {feats.shape[0]} rows for {int(mask.sum())} image tokens"
            )
        rows[mask] = feats.to(rows.dtype)
        return rows.to(self.dtype).contiguous().clone()

    def forward(self, state: Any, chunk: VisionChunk) -> torch.Tensor:
        return spliced_forward(self.model, self.cache_arg, self.device, state, chunk)


def is_expanded(config: Any) -> bool:
    """Whether ``config``'s images go through ``ExpandedVision``: an ``EXPANDED`` family, or a
    LLaVA checkpoint with a Pixtral tower (Pixtral 12B: its processor's row-break layout)."""
    return layout_kind(config) in EXPANDED


def layout_kind(config: Any) -> str:
    tower = getattr(getattr(config, "vision_config", None), "model_type", "")
    return "pixtral" if config.model_type == "llava" and tower == "pixtral" else config.model_type


def pixtral_layout(model: Any, images: Any, tokenizer: Any, image: ImageInput) -> dict[str, Any]:
    """Mistral 3 without its ``PixtralProcessor`` (which needs torchvision): the image processor
    resizes to whole merged patches, then rows of ``[IMG]`` each end in ``[IMG_BREAK]``, the last
    in ``[IMG_END]`` (the processor's layout), as the processor's output dict."""
    cfg = model.config
    patch = int(cfg.vision_config.patch_size) * int(getattr(cfg, "spatial_merge_size", 1))
    out = dict(images(images=[image.to_pil()], return_tensors="pt",
                      patch_size={"height": patch, "width": patch}))  # fmt: skip
    height, width = (int(x) for x in out["image_sizes"][0])
    row = "[IMG]" * (width // patch) + "[IMG_BREAK]"
    text = (row * (height // patch))[: -len("[IMG_BREAK]")] + "[IMG_END]"
    return _with_text(out, tokenizer, text)


def internvl_layout(model: Any, images: Any, tokenizer: Any, image: ImageInput) -> dict[str, Any]:
    """InternVL without its processor: the image cut into tiles (its processor's default), each
    tile ``(side / patch)^2 * downsample_ratio^2`` ``<IMG_CONTEXT>`` tokens, inside ``<img>``."""
    cfg = model.config
    side, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
    side, patch = (side[0], patch[0]) if isinstance(side, list | tuple) else (side, patch)
    per_tile = int((int(side) // int(patch)) ** 2 * float(cfg.downsample_ratio) ** 2)
    out = dict(images(images=[image.to_pil()], return_tensors="pt", crop_to_patches=True))
    tiles = int(out.pop("num_patches")[0])
    return _with_text(out, tokenizer, "<img>" + "<IMG_CONTEXT>" * (per_tile * tiles) + "</img>")


def onevision_layout(model: Any, images: Any, tokenizer: Any, image: ImageInput) -> dict[str, Any]:
    """LLaVA-OneVision without its processor: the base tile's tokens, then the anyres grid cut
    back to the image's aspect with a newline per row, shrunk to ``anyres_max_N`` tiles' worth
    (the processor's count; the model checks it against its features)."""
    from transformers.image_processing_utils import select_best_resolution

    cfg = model.config
    out = dict(images(images=[image.to_pil()], return_tensors="pt"))
    height, width = (int(x) for x in out["image_sizes"][0])
    tile_h, tile_w = (int(x) for x in out["pixel_values"].shape[-2:])
    best_h, best_w = select_best_resolution([height, width], cfg.image_grid_pinpoints)
    side = int(cfg.vision_config.image_size) // int(cfg.vision_config.patch_size)
    rows, cols = side * (best_h // tile_h), side * (best_w // tile_w)
    if width / height > cols / rows:  # padding above and below, then left and right
        rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
    cap = int(str(cfg.vision_aspect_ratio).removeprefix("anyres_max_"))
    ratio = math.sqrt(rows * cols / (cap * side * side))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    count = side * side + rows * cols + rows - (cfg.vision_feature_select_strategy == "default")
    return _with_text(out, tokenizer, "<image>" * count)


LAYOUTS = {"mistral3": pixtral_layout, "pixtral": pixtral_layout, "internvl": internvl_layout,
           "llava_onevision": onevision_layout}  # fmt: skip


def _with_text(out: dict[str, Any], tokenizer: Any, text: str) -> dict[str, Any]:
    """``out`` as the processor returns it for one placeholder expanded to ``text``."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out["input_ids"] = torch.tensor([ids])
    out["text_replacement_offsets"] = [[{"replacement": text}]]
    return out


def _find(ids: list[int], want: list[int], start: int) -> int:
    """The first index >= ``start`` where ``want`` occurs in ``ids``, or -1."""
    first, n = want[0], len(want)
    i = start
    while True:
        try:
            i = ids.index(first, i)
        except ValueError:
            return -1
        if ids[i : i + n] == want:
            return i
        i += 1
