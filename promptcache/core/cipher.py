"""Encryption at rest: AES-256-GCM for block files and the token ids in the SSD index.

One small module so every tier seals its values the same way (a shared tier would use it for
its values too). The key comes from a file the operator owns (``--encrypt-key-file``); we never
write it anywhere. Subkeys are derived per purpose (HMAC-SHA256 of the key and a label), so the
key that encrypts is never the one that tags: ``token_tag``/``name_tag`` are keyed digests that
let the index look rows up (children by first token, a session's tags) without holding the
plaintext. A wrong key fails every GCM tag check: nothing decrypts, nothing is served.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
NONCE_BYTES = 12
MAGIC = b"PCENC1\0"  # an encrypted block file starts with this, then nonce + ciphertext + tag


class CipherError(ValueError):
    """Cannot decrypt: a wrong key, or the ciphertext (or what it is bound to) was changed."""


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, b"promptcache/v1 " + label, hashlib.sha256).digest()


class BlockCipher:
    """AES-256-GCM with a random 96-bit nonce per value; ``aad`` binds a value to where it
    belongs (a block's hash), so a ciphertext moved under another name does not decrypt."""

    __slots__ = ("_aead", "_tag_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"an encryption key has {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(_derive(key, b"encrypt"))
        self._tag_key = _derive(key, b"tag")
        # names the key in the index (a wrong key is noticed at open) and reveals nothing of it
        self.key_id = _derive(key, b"key id")[:16].hex()

    def seal(self, data: bytes, aad: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, aad)

    def open(self, data: bytes | memoryview, aad: bytes) -> bytes:
        if len(data) < NONCE_BYTES + 16:
            raise CipherError("ciphertext too short")
        view = memoryview(data)
        nonce = bytes(view[:NONCE_BYTES])
        try:  # a view of the ciphertext: no copy of a block's megabytes before decrypting
            return self._aead.decrypt(nonce, view[NONCE_BYTES:], aad)
        except InvalidTag:
            raise CipherError("cannot decrypt: wrong key or altered data") from None

    def token_tag(self, token: int) -> int:
        """A keyed 62-bit digest of a token id (an SQLite integer), for lookups by first token."""
        mac = hmac.new(self._tag_key, token.to_bytes(8, "little"), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "little") >> 2

    def name_tag(self, name: str) -> str:
        """A keyed digest of a name (a session id) that the index stores instead of it."""
        return hmac.new(self._tag_key, name.encode(), hashlib.sha256).hexdigest()[:32]


def load_key_file(path: str | Path) -> bytes:
    """The key in ``path``: 32 raw bytes, or 64 hex digits, or base64 of 32 bytes (surrounding
    whitespace ignored). Raises ValueError naming what is wrong, never the key."""
    raw = Path(path).read_bytes()
    if len(raw) == KEY_BYTES:
        return raw
    text = raw.strip()
    for decode in (binascii.unhexlify, base64.b64decode):
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) == KEY_BYTES:
            return key
    raise ValueError(
        f"{path}: not an encryption key (32 raw bytes, 64 hex digits or base64 of 32 bytes)"
    )


def make_cipher(key_file: str | Path | None) -> BlockCipher | None:
    return BlockCipher(load_key_file(key_file)) if key_file else None
