"""Request bodies sent with ``Content-Encoding`` (gzip, deflate, zstd), decoded under the body limit.

The limit counts the decoded bytes, so a small compressed body that inflates past it (a
zip bomb) gets the same 413 as a large plain one. Decoding is incremental with a bound on
every step's output: a bomb is given up on after at most the limit plus one step, never
inflated whole.

Codings listed together (``Content-Encoding: gzip, zstd``) were applied in the order
listed, so they are undone in reverse; every layer's output is held to the limit.
``identity`` is a no-op wherever it appears. Accepted: ``gzip`` (and its alias
``x-gzip``; several members in a row as ``gzip(1)`` writes them), ``deflate`` (the
zlib-wrapped stream RFC 9110 names, and the raw deflate stream some clients send
instead, told apart by the zlib header) and ``zstd`` (one or more frames). Anything
else is refused with a 415 before the body is read. Bytes after the end of a stream
that are not another member or frame, a truncated stream or a corrupt one get a 400.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

import zstandard

from api.errors import OpenAIError

_STEP = 64 * 1024
"""Most bytes one decompression step may produce, and most input fed to zlib at once."""
_MAX_CODINGS = 3
"""More layers than anyone compresses with; each costs up to the limit in CPU and memory."""
_ZSTD_MIN_WINDOW = 8 * 1024 * 1024
"""The window zstd's levels up to 19 use when the encoder does not know the size in advance."""
_ALIASES = {"x-gzip": "gzip"}
SUPPORTED = frozenset({"gzip", "deflate", "zstd"})
"""The content codings the API decodes."""


class DecodedTooLargeError(Exception):
    """The body, decoded, is over the limit (the caller answers with its 413)."""


def unsupported_encoding(coding: str) -> OpenAIError:
    """The 415 for a content coding the API does not decode."""
    return OpenAIError(
        415,
        f"Content-Encoding '{coding}' is not supported; send the body as identity, gzip, deflate or zstd.",
        code="unsupported_content_encoding",
    )


def undecodable(coding: str, reason: str) -> OpenAIError:
    """The 400 for a body that is not what its ``Content-Encoding`` says."""
    return OpenAIError(
        400, f"The request body could not be decompressed as {coding}: {reason}.", code="invalid_body"
    )


def content_codings(headers: Iterable[tuple[bytes, bytes]]) -> list[str]:
    """The codings ``Content-Encoding`` lists, in the order they were applied, ``identity`` left out.

    Several ``Content-Encoding`` lines read as one comma-separated list (RFC 9110 §5.3).
    Raises the 415 ``OpenAIError`` for a coding outside ``SUPPORTED`` or too many layers.
    """
    codings: list[str] = []
    for name, value in headers:
        if name != b"content-encoding":
            continue
        for token in value.decode("latin-1").split(","):
            coding = token.strip().lower()
            coding = _ALIASES.get(coding, coding)
            if not coding or coding == "identity":
                continue
            if coding not in SUPPORTED:
                raise unsupported_encoding(token.strip())
            codings.append(coding)
    if len(codings) > _MAX_CODINGS:
        raise OpenAIError(
            415,
            f"Content-Encoding lists {len(codings)} codings; at most {_MAX_CODINGS} are decoded.",
            code="unsupported_content_encoding",
        )
    return codings


def decode(body: bytes, codings: list[str], limit: int) -> bytes:
    """``body`` with ``codings`` undone (last applied, first undone), at most ``limit`` bytes.

    CPU-bound (milliseconds for megabytes): call it from a worker thread. Raises
    ``DecodedTooLargeError`` past ``limit`` and the 400 ``OpenAIError`` for a corrupt stream.
    """
    for coding in reversed(codings):
        if not body:
            return body  # nothing to decode: the route answers an empty body itself
        body = _unzstd(body, limit) if coding == "zstd" else _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    if coding == "gzip":
        wbits = 16 + zlib.MAX_WBITS
    elif _zlib_header(data):
        wbits = zlib.MAX_WBITS
    else:
        wbits = -zlib.MAX_WBITS  # raw deflate: what some clients mean by "deflate"
    try:
        return _collect(_zlib_pieces(data, wbits, coding), limit)
    except zlib.error as exc:
        raise undecodable(coding, str(exc)) from None


def _zlib_header(data: bytes) -> bool:
    # RFC 1950: method 8 (deflate), a window of at most 32 KiB, a header checksum. Raw
    # deflate from zlib never looks like this: its first block pads with zero bits.
    return len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7 and (data[0] << 8 | data[1]) % 31 == 0


def _zlib_pieces(data: bytes, wbits: int, coding: str) -> Iterator[bytes]:
    view = memoryview(data)
    offset = 0  # where the current stream (gzip member) starts
    while True:
        inflater = zlib.decompressobj(wbits)
        end = offset
        # Input goes in bounded slices too: ``unconsumed_tail`` copies what is left of
        # its input on every step, which would be quadratic in the whole body.
        while end < len(view) and not inflater.eof:
            pending: bytes | memoryview = view[end : end + _STEP]
            end += len(pending)
            while pending and not inflater.eof:
                yield inflater.decompress(pending, _STEP)
                pending = inflater.unconsumed_tail
            # A slice can be consumed with output still held back: drain it.
            while not inflater.eof and (piece := inflater.decompress(b"", _STEP)):
                yield piece
        if not inflater.eof:
            raise undecodable(coding, "the stream is truncated")
        offset = end - len(inflater.unused_data)
        if offset == len(view):
            return
        if coding != "gzip":
            raise undecodable(coding, "there are bytes after the end of the stream")
        # Another gzip member follows (or garbage, which zlib reports).


def _unzstd(data: bytes, limit: int) -> bytes:
    # libzstd's streaming reader bounds every read but never says whether the input
    # ended mid-frame, and its decompressobj says that but inflates a whole input in
    # one call. So: measure with the reader (output dropped as it comes, a bomb stops
    # at the limit), then decode with decompressobj, whose output is now known to fit.
    # libzstd allocates the window a frame asks for (out of tracemalloc's sight): refuse
    # one larger than both the limit and what the standard levels use.
    dctx = zstandard.ZstdDecompressor(max_window_size=max(_ZSTD_MIN_WINDOW, limit))
    try:
        with dctx.stream_reader(data, read_size=_STEP, read_across_frames=True) as reader:
            size = 0
            while piece := reader.read(_STEP):
                size += len(piece)
                if size > limit:
                    raise DecodedTooLargeError
        frames: list[bytes] = []
        rest = data
        while rest:
            frame = dctx.decompressobj()
            frames.append(frame.decompress(rest))
            if not frame.eof:
                raise undecodable("zstd", "the stream is truncated")
            rest = frame.unused_data
    except zstandard.ZstdError as exc:
        raise undecodable("zstd", str(exc)) from None
    return b"".join(frames)


def _collect(pieces: Iterator[bytes], limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise DecodedTooLargeError
        chunks.append(piece)
    return b"".join(chunks)
