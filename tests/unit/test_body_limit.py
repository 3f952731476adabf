"""``BodySizeLimit``: the body limit, and compressed bodies decoded under it (``api.body_encoding``)."""

from __future__ import annotations

import gzip
import json
import struct
import threading
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zstandard
from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.testclient import TestClient

from api import body_encoding
from api.body_limit import BodySizeLimit

LIMIT = 1024 * 1024
INVALID = "invalid_request_error"


class Item(BaseModel):
    text: str


def _app(limit: int, seen: list[dict[str, Any]]) -> FastAPI:
    """An echo app behind the middleware; ``seen`` collects what each request looked like to it."""
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        body = await request.body()
        seen.append(
            {
                "body": body,
                "encoding": request.headers.get("content-encoding"),
                "length": request.headers.get("content-length"),
                "thread": threading.get_ident(),
            }
        )
        return {"size": len(body)}

    @app.post("/item")
    async def item(item: Item) -> Item:
        return item

    app.add_middleware(BodySizeLimit, max_bytes=limit)
    return app


@pytest.fixture
def seen() -> list[dict[str, Any]]:
    return []


@pytest.fixture
def client(seen: list[dict[str, Any]]) -> Iterator[TestClient]:
    with TestClient(_app(LIMIT, seen)) as test_client:
        yield test_client


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,
    "zstd": _zstd,
}


def _stream(coding: str, size: int, piece: bytes = b"\0" * LIMIT) -> bytes:
    """``size`` bytes of ``piece`` compressed without ever holding them all (bomb material)."""
    chunks: list[bytes] = []
    if coding == "zstd":
        zpacker = zstandard.ZstdCompressor(level=3).compressobj()
        for _ in range(size // len(piece)):
            chunks.append(zpacker.compress(piece))
        chunks.append(zpacker.flush())
    else:
        wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS
        packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
        for _ in range(size // len(piece)):
            chunks.append(packer.compress(piece))
        chunks.append(packer.flush())
    return b"".join(chunks)


def _error(reply: Any, status: int, code: str) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (INVALID, None, code)
    return error


PAYLOAD = json.dumps({"text": "héllo " * 2000}).encode()


# --- plain bodies: the limit as it was ------------------------------------------------------------


def test_plain_body_passes_unchanged(client: TestClient, seen: list[dict[str, Any]]) -> None:
    reply = client.post("/echo", content=PAYLOAD)
    assert reply.json() == {"size": len(PAYLOAD)}
    assert seen[0]["body"] == PAYLOAD and seen[0]["length"] == str(len(PAYLOAD))


def test_identity_passes_unchanged(client: TestClient, seen: list[dict[str, Any]]) -> None:
    reply = client.post("/echo", content=PAYLOAD, headers={"Content-Encoding": "identity"})
    assert reply.json() == {"size": len(PAYLOAD)}
    assert seen[0]["body"] == PAYLOAD and seen[0]["encoding"] == "identity"


def test_declared_length_over_limit_is_refused_unread(client: TestClient, seen: list[dict[str, Any]]) -> None:
    reply = client.post("/echo", content=b"x" * (LIMIT + 1))
    _error(reply, 413, "request_too_large")
    assert reply.headers["connection"] == "close" and not seen


def test_chunked_body_over_limit_is_refused(client: TestClient, seen: list[dict[str, Any]]) -> None:
    reply = client.post("/echo", content=iter([b"x" * 65536] * 17))
    _error(reply, 413, "request_too_large")
    assert not seen


# --- compressed bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", _raw_deflate),
        ("zstd", _zstd),
        ("ZSTD", _zstd),
        ("identity, zstd", _zstd),
        ("gzip, zstd", lambda data: _zstd(gzip.compress(data))),
        ("zstd, deflate", lambda data: zlib.compress(_zstd(data))),
    ],
    ids=[
        "gzip",
        "x-gzip",
        "deflate-zlib",
        "deflate-raw",
        "zstd",
        "zstd-upper",
        "identity-zstd",
        "gzip-zstd",
        "zstd-deflate",
    ],
)
def test_compressed_body_reaches_the_app_decoded(
    client: TestClient, seen: list[dict[str, Any]], header: str, encode: Callable[[bytes], bytes]
) -> None:
    compressed = encode(PAYLOAD)
    assert len(compressed) < len(PAYLOAD)
    reply = client.post("/echo", content=compressed, headers={"Content-Encoding": header})
    assert reply.json() == {"size": len(PAYLOAD)}
    assert seen[0]["body"] == PAYLOAD
    assert seen[0]["encoding"] is None and seen[0]["length"] == str(len(PAYLOAD))


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_fastapi_parses_decoded_json(client: TestClient, coding: str) -> None:
    body = ENCODERS[coding](PAYLOAD)
    reply = client.post(
        "/item", content=body, headers={"Content-Encoding": coding, "Content-Type": "application/json"}
    )
    assert reply.status_code == 200, reply.text
    assert reply.json() == json.loads(PAYLOAD)


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_chunked_compressed_body_is_decoded(
    client: TestClient, seen: list[dict[str, Any]], coding: str
) -> None:
    compressed = ENCODERS[coding](PAYLOAD)
    pieces = [compressed[start : start + 100] for start in range(0, len(compressed), 100)]
    reply = client.post("/echo", content=iter(pieces), headers={"Content-Encoding": coding})
    assert reply.json() == {"size": len(PAYLOAD)}
    assert seen[0]["length"] == str(len(PAYLOAD))


