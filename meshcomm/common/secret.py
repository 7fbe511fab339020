"""The job's shared secret and the HMAC-SHA256 challenge-response built on it.

A job's ranks share one secret (``MESHCOMM_SECRET``, made per job by meshrun, spawn and
``jupyter.start_cluster``; on several nodes the user gives every node the same value). Both
ends of a connection prove they know it without sending it: each side sends a fresh random
nonce, then each answers with ``HMAC-SHA256(secret, role | context | client nonce | server
nonce)``, a different role on each side, so neither answer can be replayed, reflected or
relayed to another connection. Both sides then derive the same per-connection
:func:`session_key` (the role ``session``), which MACs the frames that follow.

Example:
    >>> secret = b"0" * 32
    >>> mine, theirs = new_nonce(), new_nonce()
    >>> p = proof(secret, b"client", b"store", mine, theirs)
    >>> matches(p, proof(secret, b"client", b"store", mine, theirs))
    True
    >>> matches(p, proof(secret, b"server", b"store", mine, theirs))
    False
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

__all__ = [
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SECRET_ENV",
    "job_secret",
    "matches",
    "new_nonce",
    "new_secret",
    "proof",
    "session_key",
]

#: The environment variable that carries the job's secret to its ranks.
SECRET_ENV = "MESHCOMM_SECRET"
#: Length of a challenge nonce and of a proof, in bytes.
NONCE_BYTES = 32
PROOF_BYTES = 32


def new_secret() -> str:
    """A fresh job secret: 64 hex characters (256 random bits).

    Example:
        >>> len(new_secret())
        64
    """
    return secrets.token_hex(32)


def job_secret(
    explicit: str | bytes | None = None, env: Mapping[str, str] | None = None
) -> bytes | None:
    """The secret to use: ``explicit`` if given, else ``MESHCOMM_SECRET``, else None.

    An empty value counts as none (an unauthenticated job).

    Example:
        >>> job_secret("abc"), job_secret(env={}), job_secret(env={"MESHCOMM_SECRET": "k"})
        (b'abc', None, b'k')
    """
    if explicit is None:
        explicit = (os.environ if env is None else env).get(SECRET_ENV)
    if not explicit:
        return None
    return explicit.encode() if isinstance(explicit, str) else bytes(explicit)


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, role: bytes, context: bytes, first: bytes, second: bytes) -> bytes:
    """``HMAC-SHA256(secret, role, context, first nonce, second nonce)``, each length-prefixed.

    ``role`` tells the two sides apart (a reflected answer fails); ``context`` names what is
    being joined (the store, a communicator link) so a proof made for one is worthless for
    the other.
    """
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (role, context, first, second):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def session_key(secret: bytes, context: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The key that MACs one connection's frames after its handshake: 32 bytes.

    ``HMAC-SHA256(secret, "session" | context | client nonce | server nonce)``, length-prefixed
    as in :func:`proof`. The role ``session`` keeps it apart from both proofs (which cross the
    wire in the clear), and the fresh nonces make it differ on every connection, so a frame
    recorded on one connection is worthless on another.

    Example:
        >>> secret, nc, ns = b"0" * 32, b"1" * 32, b"2" * 32
        >>> key = session_key(secret, b"store", nc, ns)
        >>> len(key), key == proof(secret, b"client", b"store", nc, ns)
        (32, False)
    """
    return proof(secret, b"session", context, client_nonce, server_nonce)


def matches(expected: bytes, got: bytes) -> bool:
    """Compare two proofs in constant time."""
    return hmac.compare_digest(expected, got)
