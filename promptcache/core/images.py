"""Images in a prompt, engine-neutral: decoded pixels, their digest, and where their tokens sit.

An image is keyed by what it looks like, not how it was sent: the digest covers the width, the
height and the RGB bytes after decoding, so the same pixels as PNG and as lossless WebP key
alike, and any changed pixel keys differently. The digest goes into the extra keys of every
block the image's tokens span (``image_extras``), so chained hashes differ from the image's
first block on, and every block describes on its own which image it holds (a block verified
alone, a partial block, a file on disk can never be taken for another image's).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from promptcache.core.hashing import digest_bytes

IMAGE_KEY_TAG = b"img1"  # versions the extra-key layout below
DEFAULT_MAX_PIXELS = 4096 * 4096  # decoded width x height (48 MiB of RGB); checked before decoding


class ImageError(ValueError):
    """An image that cannot be used: undecodable, too large, an unsupported format."""


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    """One decoded image: ``pixels`` is uint8 RGB, shape (height, width, 3), read-only.
    ``digest`` (16 bytes) identifies the pixels: equal images have equal digests."""

    pixels: np.ndarray
    digest: bytes

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def hex(self) -> str:
        return self.digest.hex()

    def to_pil(self) -> Any:
        """The pixels as a PIL RGB image (what HF and mlx-vlm processors take)."""
        from PIL import Image

        return Image.fromarray(self.pixels, mode="RGB")


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    """Where one image's placeholder tokens sit in a prompt: positions [start, start + length).
    Spans of a prompt are in order and never overlap."""

    start: int
    length: int
    image: ImageInput

    @property
    def end(self) -> int:
        return self.start + self.length


def pixel_digest(rgb: np.ndarray) -> bytes:
    """The digest of uint8 RGB pixels (height, width, 3): xxh3-128 over width, height, bytes."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ImageError(f"pixels must be uint8 (height, width, 3), not {rgb.dtype} {rgb.shape}")
    h, w = rgb.shape[:2]
    head = w.to_bytes(4, "little") + h.to_bytes(4, "little")
    return digest_bytes(head + np.ascontiguousarray(rgb).tobytes())


def image_from_pixels(rgb: np.ndarray) -> ImageInput:
    pixels = np.ascontiguousarray(rgb, dtype=np.uint8)
    pixels.setflags(write=False)
    return ImageInput(pixels, pixel_digest(pixels))


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInput:
    """Decode PNG / JPEG / WebP / GIF (first frame) bytes to RGB. Transparency is composited on
    white (so an RGBA and an RGB file of the same visible picture key alike); EXIF rotation is
    not applied (clients send pixels as they mean them). Raises ImageError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            w, h = img.size
            if w <= 0 or h <= 0:
                raise ImageError("the image is empty (0 pixels)")
            if w * h > max_pixels:
                raise ImageError(f"the image has {w}x{h} pixels; at most {max_pixels} are allowed")
            img.seek(0)
            img.load()
            rgb = _to_rgb(img)
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"cannot decode the image: {exc}") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"the image is too large: {exc}") from None
    return image_from_pixels(np.asarray(rgb, dtype=np.uint8))


def _to_rgb(img: Any) -> Any:
    from PIL import Image

    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def image_key(span: ImageSpan, block_start: int) -> bytes:
    """One image's extra key in the block starting at ``block_start``: a tag, the offset of the
    image's first token relative to the block (negative when it began in an earlier block) and
    the digest. The offset makes two images at different places in a block key differently."""
    offset = span.start - block_start
    return IMAGE_KEY_TAG + offset.to_bytes(4, "little", signed=True) + span.image.digest


def image_extras(spans: Iterable[ImageSpan], block_size: int) -> dict[int, bytes]:
    """``TokenSeq`` extras for ``spans``: one key per image in every block its tokens span,
    filed at the first position of the image inside that block."""
    out: dict[int, bytes] = {}
    for span in spans:
        if span.length <= 0:
            continue
        first, last = span.start // block_size, (span.end - 1) // block_size
        for block in range(first, last + 1):
            block_start = block * block_size
            pos = max(span.start, block_start)
            out[pos] = out.get(pos, b"") + image_key(span, block_start)
    return out


def first_image_difference(
    spans: Iterable[tuple[int, bytes]], other: Iterable[tuple[int, bytes]], upto: int
) -> int | None:
    """The first token position < ``upto`` where two prompts' images differ ((start, digest)
    pairs; an image in one and not at the same start in the other differs), or None."""
    mine, theirs = dict(spans), dict(other)
    starts = sorted(s for s in set(mine) | set(theirs) if s < upto)
    for s in starts:
        if mine.get(s) != theirs.get(s):
            return s
    return None
