"""``python -m meshcomm.info``: the same report as ``meshcomm-info``.

A module of its own because ``import meshcomm`` imports :mod:`meshcomm.info` (for
``meshcomm.info()``), and ``python -m`` warns when the module it runs was imported first.
"""

from __future__ import annotations

import sys

from meshcomm.info import main

sys.exit(main())
