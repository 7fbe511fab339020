"""The tcp backend's abort record: which rank failed and why, as a value in the job's store.

The first rank that sees a failure writes one record (``compare_set``: the first writer wins)
and every rank blocked in a collective reads it within about a second, raising ``PeerError``
with the blamed rank. The rank is a field of its own, so rewording a reason never changes
whom the survivors blame.

Example:
    >>> record = AbortRecord(2, "rank 2 died: connection reset (seen by rank 0)")
    >>> AbortRecord.decode(record.encode(), world_size=4) == record
    True
    >>> str(record)
    'rank 2 died: connection reset (seen by rank 0)'
    >>> AbortRecord.decode(b"anything else", world_size=4).rank is None
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["MAX_REASON", "AbortRecord"]

#: Characters of a reason kept: the record is read by every rank and printed in its error.
MAX_REASON = 2000


@dataclass(frozen=True)
class AbortRecord:
    """A failure every rank of a transport's world should raise.

    Attributes:
        rank: the rank blamed, in the transport's numbering (None: none of the world's; a
            record that is not ours, or names no rank).
        reason: what happened, in words, for the error messages.
    """

    rank: int | None
    reason: str
    #: The ranks called different collectives (:class:`~meshcomm.errors.MismatchError`);
    #: ``reason`` names both calls and every rank raises it as it is.
    mismatch: bool = False

    def __str__(self) -> str:
        return self.reason

    def encode(self) -> bytes:
        """The record as the store keeps it (JSON, reason cut to :data:`MAX_REASON`)."""
        value: dict[str, object] = {"rank": self.rank, "reason": self.reason[:MAX_REASON]}
        if self.mismatch:
            value["mismatch"] = True
        return json.dumps(value).encode()

    @classmethod
    def decode(cls, raw: bytes, world_size: int) -> AbortRecord:
        """Read a stored record; anything malformed blames no rank and is quoted as it is.

        Args:
            raw: the stored bytes (any bytes: a store is shared by the job's clients).
            world_size: ranks of the world; a rank outside it is not blamed.
        """
        text = raw[: 4 * MAX_REASON].decode(errors="replace")
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return cls(None, text[:MAX_REASON])
        rank, reason = value.get("rank"), value.get("reason")
        if not isinstance(reason, str):
            reason = text[:MAX_REASON]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            rank = None
        return cls(rank, reason[:MAX_REASON], value.get("mismatch") is True)
