"""meshrun's clean-up of MPICH's ``/dev/shm`` files (:mod:`meshcomm.launcher.mpich_shm`) is safe.

Real processes map and open real files in ``/dev/shm``: a file is removed only when the
watched job's processes were seen mapping it and no live process maps it or holds it open.
The whole path, with a real ``mpiexec`` job that aborts, is in ``tests/test_mpi.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from meshcomm.launcher.mpich_shm import SHM_DIR, ShmWatch, mapped_by

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)), reason="Linux /dev/shm"
)

# Maps (or with "open": only opens) the file, says so, then waits to be killed.
_HOLDER = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
if sys.argv[2] == "map":
    m = mmap.mmap(f.fileno(), 4096)
    f.close()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def segment() -> Iterator[str]:
    """A file named as MPICH names its segments, unique to this test process."""
    path = os.path.join(SHM_DIR, f"mpich_shm_meshcommtest{os.getpid()}_0")
    with open(path, "wb") as f:
        f.truncate(4096)
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@contextlib.contextmanager
def holder(path: str, how: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path, how], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_segment_is_removed_only_once_nothing_maps_it(segment: str) -> None:
    with holder(segment, "map") as proc:
        watch = ShmWatch(proc.pid)
        watch.scan()
        assert watch.names == {os.path.basename(segment)} and watch.pids == {proc.pid}
        assert mapped_by([segment]) == {segment: [proc.pid]}
        assert watch.cleanup(wait=0.1) == []  # still mapped: another job's live segment
        assert os.path.exists(segment)
    assert watch.cleanup() == [segment]
    assert not os.path.exists(segment)


def test_an_open_segment_is_kept(segment: str) -> None:
    with holder(segment, "map") as mapper:
        watch = ShmWatch(mapper.pid)
        watch.scan()
    with holder(segment, "open") as opener:
        assert mapped_by([segment]) == {segment: [opener.pid]}
        assert watch.cleanup() == []
        assert os.path.exists(segment)


def test_a_segment_the_job_never_mapped_is_not_its_own(segment: str) -> None:
    with holder(segment, "map"), holder(segment, "open") as other:
        watch = ShmWatch(other.pid)  # watches a process that never maps the file
        watch.scan()
        assert watch.names == set()
    assert watch.cleanup() == []
    assert os.path.exists(segment)
