"""Image content parts at the HTTP edge: OpenAI ``image_url`` parts and Anthropic ``image`` blocks
to decoded ``ImageInput``s, or a clear 400.

Accepted: base64 data (``data:image/png;base64,...`` URLs, Anthropic ``source.type: base64``).
Remote ``http(s)`` URLs are fetched only when the server allows it (``--allow-image-urls``):
otherwise a fetch would let any client make the server reach arbitrary hosts. Limits: the
encoded size (``max_image_bytes``) and the decoded pixel count (``max_image_pixels``).
"""

from __future__ import annotations

import base64
import binascii
import urllib.request
from dataclasses import dataclass
from typing import Any

from promptcache.core.images import DEFAULT_MAX_PIXELS, ImageError, ImageInput, decode_image
from promptcache.engines.base import RequestError

MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """What image input this server takes. ``enabled`` is False for a text-only model."""

    enabled: bool = False
    allow_urls: bool = False
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = 32  # per request


TEXT_ONLY = ImagePolicy()


def image_part(image: ImageInput) -> dict[str, Any]:
    """A ``Chat`` content part holding a decoded image."""
    return {"type": "image", "image": image}


def openai_image(part: dict[str, Any], policy: ImagePolicy) -> ImageInput:
    """An OpenAI ``{"type": "image_url", "image_url": {"url": ...}}`` part."""
    _check_enabled(policy, "image_url")
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise RequestError("image_url: a part needs image_url.url (a data URL)")
    if url.startswith("data:"):
        head, sep, data = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise RequestError("image_url: a data URL must be data:image/...;base64,<data>")
        media = head[len("data:") : -len(";base64")]
        _check_media(media)
        return _decode(_b64(data, policy), policy)
    if url.startswith(("http://", "https://")):
        return _decode(_fetch(url, policy), policy)
    raise RequestError("image_url: the url must be a data URL (data:image/png;base64,...)")


def anthropic_image(block: dict[str, Any], policy: ImagePolicy) -> ImageInput:
    """An Anthropic ``{"type": "image", "source": {...}}`` block."""
    _check_enabled(policy, "image")
    source = block.get("source")
    if not isinstance(source, dict):
        raise RequestError("image: a block needs a source")
    kind = source.get("type")
    if kind == "base64":
        _check_media(str(source.get("media_type") or ""))
        data = source.get("data")
        if not isinstance(data, str):
            raise RequestError("image: source.data must be base64 text")
        return _decode(_b64(data, policy), policy)
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise RequestError("image: source.url must be an http(s) URL")
        return _decode(_fetch(url, policy), policy)
    raise RequestError(f"image: source.type must be base64 or url, not {kind!r}")


def check_count(images: list[ImageInput], policy: ImagePolicy) -> None:
    if len(images) > policy.max_images:
        raise RequestError(
            f"the request has {len(images)} images; this server takes at most {policy.max_images}"
        )


def _check_enabled(policy: ImagePolicy, kind: str) -> None:
    if not policy.enabled:
        raise RequestError(
            f"content of type {kind!r} is not supported: this server's model has no image "
            "input (text only; images need a vision-language model)"
        )


def _check_media(media: str) -> None:
    if media not in MEDIA_TYPES:
        raise RequestError(
            f"image media type {media!r} is not supported ({', '.join(MEDIA_TYPES)})"
        )


def _b64(data: str, policy: ImagePolicy) -> bytes:
    if len(data) * 3 // 4 > policy.max_image_bytes:
        raise RequestError(f"an image is over {policy.max_image_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("an image's base64 data does not decode") from None


def _decode(data: bytes, policy: ImagePolicy) -> ImageInput:
    if len(data) > policy.max_image_bytes:
        raise RequestError(f"an image is over {policy.max_image_bytes} bytes")
    try:
        return decode_image(data, policy.max_image_pixels)
    except ImageError as exc:
        raise RequestError(f"image: {exc}") from None


def _fetch(url: str, policy: ImagePolicy) -> bytes:
    if not policy.allow_urls:
        raise RequestError(
            "image URLs are not fetched by this server (start it with --allow-image-urls); "
            "send the image inline as base64 data"
        )
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:  # noqa: S310
            data = resp.read(policy.max_image_bytes + 1)
    except (OSError, ValueError) as exc:
        raise RequestError(f"cannot fetch the image at {url}: {exc}") from None
    if len(data) > policy.max_image_bytes:
        raise RequestError(f"the image at {url} is over {policy.max_image_bytes} bytes")
    return data
