"""The secret a launcher hands its ranks: from a 0600 file, the environment, or made fresh.

meshrun, :func:`meshcomm.spawn`, :func:`meshcomm.jupyter.start_cluster` and ``meshrun
--backend mpi`` give every rank of a job the same ``MESHCOMM_SECRET``, so the job's store and
links admit only its own ranks. A secret already in the launcher's environment is kept (the
user's, or an outer launcher's); on several nodes every node must get the same one, so meshrun
reads it from ``--secret-file`` or the environment rather than making its own.

Example:
    >>> launch_secret({"MESHCOMM_SECRET": "given"})
    'given'
    >>> len(launch_secret({}))
    64
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from meshcomm.common.secret import SECRET_ENV, new_secret
from meshcomm.errors import InvalidArgument

__all__ = ["launch_secret", "read_secret_file"]

# A file holding a secret must not be readable by anyone but its owner.
_PRIVATE = 0o077
_MAX_SECRET_FILE = 4096


def launch_secret(env: Mapping[str, str] | None = None) -> str:
    """The job's secret: ``MESHCOMM_SECRET`` from ``env`` if set, else a fresh random one.

    Example:
        >>> launch_secret({}) != launch_secret({})
        True
    """
    given = (os.environ if env is None else env).get(SECRET_ENV, "")
    return given if given else new_secret()


def read_secret_file(path: str) -> str:
    """Read a secret from ``path``, which must be a regular file of mode 0600 (or stricter).

    Surrounding whitespace (a trailing newline) is dropped.

    Raises:
        InvalidArgument: the file is missing, not a regular file, readable or writable by
            group or others (names its mode), empty, or over 4096 bytes.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", delete=False) as f:
        ...     _ = f.write("s3cret\\n")
        >>> read_secret_file(f.name)  # NamedTemporaryFile makes it 0600
        's3cret'
        >>> os.unlink(f.name)
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise InvalidArgument(f"cannot read the secret file {path!r}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"the secret file {path!r} is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & _PRIVATE:
            raise InvalidArgument(
                f"the secret file {path!r} has mode {mode:04o}; it must be readable only by its "
                f"owner (mode 0600: chmod 600 {path})"
            )
        data = os.read(fd, _MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_FILE:
        raise InvalidArgument(f"the secret file {path!r} is over {_MAX_SECRET_FILE} bytes")
    secret = data.decode(errors="replace").strip()
    if not secret:
        raise InvalidArgument(f"the secret file {path!r} is empty")
    return secret
