"""A rank that reports what meshrun gave it: one JSON line on stdout, one line on stderr.

Its last stdout line has no newline, so the tests also see that meshrun flushes it.
"""

from __future__ import annotations

import json
import os
import sys

KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MESHCOMM_STORE_HOSTED",
    "MESHCOMM_MASTER_ADDR",
    "MESHCOMM_MASTER_PORT",
    "MESHCOMM_RANK",
    "PYTHONUNBUFFERED",
    "TORCHELASTIC_RUN_ID",
)


def main() -> None:
    env = {key: os.environ.get(key) for key in KEYS}
    print(json.dumps({"env": env, "argv": sys.argv[1:], "pid": os.getpid()}))
    print(f"stderr line from rank {env['RANK']}", file=sys.stderr)
    print(f"no newline from rank {env['RANK']}", end="")


if __name__ == "__main__":
    main()
