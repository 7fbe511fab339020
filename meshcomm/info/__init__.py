"""``meshcomm.info()``: what this process can use: backends, versions, GPUs, the launcher.

Prints a short report and returns the same facts as a dict::

    meshcomm 0.1.0 (python 3.11.7, numpy 2.3.1, ml_dtypes 0.5.1)
    launcher: mpich, rank 0 of 2 (local rank 0 of 2)
    backends:
      self  yes
      tcp   yes
      mpi   yes: mpi4py 4.1.2, MPICH Version: 5.0.2 (MPI 5.0), thread level multiple,
            CUDA-aware: no (MPIX_Query_cuda_support() = 0 in .../libmpi.so.12)
      nccl  no: cupy is not installed (pip install 'meshcomm[cuda12]')
    GPUs: not queried: pynvml is not installed (pip install nvidia-ml-py)

Nothing heavy is imported at module level. Querying the MPI library initializes MPI, so it
is done in this process only when MPI is already initialized here (``mpi4py.MPI`` imported)
or an MPI launcher started it; otherwise a short-lived child process asks MPI, so a plain
``python`` process using the tcp backend never initializes MPI by calling ``info()``.

Also runnable: ``python -m meshcomm.info`` (``--json`` prints the dict as JSON).

Example:
    >>> facts = info(verbose=False, query_mpi=False)
    >>> sorted(facts["backends"])
    ['mpi', 'nccl', 'self', 'tcp']
    >>> facts["backends"]["self"]["available"]
    True
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import sys
from typing import Any

from meshcomm.common.version import VERSION

# importlib.metadata (and the email package under it) and subprocess are imported when
# info() runs: ``import meshcomm`` imports this module in every rank.

__all__ = ["info", "main"]

_PREFIXES = ("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_MPI_PROBE = "import sys; from meshcomm.info import main; sys.exit(main(['--mpi-json']))"


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _launcher() -> dict[str, Any]:
    from meshcomm.launch import detect_launch
    from meshcomm.launcher.processes import LAUNCHER_ENV

    try:
        launch = detect_launch(os.environ)
    except Exception as exc:
        return {"launcher": None, "error": str(exc)}
    name = launch.launcher
    named = os.environ.get(LAUNCHER_ENV)
    if name == "torchrun" and named and launch.store_host == "launcher":
        name = named  # meshrun and meshcomm.spawn set torchrun's variables too
    return {
        "launcher": name,
        "rank": launch.rank,
        "world_size": launch.world_size,
        "local_rank": launch.local_rank,
        "local_world_size": launch.local_world_size,
        "mpi": launch.is_mpi or launch.launcher == "slurm",
    }


# -- MPI ------------------------------------------------------------------------------------
def _mpi_here() -> dict[str, Any]:
    """Ask the MPI library in this process (initializes MPI if it is not yet)."""
    from meshcomm.backends.mpi._lib import cuda_support, load, thread_level_name

    mpi = load()
    library = str(mpi.Get_library_version()).replace("\x00", "").strip().splitlines()
    aware, how = cuda_support()
    major, minor = mpi.Get_version()
    return {
        "library": " ".join(library[0].split()) if library else "unknown",
        "standard": f"{major}.{minor}",
        "thread_level": thread_level_name(int(mpi.Query_thread())),
        "cuda_aware": aware,
        "cuda_aware_source": how,
    }


def _mpi_child(timeout: float) -> dict[str, Any]:
    """Ask MPI in a child process that no launcher variable reaches (a singleton MPI)."""
    import subprocess

    env = {
        k: v for k, v in os.environ.items() if not (k.startswith(_PREFIXES) or k in _LAUNCH_VARS)
    }
    try:
        proc = subprocess.run(
            # Not ``-m meshcomm.info``: the package imports that module first, and runpy warns.
            [sys.executable, "-c", _MPI_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"querying MPI in a child process failed: {exc}"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"querying MPI in a child process failed: {tail[0]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _mpi(query: bool | None, launched_by_mpi: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"available": _has("mpi4py"), "mpi4py": _version("mpi4py")}
    if not out["available"]:
        out["reason"] = "mpi4py is not installed (pip install 'meshcomm[mpi]')"
        return out
    here = "mpi4py.MPI" in sys.modules or launched_by_mpi
    if query is False:
        return out
    try:
        out.update(_mpi_here() if here else _mpi_child(timeout=30.0))
    except Exception as exc:  # a broken MPI install: report it, do not fail
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


# -- NCCL and GPUs --------------------------------------------------------------------------
def _nccl() -> dict[str, Any]:
    out: dict[str, Any] = {"available": False}
    if not _has("cupy"):
        out["reason"] = "cupy is not installed (pip install 'meshcomm[cuda12]' or [cuda13])"
        return out
    try:
        import cupy
        from cupy.cuda import nccl

        out["cupy"] = str(cupy.__version__)
        out["nccl"] = int(nccl.get_version())
    except Exception as exc:
        out["reason"] = f"cupy is installed but NCCL is not usable: {type(exc).__name__}: {exc}"
        return out
    out["available"] = True
    out["native"] = _native_binding()
    return out


def _native_binding() -> dict[str, Any]:
    """The nccl backend's own ctypes binding: asked for or not, and the libnccl it finds."""
    from meshcomm.backends.nccl import _native
    from meshcomm.backends.nccl.communicator import native_requested

    out: dict[str, Any] = {"requested": native_requested()}
    try:
        lib = _native.load_library()
    except ImportError as exc:
        out["reason"] = str(exc)
    else:
        out["library"], out["version"] = lib.path, lib.version
    return out