def test_several_gzip_members_and_zstd_frames_concatenate(
    client: TestClient, seen: list[dict[str, Any]]
) -> None:
    skippable = struct.pack("<II", 0x184D2A50, 3) + b"pad"
    for coding, body in [
        ("gzip", gzip.compress(b"hello, ") + gzip.compress(b"world")),
        ("zstd", _zstd(b"hello, ") + skippable + _zstd(b"world")),
    ]:
        client.post("/echo", content=body, headers={"Content-Encoding": coding})
        assert seen.pop()["body"] == b"hello, world"


def test_empty_compressed_body_reaches_the_app_empty(client: TestClient, seen: list[dict[str, Any]]) -> None:
    reply = client.post("/echo", content=b"", headers={"Content-Encoding": "gzip"})
    assert reply.json() == {"size": 0}
    assert seen[0]["encoding"] is None


def test_decoding_runs_off_the_event_loop(
    client: TestClient, seen: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    decode = body_encoding.decode

    def recording(body: bytes, codings: list[str], limit: int) -> bytes:
        threads.append(threading.get_ident())
        return decode(body, codings, limit)

    monkeypatch.setattr(body_encoding, "decode", recording)
    client.post("/echo", content=gzip.compress(PAYLOAD), headers={"Content-Encoding": "gzip"})
    assert threads and threads[0] != seen[0]["thread"]


# --- the limit counts decoded bytes ---------------------------------------------------------------


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_limit_counts_decoded_bytes(client: TestClient, seen: list[dict[str, Any]], coding: str) -> None:
    at_limit = (b"abcdefgh" * (LIMIT // 8 + 1))[:LIMIT]
    compressed = ENCODERS[coding](at_limit)
    assert len(compressed) < LIMIT // 10
    reply = client.post("/echo", content=compressed, headers={"Content-Encoding": coding})
    assert reply.json() == {"size": LIMIT}

    over = ENCODERS[coding](at_limit + b"x")
    assert len(over) < LIMIT // 10
    reply = client.post("/echo", content=over, headers={"Content-Encoding": coding})
    error = _error(reply, 413, "request_too_large")
    assert "decompressed" in error["message"]
    assert len(seen) == 1


def test_each_layer_is_held_to_the_limit(client: TestClient, seen: list[dict[str, Any]]) -> None:
    # The outer zstd layer decodes to a small gzip stream; the gzip layer is the bomb.
    body = _zstd(_stream("gzip", 4 * LIMIT))
    reply = client.post("/echo", content=body, headers={"Content-Encoding": "gzip, zstd"})
    _error(reply, 413, "request_too_large")
    assert not seen


@pytest.mark.parametrize("coding", sorted(ENCODERS))
def test_bomb_is_refused_without_inflating_it(
    client: TestClient, seen: list[dict[str, Any]], coding: str
) -> None:
    inflated = 100 * 1024 * 1024
    bomb = _stream(coding, inflated)
    assert len(bomb) < 200 * 1024  # a few KB (zstd) to ~100 KB (zlib's best ratio is about 1000:1)
    tracemalloc.start()
    try:
        reply = client.post("/echo", content=bomb, headers={"Content-Encoding": coding})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _error(reply, 413, "request_too_large")
    assert not seen
    # The limit plus a step or two, and the test client's own copies: nowhere near 100 MB.
    assert peak < 4 * LIMIT, peak


def test_large_zstd_window_is_refused(client: TestClient) -> None:
    # A window of 128 MiB would have libzstd allocate it (out of tracemalloc's sight).
    params = zstandard.ZstdCompressionParameters.from_level(19, window_log=27)
    packer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = packer.compress(PAYLOAD) + packer.flush()
    reply = client.post("/echo", content=body, headers={"Content-Encoding": "zstd"})
    _error(reply, 400, "invalid_body")


# --- refusals -------------------------------------------------------------------------------------


def _corrupt_cases() -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    for coding, encode in ENCODERS.items():
        good = encode(PAYLOAD)
        cases += [
            (coding, b"this is not compressed at all"),
            (coding, good[:-5]),  # truncated
            (coding, good + b"trailing"),
        ]
    flipped = bytearray(zlib.compress(PAYLOAD))
    flipped[len(flipped) // 2] ^= 0xFF
    cases.append(("deflate", bytes(flipped)))
    return cases


@pytest.mark.parametrize(("coding", "body"), _corrupt_cases())
def test_corrupt_body_gets_400(
    client: TestClient, seen: list[dict[str, Any]], coding: str, body: bytes
) -> None:
    reply = client.post("/echo", content=body, headers={"Content-Encoding": coding})
    error = _error(reply, 400, "invalid_body")
    assert error["message"].startswith(f"The request body could not be decompressed as {coding}")
    assert not seen


@pytest.mark.parametrize("header", ["br", "compress", "gzip, br", "snappy", "gzip, gzip, gzip, gzip"])
def test_unknown_encoding_gets_415_before_the_body_is_read(
    client: TestClient, seen: list[dict[str, Any]], header: str
) -> None:
    reply = client.post("/echo", content=gzip.compress(PAYLOAD), headers={"Content-Encoding": header})
    error = _error(reply, 415, "unsupported_content_encoding")
    assert error["message"].startswith("Content-Encoding")
    assert reply.headers["connection"] == "close" and not seen
