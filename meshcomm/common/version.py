"""meshcomm's version, in a leaf module so that :mod:`meshcomm.info` reads it without
importing the package's ``__init__`` (which imports ``info``).

Keep it equal to ``version`` in ``pyproject.toml``.

Example:
    >>> import meshcomm
    >>> meshcomm.__version__ == VERSION
    True
"""

from __future__ import annotations

__all__ = ["VERSION"]

VERSION = "0.1.0"
