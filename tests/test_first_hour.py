"""The first hour, kept honest: a fresh clone, ``make demo``, and not one warning of ours.

A newcomer clones the repository and types ``make demo``: the Makefile makes ``.venv`` with
``python3 -m venv``, pip-installs the package (numpy, ml_dtypes) from whatever package index
the machine is configured with, and runs the tour on 8 ranks. Anything that prints a warning
on that path (setuptools about pyproject.toml or the editable install, a DeprecationWarning or
RuntimeWarning from our import or the tour) fails here, as does a tour that does not end
with "all checks passed", or a clone left with files git does not ignore.

The clone is of the checkout's committed HEAD: uncommitted edits are not in it, as they are
not in a newcomer's clone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Lines that mention a warning but are the machine's, not ours. Each entry says why.
ALLOWED = [
    # pip's own message about this machine's pip configuration: an index or find-links
    # location that does not exist here (e.g. file:///opt/pypi-more/simple/<name>/ in
    # /etc/pip.conf). It names the machine's index, never our project or build.
    re.compile(r"^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$"),
]
WARNING = re.compile(r"warn|deprecat", re.IGNORECASE)
# Seconds for the whole `make demo`: about 11 s here with the machine's local package index;
# a cold pip cache on a slow CI machine downloads numpy and ml_dtypes (tens of MB).
MAKE_TIMEOUT = 600.0


def _newcomer_environment() -> dict[str, str]:
    """This environment without what the test run adds: no PYTHONPATH pointing at the checkout,
    no active venv, no launcher variables; the machine's python3 first on PATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
        and not k.startswith(("MESHCOMM_", "PYTEST_"))
        and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    # `make pytest` puts the suite's .venv/bin first on PATH; a newcomer's python3 is the
    # machine's, so drop the running interpreter's venv from PATH.
    venv_bin = Path(sys.executable).parent
    if sys.prefix != sys.base_prefix:
        env["PATH"] = os.pathsep.join(
            p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != venv_bin
        )
    return env


def _ours(line: str) -> bool:
    """True for a line that warns and is not on the allowlist."""
    text = line.strip()
    return bool(WARNING.search(text)) and not any(a.match(text) for a in ALLOWED)


def test_the_allowlist_is_narrow() -> None:
    assert not _ours(
        "WARNING: Location 'file:///opt/pypi-more/simple/pip/' is ignored: "
        "it is neither a file nor a directory."
    )
    assert _ours("  SetuptoolsDeprecationWarning: License classifiers are deprecated.")
    assert _ours("/x/editable_wheel.py:354: BuildBackendWarning: Editable installation.")
    assert _ours("[rank0] <frozen runpy>:128: RuntimeWarning: 'meshcomm.info' found in sys.modules")
    assert _ours("WARNING: Location 'x' is ignored: it is neither a file nor a directory. Also x")


@pytest.mark.slow
@pytest.mark.timeout(MAKE_TIMEOUT + 120)
def test_make_demo_from_a_fresh_clone(tmp_path: Path) -> None:
    git, make = shutil.which("git"), shutil.which("make")
    if git is None or make is None:
        pytest.skip("needs git and make")
    if not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout")
    env = _newcomer_environment()
    if shutil.which("python3", path=env.get("PATH")) is None:
        pytest.skip("no python3 on PATH outside the test's venv")
    clone = tmp_path / "meshcomm"
    subprocess.run(
        [git, "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)],
        check=True, timeout=120, env=env, capture_output=True,
    )  # fmt: skip
    start = time.monotonic()
    # A session of its own: on a timeout, make, pip, meshrun and the 8 ranks die together.
    proc = subprocess.Popen(
        [make, "demo"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=MAKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"make demo did not finish in {MAKE_TIMEOUT:g} s:\n{stdout}\n{stderr}")
    seconds = time.monotonic() - start
    text = stdout + stderr
    assert proc.returncode == 0, (
        f"make demo exited {proc.returncode} after {seconds:.0f} s:\n{text}"
    )
    warnings = [line for line in text.splitlines() if _ours(line)]
    assert not warnings, "make demo printed warnings of ours:\n" + "\n".join(warnings)
    last = [line for line in stdout.splitlines() if line.strip()][-1]
    assert last.endswith("all checks passed"), f"the demo ended with {last!r}:\n{text}"
    # What the demo built (.venv, egg-info) is ignored: the newcomer's clone stays clean.
    status = subprocess.run(
        [git, "status", "--porcelain"], cwd=clone, env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    assert status.stdout == "", f"make demo left files git does not ignore:\n{status.stdout}"
    print(f"make demo from a fresh clone: {seconds:.1f} s")
