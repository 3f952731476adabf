"""Packing Redis commands in one C call when their arguments are plain.

redis-py's hiredis packer (``HiredisRespSerializer.pack``) walks every argument in
Python before it hands the command to ``hiredis.pack_command``: a generator looking
for memoryviews, then an ``isinstance`` chain and an encoder call per argument. On
resq's hot paths (the publisher's fenced appends, the post-processors' event
appends, the API's recording step) a command carries 10 to 20 arguments, and that
walk cost about 1 us per argument, six times the packing itself (18.6 against 3.0 us
for an 18-argument ``EVALSHA``, ``docs/benchmarks.md``, "2026-12-07, late: commands
packed in C").

:class:`PlainArgumentsPacker` sends a command whose arguments are all ``str``,
``bytes`` or ``int`` (``bool`` excluded: redis-py refuses it) straight to
``hiredis.pack_command``, which encodes those three exactly as redis-py's UTF-8
strict encoder does (``tests/unit/test_redis_packing.py`` compares the bytes). Any
other command (a float, a memoryview, a command name with a space such as ``SCRIPT
LOAD``) goes to redis-py's own packer, unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import hiredis
from redis.connection import HiredisRespSerializer

_PLAIN_TYPES = frozenset({str, bytes, int})
"""Argument types ``hiredis.pack_command`` encodes byte for byte as redis-py does (``type``, not
``isinstance``: ``bool`` is an ``int`` that redis-py refuses, and subclasses may format otherwise)."""

_PLAIN_ENCODING = ("utf-8", "strict")
"""The only encoder settings under which hiredis's ``str`` encoding is redis-py's."""


class CommandPacker(Protocol):
    """What redis-py's connections call to pack a command (``_command_packer``)."""

    def pack(self, *args: Any) -> list[bytes]:
        """The command's bytes in the Redis protocol, as one or more chunks."""
        ...


class PlainArgumentsPacker:
    """Packs plain commands with ``hiredis.pack_command`` alone; the rest with ``fallback``."""

    def __init__(self, fallback: CommandPacker) -> None:
        """``fallback``: the connection's own packer, for commands this one does not take."""
        self._fallback = fallback

    def pack(self, *args: Any) -> list[bytes]:
        """``args`` packed as one chunk (the fallback's chunks for a command that is not plain)."""
        name = args[0]
        # A command name with a space is several words (redis-py splits them): left to it.
        spaced = b" " in name if type(name) is bytes else type(name) is str and " " in name
        if not spaced and _PLAIN_TYPES.issuperset(map(type, args)):
            return [hiredis.pack_command(args)]
        return self._fallback.pack(*args)


class _Packing(Protocol):
    _command_packer: CommandPacker | None

    @property
    def encoder(self) -> Any: ...


def use_plain_packer(connection: _Packing) -> None:
    """Give ``connection`` (sync or asyncio) a :class:`PlainArgumentsPacker` over its own packer.

    Only where its packer is redis-py's hiredis one and its encoding is UTF-8 strict: a
    connection without hiredis, or with another encoding, keeps what it has.
    """
    packer = connection._command_packer
    encoder = connection.encoder
    if (
        type(packer) is HiredisRespSerializer
        and (encoder.encoding, encoder.encoding_errors) == _PLAIN_ENCODING
    ):
        connection._command_packer = PlainArgumentsPacker(packer)


class _PlainPackingMixin:
    """Gives a redis-py connection class's connections a :class:`PlainArgumentsPacker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        use_plain_packer(self)  # type: ignore[arg-type]  # mixed into a redis-py connection


ConnectionClass = TypeVar("ConnectionClass", bound=type)

_PLAIN_PACKING_CLASSES: dict[type, type] = {}


def with_plain_packer(connection_class: ConnectionClass) -> ConnectionClass:
    """A subclass of ``connection_class`` whose connections pack with :class:`PlainArgumentsPacker`
    (one per class; a class that already is one is returned as it is)."""
    if issubclass(connection_class, _PlainPackingMixin):
        return connection_class
    subclass = _PLAIN_PACKING_CLASSES.get(connection_class)
    if subclass is None:
        subclass = type(
            f"PlainPacking{connection_class.__name__}", (_PlainPackingMixin, connection_class), {}
        )
        _PLAIN_PACKING_CLASSES[connection_class] = subclass
    return subclass  # type: ignore[return-value]
