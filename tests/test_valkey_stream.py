"""Replies read straight off a real valkey-server's socket (``RespStream``): big values land in
their own writable buffers intact, nulls, integers and error replies keep the stream in sync, and
the shared tier's reads through it match the client's own parser byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from valkey_helpers import ValkeyProcess, server_binary

from promptcache.core.tiers.shared.stream import RespError, RespStream

pytestmark = [
    pytest.mark.valkey,
    pytest.mark.skipif(server_binary() is None, reason="no valkey-server binary"),
]


@pytest.fixture
def valkey(tmp_path):
    proc = ValkeyProcess(tmp_path / "valkey").start()
    yield proc
    proc.stop()


def test_stream_reads_values_nulls_ints_and_errors(valkey):
    client = valkey.client()
    rng = np.random.default_rng(0)
    values = {f"k{i}": rng.bytes(size) for i, size in enumerate((0, 1, 70_000, 5 * 2**20 + 3))}
    for k, v in values.items():
        client.set(k, v)
    client.set("s", "text")
    cmds = [("GET", k) for k in values] + [("GET", "absent"), ("STRLEN", "k3"),
            ("LPUSH", "s", "x"), ("PING",), ("GET", "k2")]  # fmt: skip
    pool = client.connection_pool
    conn = pool.get_connection("GET")
    try:
        conn.send_packed_command(conn.pack_commands(cmds))
        stream = RespStream(conn._sock)
        for v in values.values():
            got = stream.reply()
            assert isinstance(got, np.ndarray) and got.flags.writeable and got.tobytes() == v
        assert stream.reply() is None
        assert stream.reply() == len(values["k3"])
        with pytest.raises(RespError, match="WRONGTYPE"):
            stream.reply()
        assert stream.reply() == b"PONG"
        assert stream.reply().tobytes() == values["k2"]  # still in sync after the error
        assert stream.pos == len(stream.buf)
    finally:
        pool.release(conn)
    assert client.get("k1") == values["k1"]  # the connection went back to the pool usable
