"""API keys: which keys exist, whether a bearer token is one of them, and who it makes the caller.

``RESQ_API_KEYS`` is a comma-separated list, or ``@/path/to/file`` with one key
per line. A presented token is checked against *every* key with
:func:`hmac.compare_digest` over SHA-256 digests (equal lengths, no early exit),
so neither the position of a match nor a key's length shows in the timing.

A caller is identified by the fingerprint of its key, an HMAC-SHA256 keyed with
``RESQ_OWNER_SECRET`` (or a fixed built-in key). Response records store that
fingerprint as their ``owner``; the key itself is never written anywhere and
never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from api.caller import ANONYMOUS, Caller
from api.errors import OpenAIError

DEFAULT_OWNER_SECRET = b"resq/owner-fingerprint/v1"
"""HMAC key of fingerprints when ``RESQ_OWNER_SECRET`` is unset (domain separation, not a secret)."""

FILE_PREFIX = "@"


class APIKeyError(ValueError):
    """``RESQ_API_KEYS`` names no usable key (the message never contains a key)."""


def _clean(candidates: Sequence[str], source: str) -> tuple[str, ...]:
    found = tuple(dict.fromkeys(key.strip() for key in candidates if key.strip()))
    if not found:
        raise APIKeyError(f"{source} holds no API key; leave RESQ_API_KEYS empty for an open API")
    for index, key in enumerate(found, 1):
        if not key.isascii() or not key.isprintable() or any(char.isspace() for char in key):
            raise APIKeyError(f"API key #{index} of {source} has whitespace or non-ASCII characters")
    return found


def parse_api_keys(value: str | None) -> tuple[str, ...]:
    """The keys ``RESQ_API_KEYS`` names; ``()`` (an open API) when it is unset or empty.

    A non-empty value naming no key (``" , "``, an empty file) is an error, not an open API.
    """
    if value is None or not value.strip():
        return ()
    value = value.strip()
    if value.startswith(FILE_PREFIX):
        path = Path(value[len(FILE_PREFIX) :]).expanduser()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise APIKeyError(f"cannot read the API key file {path}: {exc.__class__.__name__}") from exc
        return _clean([line for line in lines if not line.lstrip().startswith("#")], f"the file {path}")
    return _clean(value.split(","), "RESQ_API_KEYS")


def fingerprint(api_key: str, secret: bytes = DEFAULT_OWNER_SECRET) -> str:
    """The owner id of ``api_key``: hex HMAC-SHA256 under ``secret`` (what records store)."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


def match_index(token: str, digests: Sequence[bytes]) -> int | None:
    """Index of the digest equal to SHA-256(``token``), or None; compares against every one, always."""
    presented = hashlib.sha256(token.encode()).digest()
    found: int | None = None
    for index, digest in enumerate(digests):
        # compare_digest runs first so that every digest is compared, match or not.
        if hmac.compare_digest(presented, digest) and found is None:
            found = index
    return found


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive), or None."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def missing_api_key() -> OpenAIError:
    """The 401 for a request without a bearer token."""
    return _unauthorized(
        "You didn't provide an API key. You need to provide your API key in an Authorization header "
        "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
    )


def incorrect_api_key() -> OpenAIError:
    """The 401 for a bearer token that is no configured key (the token is not echoed)."""
    return _unauthorized("Incorrect API key provided.")


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class KeyRing:
    """The configured keys, as digests and owner fingerprints; it keeps no key in the clear."""

    def __init__(self, api_keys: Sequence[str], owner_secret: bytes | None = None) -> None:
        secret = owner_secret or DEFAULT_OWNER_SECRET
        self._digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self._callers = [Caller(fingerprint(key, secret)) for key in api_keys]

    @property
    def open(self) -> bool:
        """No key is configured: every request is :data:`api.caller.ANONYMOUS`."""
        return not self._digests

    def __len__(self) -> int:
        return len(self._digests)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller an ``Authorization`` header proves; a 401 :class:`OpenAIError` otherwise."""
        if self.open:
            return ANONYMOUS
        token = bearer_token(authorization)
        if token is None:
            raise missing_api_key()
        index = match_index(token, self._digests)
        if index is None:
            raise incorrect_api_key()
        return self._callers[index]
