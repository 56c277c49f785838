"""One block (and its checkpoint) as one safetensors file, with a checksum of metadata + tensors.

Writes are atomic: a temp file in the same folder, fsync, rename, fsync the folder; a reader
never sees a half-written file. Reads verify the header and the checksum before anything is used,
and ``verify_identity`` recomputes the chained hash from parent + tokens + extra keys, so a file
whose tokens were rewritten can never be indexed or served under another prompt.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

import numpy as np
import xxhash

from promptcache.core.block import META_COLUMNS, BlockMeta
from promptcache.core.cipher import MAGIC, BlockCipher, CipherError
from promptcache.core.codec import PayloadCodec
from promptcache.core.hashing import TOKEN_BYTES, hash_block
from promptcache.core.private_fs import make_private_dirs, open_private
from promptcache.core.safetensors_io import DTYPES, Part, encode_parts, write_parts
from promptcache.core.tiers.base import BlockRecord

FORMAT = "promptcache-block"
# "1": checksum over tensors only (metadata could be rewritten unnoticed): never served
FORMAT_VERSION = "2"
OLD_FORMAT_VERSIONS = ("1",)
TMP_PREFIX = ".tmp-"
SUFFIX = ".safetensors"


class CorruptBlockError(Exception):
    """A block file whose header, identity or checksum does not hold."""

    is_damage = True  # False for a block that is merely gone (evicted between lookup and read)


class EncryptedBlockError(CorruptBlockError):
    """An encrypted block file read without a key (``cache verify`` without the key): not
    damaged; a tier running with encryption never sees this (it has the key)."""

    is_damage = False


class OldFormatError(CorruptBlockError):
    """A block file of an older format version: not damaged, but never served."""


class BlockFileInfo(NamedTuple):
    """What a file's header says: the block's identity, the model, and this copy's state."""

    meta: BlockMeta
    model: str
    is_seq_end: bool
    has_checkpoint: bool
    payload_nbytes: int


# header values are strings: bytes fields as hex, ints in decimal (format 2)
_META_TYPES = get_type_hints(BlockMeta)


def meta_to_header(meta: BlockMeta) -> dict[str, str]:
    return {
        key: value.hex() if isinstance(value, bytes) else str(value)
        for key, value in zip(META_COLUMNS.values(), meta, strict=True)
    }


def meta_from_header(header: dict[str, str]) -> BlockMeta:
    """Raises KeyError or ValueError on a missing or malformed key."""
    values: list[Any] = []
    for name, key in META_COLUMNS.items():
        kind = _META_TYPES[name]
        values.append(kind(header[key]) if kind is int else kind(bytes.fromhex(header[key])))
    return BlockMeta(*values)


def checksum_block(meta: dict[str, str], arrays: dict[str, np.ndarray]) -> str:
    """Checksum of every metadata field but the checksum itself, then every tensor."""
    h = xxhash.xxh3_128()
    fields = {k: v for k, v in meta.items() if k != "checksum"}
    h.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    for name in sorted(arrays):
        arr = arrays[name]
        h.update(f"{name}:{arr.dtype.str}:{arr.shape}".encode())
        h.update((arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)).data)  # raw bytes
    return h.hexdigest()


def encode_block(record: BlockRecord, model: str, codec: PayloadCodec) -> bytes:
    """The block file's bytes (one buffer: a shared tier's value, a sealed file's plaintext)."""
    return b"".join(encode_block_parts(record, model, codec))


def encode_block_parts(record: BlockRecord, model: str, codec: PayloadCodec) -> list[Part]:
    """The block file as parts to write in order (``write_temp``): the header, then views of
    the payload's arrays, not copies of them."""
    arrays, structure = codec.to_arrays(record.payload, record.checkpoint)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model": model,
        **meta_to_header(record.meta),
        "seq_end": "1" if record.is_seq_end else "0",
        "has_checkpoint": "1" if record.checkpoint is not None else "0",
        "payload_nbytes": str(record.nbytes),
        "structure": structure,
    }
    meta["checksum"] = checksum_block(meta, arrays)
    return encode_parts(arrays, meta)


def seal_file(data: bytes, cipher: BlockCipher | None, name: str) -> bytes:
    """The file's bytes at rest: as they are, or (with a cipher) the whole safetensors file,
    header with its token ids included, encrypted and bound to the file's name."""
    if cipher is None:
        return data
    return MAGIC + cipher.seal(data, name.encode())


def unseal_file(data: Buffer, cipher: BlockCipher | None, name: str) -> Buffer:
    """The safetensors bytes of a file read from disk; raises CorruptBlockError when they
    cannot be had: a wrong key, an altered file, a plaintext file while encryption is on
    (never served: it may predate the key), or an encrypted one without a key."""
    view = data if isinstance(data, bytes) else memoryview(data).cast("B")  # type: ignore[arg-type]
    is_sealed = bytes(view[: len(MAGIC)]) == MAGIC
    if cipher is None:
        if is_sealed:
            raise EncryptedBlockError("encrypted block file: no key given")
        return data
    if not is_sealed:
        raise CorruptBlockError("unencrypted block file while encryption is on")
    try:
        # a bytearray: tensors are viewed writable, as from a plaintext read
        return bytearray(cipher.open(view[len(MAGIC) :], name.encode()))
    except CipherError as exc:
        raise CorruptBlockError(str(exc)) from None