def _gpus() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"queried": False, "reason": "pynvml is not installed (pip install nvidia-ml-py)"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"queried": False, "reason": f"NVML did not start (no NVIDIA driver?): {exc}"}
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "memory_gib": round(int(memory.total) / 2**30, 1),
                }
            )
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "queried": True,
            "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
            "devices": devices,
        }
    except Exception as exc:
        return {"queried": False, "reason": f"NVML query failed: {exc}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


# -- the report -----------------------------------------------------------------------------
def info(*, verbose: bool = True, query_mpi: bool | None = None) -> dict[str, Any]:
    """Print (if ``verbose``) and return what meshcomm can use in this process.

    Args:
        verbose: print the report to stdout.
        query_mpi: ask the MPI library for its version, thread level and CUDA awareness.
            None (default): yes, in this process under an MPI launcher or when MPI is
            already initialized here, else in a child process. False: only report whether
            mpi4py is installed. True: always ask (as for None).

    Returns:
        ``{"meshcomm", "python", "numpy", "ml_dtypes", "launcher", "backends", "gpus"}``;
        ``backends`` maps "self", "tcp", "mpi", "nccl" to dicts with at least
        ``available`` (and ``reason`` when False).

    Example:
        >>> info(verbose=False, query_mpi=False)["launcher"]["launcher"] in (
        ...     "single", "meshcomm", "meshrun", "meshcomm.spawn", "torchrun", "openmpi",
        ...     "mpich", "slurm")
        True
    """
    import numpy as np

    launcher = _launcher()
    facts: dict[str, Any] = {
        "meshcomm": _version("meshcomm") or VERSION,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ml_dtypes": _version("ml_dtypes"),
        "launcher": launcher,
        "backends": {
            "self": {"available": True},
            "tcp": {"available": _has("meshcomm.backends.tcp")},
            "mpi": _mpi(query_mpi, bool(launcher.get("mpi"))),
            "nccl": _nccl(),
        },
        "gpus": _gpus(),
    }
    if not facts["backends"]["tcp"]["available"]:
        facts["backends"]["tcp"]["reason"] = "meshcomm.backends.tcp is missing from this build"
    if verbose:
        print(format_report(facts))
    return facts


def format_report(facts: dict[str, Any]) -> str:
    """Render :func:`info`'s dict as the text it prints."""
    lines = [
        f"meshcomm {facts['meshcomm']} (python {facts['python']}, numpy {facts['numpy']}, "
        f"ml_dtypes {facts['ml_dtypes']})"
    ]
    launch = facts["launcher"]
    if launch.get("launcher") is None:
        lines.append(f"launcher: environment not understood: {launch.get('error')}")
    elif launch["launcher"] == "single":
        lines.append("launcher: none (a world of one)")
    else:
        local = ""
        if launch.get("local_rank") is not None:
            local = f" (local rank {launch['local_rank']} of {launch.get('local_world_size')})"
        where = f"rank {launch['rank']} of {launch['world_size']}{local}"
        lines.append(f"launcher: {launch['launcher']}, {where}")
    lines.append("backends:")
    for name, b in facts["backends"].items():
        lines.append(f"  {name:<5} {_backend_line(name, b)}")
    gpus = facts["gpus"]
    if not gpus.get("queried"):
        lines.append(f"GPUs: not queried: {gpus.get('reason')}")
    elif not gpus["devices"]:
        lines.append(f"GPUs: none (driver {gpus['driver']})")
    else:
        lines.append(f"GPUs (driver {gpus['driver']}):")
        for d in gpus["devices"]:
            lines.append(f"  {d['index']}: {d['name']}, {d['memory_gib']} GiB")
        if len(gpus["devices"]) > 1:
            from meshcomm.topology import topology

            lines.append("GPU links (meshcomm.topology; NV = NVLink, SYS = across sockets):")
            lines.extend("  " + line for line in topology().describe().splitlines())
    return "\n".join(lines)


def _backend_line(name: str, b: dict[str, Any]) -> str:
    if not b.get("available"):
        return f"no: {b.get('reason', 'unavailable')}"
    if name == "mpi":
        parts = [f"mpi4py {b.get('mpi4py')}"]
        if "library" in b:
            parts.append(f"{b['library']} (MPI {b['standard']})")
            parts.append(f"thread level {b['thread_level']}")
            aware = "yes" if b["cuda_aware"] else "no, device buffers are staged through host"
            parts.append(f"CUDA-aware: {aware} ({b['cuda_aware_source']})")
        if "error" in b:
            parts.append(f"MPI not queried: {b['error']}")
        return "yes: " + ", ".join(parts)
    if name == "nccl":
        line = (
            f"yes: cupy {b.get('cupy')}, NCCL {b.get('nccl')} (device arrays, with "
            "init(backend='cpu:tcp,cuda:nccl'))"
        )
        native = b.get("native")
        if native:
            state = "on" if native["requested"] else "off (MESHCOMM_NCCL_NATIVE=1 turns it on)"
            found = native.get("version", f"unusable: {native.get('reason')}")
            line += f"; native binding {state}, libnccl {found}"
        return line
    return "yes"


def main(argv: list[str] | None = None) -> int:
    """``meshcomm-info``: print :func:`info` (``--json``: as one JSON object).

    Example:
        >>> main(["--bad"])
        2
    """
    return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    if argv == ["--mpi-json"]:
        print(json.dumps(_mpi_here()))
        return 0
    if argv == ["--json"]:
        print(json.dumps(info(verbose=False)))
        return 0
    if argv:
        print("usage: meshcomm-info [--json]", file=sys.stderr)
        return 2
    info()
    return 0
