"""Mutual authentication of peer links: what each side of a link proves, and over what.

When the job has a secret (``MESHCOMM_SECRET``, or ``secret=`` at ``create_world``), every
link, socket or shared memory alike (shared memory is set up over the socket), opens with a
challenge-response before any frame is accepted::

    connector -> acceptor   HELLO  flags F_AUTH, nonce Nc
    acceptor  -> connector  AUTH   nonce Na, proof HMAC(secret, "acceptor", ctx, Nc, Na)
    connector -> acceptor   AUTH   nonce Nc, proof HMAC(secret, "connector", ctx, Nc, Na)
    acceptor  -> connector  ACCEPT or REJECT (duplicate, closed), as without a secret

Each side checks the other's proof before it believes anything else the other says. The
context ``ctx`` (:func:`link_context`) binds a proof to this link: the job token, the world
size, both ranks, the acceptor's address **as published in the store**, and what the HELLO
offered (flags, host key). So a recorded handshake replayed later fails (fresh nonces), a
proof cannot be reflected (roles differ), and a relay fails: a process that overwrote a
rank's address in the store and forwards the connector's bytes to the real rank makes the
connector compute its context over the relay's address and the real rank over its own.

The secret never crosses the wire. Frames after the handshake carry no MAC: the link is
bound to the handshake (see the Security section of ``docs/backends/tcp.md`` for the
measured cost of a per-frame MAC and what remains open: an attacker on the network path
itself, able to rewrite packets of an established TCP connection).

Example:
    >>> ctx = link_context(bytes(16), 2, connector=1, acceptor=0, address="10.0.0.1:5000",
    ...                    flags=0, host_key="")
    >>> a = acceptor_proof(b"k", ctx, bytes(32), b"n" * 32)
    >>> matches(a, acceptor_proof(b"k", ctx, bytes(32), b"n" * 32))
    True
    >>> matches(a, connector_proof(b"k", ctx, bytes(32), b"n" * 32))
    False
"""

from __future__ import annotations

import struct

from meshcomm.common.secret import matches, new_nonce, proof

__all__ = [
    "AUTH_REASON",
    "acceptor_proof",
    "connector_proof",
    "link_context",
    "matches",
    "new_nonce",
]

#: How every REJECT that is about authentication starts (the connector turns it into a
#: ``LinkAuthError``).
AUTH_REASON = "authentication: "

_ACCEPTOR = b"acceptor"
_CONNECTOR = b"connector"
_HEAD = struct.Struct("<16sIIIB")


def link_context(
    token: bytes,
    world_size: int,
    *,
    connector: int,
    acceptor: int,
    address: str,
    flags: int,
    host_key: str,
) -> bytes:
    """The bytes a link's proofs are bound to.

    Args:
        token: the job token.
        world_size: the world size.
        connector: the global rank that connected.
        acceptor: the global rank that accepted.
        address: the acceptor's ``host:port`` as published in the store (the connector uses
            the address it looked up and connected to, the acceptor its own).
        flags: the HELLO's flags.
        host_key: the HELLO's host key ("" without F_SHM).
    """
    head = _HEAD.pack(token, world_size, connector, acceptor, flags)
    return b"meshcomm-link\0" + head + address.encode() + b"\0" + host_key.encode()


def acceptor_proof(secret: bytes, context: bytes, nc: bytes, na: bytes) -> bytes:
    """The acceptor's answer to the connector's nonce ``nc`` (``na``: its own nonce)."""
    return proof(secret, _ACCEPTOR, context, nc, na)


def connector_proof(secret: bytes, context: bytes, nc: bytes, na: bytes) -> bytes:
    """The connector's answer to the acceptor's nonce ``na`` (``nc``: its own nonce)."""
    return proof(secret, _CONNECTOR, context, nc, na)