def write_temp(path: Path, data: bytes | Sequence[Part]) -> Path:
    """``data`` (bytes, or parts written one after another) in a private (0600) temp file
    next to ``path``, fsynced; returns its path."""
    make_private_dirs(path.parent)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            write_parts(fd, [data] if isinstance(data, bytes) else data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def commit_temp(tmp: Path, path: Path) -> None:
    """Rename the temp file into place, then fsync the folder so the rename is durable."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync the folder. Raises OSError (disk full, read-only...)."""
    commit_temp(write_temp(path, data), path)


Buffer = bytes | bytearray | np.ndarray


def prefetch_files(paths: list[Path]) -> None:
    """Ask the kernel to start reading these files now (readahead for a batch of reads)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _split_header(data: Buffer) -> tuple[dict[str, Any], int]:
    if len(data) < 8:
        raise CorruptBlockError("file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8 or n > 100 * 2**20:
        raise CorruptBlockError("header length past the end of the file")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as exc:
        raise CorruptBlockError(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptBlockError("unreadable header")
    return header, 8 + n


def load_arrays(data: Buffer, header: dict[str, Any], start: int) -> dict[str, np.ndarray]:
    """Zero-copy numpy views of the tensors (writable when ``data`` is a bytearray)."""
    arrays = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = np.dtype(DTYPES[spec["dtype"]])
            shape = tuple(int(x) for x in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlockError(f"bad tensor entry {name!r}: {exc}") from None
        count = math.prod(shape)
        if not 0 <= begin <= end <= len(data) - start or end - begin != count * dtype.itemsize:
            raise CorruptBlockError(f"tensor {name!r} lies outside the file")
        arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=start + begin).reshape(
            shape
        )
    return arrays


def read_file(path: Path) -> np.ndarray:
    """The whole file, read into a fresh writable buffer that tensors then view without copying."""
    with open(path, "rb", buffering=0) as f:
        return read_open_file(f)


def read_open_file(f: io.FileIO) -> np.ndarray:
    """``read_file`` on an open file (np.empty, not bytearray: no user-space zero-fill of memory
    the read overwrites anyway)."""
    size = os.fstat(f.fileno()).st_size
    buf = np.empty(size, dtype=np.uint8)
    view = buf.data
    got = 0
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            raise CorruptBlockError("file shrank while being read")
        got += n
    return buf


def read_header(data: Buffer) -> dict[str, str]:
    return _metadata_of(_split_header(data)[0])


def _metadata_of(header: dict[str, Any]) -> dict[str, str]:
    try:
        meta = header["__metadata__"]
    except KeyError:
        raise CorruptBlockError("unreadable header: no metadata") from None
    if not isinstance(meta, dict):
        raise CorruptBlockError("unreadable header: metadata is not a map")
    if meta.get("format") != FORMAT:
        raise CorruptBlockError("not a promptcache block file")
    if meta.get("version") in OLD_FORMAT_VERSIONS:
        raise OldFormatError(f"old block format version {meta.get('version')}")
    if meta.get("version") != FORMAT_VERSION:
        raise CorruptBlockError(
            f"format version {meta.get('version')!r}, expected {FORMAT_VERSION}"
        )
    return meta


def parse_meta(meta: dict[str, str]) -> BlockFileInfo:
    try:
        return BlockFileInfo(
            meta_from_header(meta),
            meta["model"],
            meta["seq_end"] == "1",
            meta["has_checkpoint"] == "1",
            int(meta["payload_nbytes"]),
        )
    except (KeyError, ValueError) as exc:
        raise CorruptBlockError(f"bad metadata: {exc}") from None


def _load_checked(
    data: Buffer,
) -> tuple[dict[str, str], BlockFileInfo, dict[str, np.ndarray]]:
    header, start = _split_header(data)  # parsed once: the JSON is a good part of a block's cost
    meta = _metadata_of(header)
    info = parse_meta(meta)
    arrays = load_arrays(data, header, start)
    if checksum_block(meta, arrays) != meta.get("checksum"):
        raise CorruptBlockError("checksum mismatch")
    return meta, info, arrays


def verify_identity(info: BlockFileInfo, file_stem: str) -> None:
    """The block hash recomputed from parent hash + token ids + extra keys must equal the
    recorded one and the file's name; raises CorruptBlockError."""
    m = info.meta
    n = len(m.token_bytes)
    if n == 0 or n % TOKEN_BYTES or m.depth < 0:
        raise CorruptBlockError("bad token count or depth")
    if m.depth == 0 and m.parent_hash != m.root:
        raise CorruptBlockError("a first block whose parent is not its namespace root")
    if hash_block(m.parent_hash, m.token_bytes, m.extra) != m.block_hash:
        raise CorruptBlockError("block hash does not match parent hash + tokens + extra keys")
    if file_stem != m.block_hash.hex():
        raise CorruptBlockError("file name does not match its block hash")


def check_block(data: Buffer) -> BlockFileInfo:
    """Header and checksum only (no engine codec needed); raises CorruptBlockError."""
    return _load_checked(data)[1]


def decode_block(data: Buffer, codec: PayloadCodec) -> tuple[BlockFileInfo, Any, Any]:
    """(metadata, payload, checkpoint); raises CorruptBlockError unless everything checks out."""
    meta, info, arrays = _load_checked(data)
    try:
        payload, checkpoint = codec.from_arrays(arrays, meta["structure"])
    except Exception as exc:
        raise CorruptBlockError(f"cannot rebuild payload: {exc}") from None
    return info, payload, checkpoint
