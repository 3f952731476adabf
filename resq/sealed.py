"""Opaque, authenticated blobs for content a stateless client carries between turns.

``encrypted_content`` of a reasoning item (and, later, of a compaction item) holds
text the server wrote and wants back unchanged. It is encrypted and authenticated
with AES-256-GCM under a key derived from ``RESQ_CONTENT_SECRET`` (or, unset, from
``RESQ_OWNER_SECRET`` / its built-in default), and bound to its purpose and to the
caller that received it (the associated data), so a blob altered by one bit, sealed
by another server, or replayed by another API key fails to open.

Sealing is deterministic, like every other byte of a response: the nonce is an
HMAC of the associated data and the plaintext (a synthetic IV, as in SIV modes).
A post-processor that re-runs after a crash rebuilds the same event bytes, and a
nonce can only repeat for the very same plaintext, which is the one case where
reusing a GCM nonce reveals nothing but the equality of the two blobs.

Format: ``rq1_`` + base64url(nonce ‖ ciphertext ‖ tag), no padding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from resq.settings import Settings

PREFIX = "rq1_"
_NONCE_BYTES = 12
_TAG_BYTES = 16
MAX_BLOB_CHARS = 4 * 1024 * 1024
"""Longest blob worth trying to open (the body limit bounds it anyway)."""


class SealError(ValueError):
    """A blob that this server did not seal for this purpose and caller, or that was altered."""


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"resq sealed content/" + label, hashlib.sha256).digest()


class Sealer:
    """Seals and opens blobs under one server secret."""

    def __init__(self, secret: bytes) -> None:
        self._cipher = AESGCM(_derive(secret, b"aes-256-gcm"))
        self._nonce_key = _derive(secret, b"synthetic-iv")

    @staticmethod
    def _associated_data(purpose: str, owner: str) -> bytes:
        return f"resq/{purpose}/{owner}".encode()

    def seal(self, purpose: str, owner: str, plaintext: str) -> str:
        """``plaintext`` as an opaque blob that only :meth:`open` with the same purpose and owner reads."""
        associated = self._associated_data(purpose, owner)
        data = plaintext.encode()
        nonce = hmac.new(self._nonce_key, associated + b"\0" + data, hashlib.sha256).digest()[:_NONCE_BYTES]
        sealed = nonce + self._cipher.encrypt(nonce, data, associated)
        return PREFIX + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()

    def open(self, purpose: str, owner: str, blob: str) -> str:
        """The plaintext of ``blob``; :class:`SealError` when it is not one of ours, for this purpose and owner."""
        if not blob.startswith(PREFIX) or len(blob) > MAX_BLOB_CHARS:
            raise SealError("not an encrypted_content this server issued")
        body = blob[len(PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        except (binascii.Error, ValueError):
            raise SealError("not an encrypted_content this server issued") from None
        if len(raw) < _NONCE_BYTES + _TAG_BYTES:
            raise SealError("not an encrypted_content this server issued")
        nonce, ciphertext = raw[:_NONCE_BYTES], raw[_NONCE_BYTES:]
        try:
            data = self._cipher.decrypt(nonce, ciphertext, self._associated_data(purpose, owner))
        except InvalidTag:
            raise SealError(
                "encrypted_content was altered, or was issued by another server or to another API key"
            ) from None
        return data.decode()


REASONING = "reasoning"
"""The purpose of a reasoning item's ``encrypted_content``: the reasoning text as the model wrote it."""
COMPACTION = "compaction"
"""The purpose of a compaction item's ``encrypted_content``: the summary that stands for what came before."""


DEFAULT_SECRET = b"resq/sealed-content/v1"
"""The key material when neither secret is configured: authenticates, but anyone with the source can read."""


def sealer_from_settings(settings: Settings) -> Sealer:
    """The deployment's sealer: ``RESQ_CONTENT_SECRET``, else ``RESQ_OWNER_SECRET``, else the default."""
    secret = settings.content_secret or settings.owner_secret
    return Sealer(secret.get_secret_value().encode() if secret else DEFAULT_SECRET)
