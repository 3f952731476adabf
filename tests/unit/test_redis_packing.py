"""Commands packed in one C call are byte for byte what redis-py packs; the rest are redis-py's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection as AsyncConnection
from redis.asyncio.connection import UnixDomainSocketConnection as AsyncUnixConnection
from redis.connection import Connection, HiredisRespSerializer, UnixDomainSocketConnection
from redis.exceptions import DataError

from resq.redis_client import async_redis, sync_redis
from resq.redis_packing import PlainArgumentsPacker, use_plain_packer, with_plain_packer

_ARGUMENT = st.one_of(
    st.text(),  # any str, lone surrogates included (both packers refuse those alike)
    st.binary(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.booleans(),  # refused by redis-py, so by both
    st.floats(),  # left to redis-py
)
_NAME = st.sampled_from(["EVALSHA", "XADD", b"HSET", "MULTI", "x"])


def _packer_of(connection: Any) -> Any:
    return connection._command_packer


def _connection(**kwargs: Any) -> Any:
    return Connection(**kwargs)  # type: ignore[no-untyped-call]


def _redis_py_packer() -> HiredisRespSerializer:
    packer = _packer_of(_connection())
    assert isinstance(packer, HiredisRespSerializer)
    return packer


def _packed(packer: Any, args: tuple[Any, ...]) -> bytes | str:
    """The command's bytes, or the error's type (the same error must come from both)."""
    try:
        return b"".join(packer.pack(*args))
    except Exception as error:  # the error's kind is what is compared
        return type(error).__name__


@given(_NAME, st.lists(_ARGUMENT, max_size=24))
def test_plain_commands_pack_as_redis_py_does(name: str | bytes, rest: list[Any]) -> None:
    reference = _redis_py_packer()
    args = (name, *rest)
    assert _packed(PlainArgumentsPacker(reference), args) == _packed(reference, args)


class _Recording:
    """A fallback that records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def pack(self, *args: Any) -> list[bytes]:
        self.calls.append(args)
        return [b"fallback"]


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "k", 0.1),  # a float: redis-py's repr, left to it
        ("SET", "k", True),  # a bool: redis-py refuses it (DataError), hiredis would send 1
        ("SET", "k", memoryview(b"v")),  # sent as its own chunk by redis-py
        ("SET", "k", bytearray(b"v")),
        ("SCRIPT LOAD", "return 1"),  # a name of several words: redis-py splits it
        (b"CLIENT SETNAME", "x"),
    ],
)
def test_other_commands_go_to_the_fallback(args: tuple[Any, ...]) -> None:
    fallback = _Recording()
    assert PlainArgumentsPacker(fallback).pack(*args) == [b"fallback"]
    assert fallback.calls == [args]


def test_plain_commands_skip_the_fallback() -> None:
    fallback = _Recording()
    packed = PlainArgumentsPacker(fallback).pack("EVALSHA", "abc", 1, "key", b"\x00", -3)
    assert fallback.calls == []
    assert packed == [
        b"*6\r\n$7\r\nEVALSHA\r\n$3\r\nabc\r\n$1\r\n1\r\n$3\r\nkey\r\n$1\r\n\x00\r\n$2\r\n-3\r\n"
    ]


def test_a_bool_is_still_refused() -> None:
    with pytest.raises(DataError):
        PlainArgumentsPacker(_redis_py_packer()).pack("SET", "k", True)


def test_only_utf8_strict_connections_change_packer() -> None:
    plain = _connection()
    use_plain_packer(plain)
    assert isinstance(_packer_of(plain), PlainArgumentsPacker)
    latin = _connection(encoding="latin-1")
    use_plain_packer(latin)
    assert isinstance(_packer_of(latin), HiredisRespSerializer)
    lenient = _connection(encoding_errors="replace")
    use_plain_packer(lenient)
    assert isinstance(_packer_of(lenient), HiredisRespSerializer)


@pytest.mark.parametrize(
    "connection_class", [Connection, UnixDomainSocketConnection, AsyncConnection, AsyncUnixConnection]
)
def test_with_plain_packer_keeps_the_transport(connection_class: type) -> None:
    subclass = with_plain_packer(connection_class)
    assert issubclass(subclass, connection_class)
    assert with_plain_packer(connection_class) is subclass  # one subclass per class
    assert with_plain_packer(subclass) is subclass
    kwargs = {"path": "/tmp/none.sock"} if "Unix" in connection_class.__name__ else {}
    assert isinstance(_packer_of(subclass(**kwargs)), PlainArgumentsPacker)


def test_resq_clients_use_it() -> None:
    sync_pool: Any = sync_redis("redis://127.0.0.1:1/0").connection_pool
    assert isinstance(_packer_of(sync_pool.make_connection()), PlainArgumentsPacker)
    unix_pool: Any = sync_redis("unix:///tmp/none.sock?db=2").connection_pool
    unix_connection = unix_pool.make_connection()
    assert isinstance(unix_connection, UnixDomainSocketConnection)
    assert isinstance(_packer_of(unix_connection), PlainArgumentsPacker)

    async def made() -> Any:
        client = async_redis("redis://127.0.0.1:1/0")
        pool: Any = client.connection_pool
        connection = pool.make_connection()
        await client.aclose()
        return connection

    assert isinstance(_packer_of(asyncio.run(made())), PlainArgumentsPacker)
