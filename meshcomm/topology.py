"""How this host's GPUs are linked (NVML), and a rank order that keeps a mesh axis on the best.

:func:`topology` reads the GPU-to-GPU link matrix through NVML (the ``nvidia-ml-py``
package, imported on first use) with the levels ``nvidia-smi topo -m`` prints, best first:

=========  ==========================================================
``NV``     an NVLink between the two GPUs
``PIX``    at most one PCIe switch between them
``PXB``    several PCIe switches, no host bridge
``PHB``    through a PCIe host bridge (one CPU)
``NODE``   across host bridges within one NUMA node
``SYS``    across NUMA nodes / CPU sockets
=========  ==========================================================

``MESHCOMM_GPU_LINKS`` describes the links by hand instead (rows separated by ``;``, the
levels of a row by ``,``, ``X`` on the diagonal), to plan for a machine you are not on.

:func:`best_order` is the rule :func:`meshcomm.init_device_mesh` follows with
``gpu_order="topology"``: it splits a host's GPUs into consecutive blocks of the last
axis's size, each block as well linked as it can be: start each block with the lowest
unused GPU, then add the unused GPU whose worst link to the block is best (ties: the
better sum of links, then the lower index).

Example:
    >>> links = parse_links("X,SYS,NV,SYS; SYS,X,SYS,NV; NV,SYS,X,SYS; SYS,NV,SYS,X")
    >>> best_order(links, 2)
    [0, 2, 1, 3]
    >>> print(Topology(("gpu0", "gpu1"), parse_links("X,NV;NV,X")).describe())
          GPU0  GPU1
    GPU0  X     NV
    GPU1  NV    X
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Sequence
from typing import Any

from meshcomm.errors import InvalidArgument

__all__ = [
    "GPU_ORDER_ENV",
    "LINKS_ENV",
    "Link",
    "Topology",
    "best_order",
    "gpu_order_arg",
    "mesh_ranks",
    "parse_links",
    "topology",
]

#: The environment variable that describes the links by hand (see the module docstring).
LINKS_ENV = "MESHCOMM_GPU_LINKS"
#: The default of ``init_device_mesh(gpu_order=...)``.
GPU_ORDER_ENV = "MESHCOMM_GPU_ORDER"


class Link(enum.IntEnum):
    """How two GPUs are connected; a lower value is a better link."""

    NV = 1
    PIX = 2
    PXB = 3
    PHB = 4
    NODE = 5
    SYS = 6


#: NVML's common-ancestor levels (nvmlGpuTopologyLevel_t) as links.
_NVML_LEVELS = {0: Link.PIX, 10: Link.PIX, 20: Link.PXB, 30: Link.PHB, 40: Link.NODE, 50: Link.SYS}

Matrix = tuple[tuple[Link | None, ...], ...]


@dataclasses.dataclass(frozen=True)
class Topology:
    """This host's GPUs and the link between each pair.

    Attributes:
        gpus: the GPUs by NVML index (their names).
        links: ``links[i][j]`` is the link between GPU i and GPU j (None for i == j).
        reason: why there are no GPUs to describe (None when there are).
    """

    gpus: tuple[str, ...]
    links: Matrix
    reason: str | None = None

    def describe(self) -> str:
        """The matrix as ``nvidia-smi topo -m`` lays it out (or the reason there is none)."""
        if not self.gpus:
            return f"no GPU topology: {self.reason}"
        names = [f"GPU{i}" for i in range(len(self.gpus))]
        width = max(len(n) for n in names) + 2
        lines = [" " * width + "".join(n.ljust(width) for n in names).rstrip()]
        for name, row in zip(names, self.links, strict=True):
            cells = "".join(("X" if link is None else link.name).ljust(width) for link in row)
            lines.append((name.ljust(width) + cells).rstrip())
        return "\n".join(lines)


def parse_links(text: str) -> Matrix:
    """A link matrix from ``"X,NV;NV,X"`` (rows by ``;``, levels by ``,``, ``X`` diagonal).

    Raises:
        InvalidArgument: not square, not symmetric, an unknown level, or no ``X`` diagonal.

    Example:
        >>> parse_links("X,PIX;PIX,X")[0][1]
        <Link.PIX: 2>
    """
    rows = [[cell.strip().upper() for cell in row.split(",")] for row in text.split(";")]
    n = len(rows)
    matrix: list[tuple[Link | None, ...]] = []
    for i, row in enumerate(rows):
        if len(row) != n:
            raise InvalidArgument(f"{LINKS_ENV}: row {i} has {len(row)} entries, expected {n}")
        cells: list[Link | None] = []
        for j, cell in enumerate(row):
            if (cell == "X") != (i == j):
                raise InvalidArgument(f"{LINKS_ENV}: X belongs on the diagonal only (row {i})")
            if cell == "X":
                cells.append(None)
                continue
            try:
                cells.append(Link[cell])
            except KeyError:
                levels = ", ".join(link.name for link in Link)
                raise InvalidArgument(
                    f"{LINKS_ENV}: unknown link {cell!r} in row {i}; known: X, {levels}"
                ) from None
        matrix.append(tuple(cells))
    for i in range(n):
        for j in range(i):
            if matrix[i][j] != matrix[j][i]:
                raise InvalidArgument(f"{LINKS_ENV}: links {i}-{j} and {j}-{i} differ")
    return tuple(matrix)


def topology() -> Topology:
    """This host's GPU links: from ``MESHCOMM_GPU_LINKS`` if set, else from NVML.

    Never raises for a missing driver or package: the result's ``reason`` says what is
    missing and ``gpus`` is empty.

    Raises:
        InvalidArgument: ``MESHCOMM_GPU_LINKS`` is malformed.
    """
    text = os.environ.get(LINKS_ENV, "").strip()
    if text:
        links = parse_links(text)
        return Topology(tuple(f"gpu{i}" for i in range(len(links))), links)
    try:
        import pynvml
    except ImportError:
        return Topology((), (), "pynvml is not installed (pip install nvidia-ml-py)")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # no driver: NVMLError_LibraryNotFound and kin
        return Topology((), (), f"NVML did not start (no NVIDIA driver?): {exc}")
    try:
        return _from_nvml(pynvml)
    except Exception as exc:  # an old driver without a query: say so, do not fail
        return Topology((), (), f"NVML could not report the links: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _from_nvml(nvml: Any) -> Topology:
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if not handles:
        return Topology((), (), "NVML sees no GPU")
    names = []
    for handle in handles:
        name = nvml.nvmlDeviceGetName(handle)
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    rows = []
    for i, a in enumerate(handles):
        row: list[Link | None] = []
        for j, b in enumerate(handles):
            if i == j:
                row.append(None)
            elif _nvlinked(nvml, a, b):
                row.append(Link.NV)
            else:
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
                row.append(_NVML_LEVELS.get(level, Link.SYS))
        rows.append(tuple(row))
    return Topology(tuple(names), tuple(rows))


def _nvlinked(nvml: Any, a: Any, b: Any) -> bool:
    try:
        status = nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except Exception:  # a driver without the query: no NVLink known
        return False
    return bool(status == nvml.NVML_P2P_STATUS_OK)


def best_order(links: Matrix | Sequence[Sequence[Link | None]], block: int) -> list[int]:
    """GPU indices in an order whose consecutive blocks of ``block`` are best linked.

    The identity when ``block`` does not divide the number of GPUs (or is 1).

    Example:
        >>> best_order(parse_links("X,PIX,SYS;PIX,X,SYS;SYS,SYS,X"), 3)
        [0, 1, 2]
    """
    n = len(links)
    if block <= 1 or n % block:
        return list(range(n))
    unused = list(range(n))
    order: list[int] = []
    while unused:
        members = [unused.pop(0)]
        while len(members) < block:

            def cost(g: int, members: list[int] = members) -> tuple[int, int, int]:
                costs = [int(links[g][m] or 0) for m in members]
                return max(costs), sum(costs), g

            pick = min(unused, key=cost)
            unused.remove(pick)
            members.append(pick)
        order.extend(members)
    return order


def gpu_order_arg(gpu_order: str | None, default: str = "rank") -> str:
    """``init_device_mesh``'s ``gpu_order``: ``"rank"`` or ``"topology"`` (None: the
    ``MESHCOMM_GPU_ORDER`` variable, else ``default``).

    Raises:
        InvalidArgument: anything else.

    Example:
        >>> gpu_order_arg("topology")
        'topology'
    """
    order = gpu_order if gpu_order is not None else os.environ.get(GPU_ORDER_ENV, default)
    if order not in ("rank", "topology"):
        source = "" if gpu_order is not None else f" (from {GPU_ORDER_ENV})"
        raise InvalidArgument(
            f"init_device_mesh: gpu_order must be 'rank' or 'topology', got {order!r}{source}"
        )
    return order


def mesh_ranks(group: Any, block: int) -> list[int]:
    """The world's ranks in the order :func:`best_order` gives each host's GPUs.

    Rank r is taken to use GPU ``LOCAL_RANK`` of its host. Each host's ranks stay
    consecutive (hosts in the order of their lowest rank), ordered by where their GPU
    falls in :func:`best_order` of that host's links, so every block of ``block``
    consecutive ranks (the last mesh axis) sits on one host's best-linked GPUs. Where a
    host's links are unknown, or ``block`` does not divide its rank count, its ranks keep
    rank order. Collective over ``group`` (one all_gather of two integers).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group import ProcessGroup
        >>> mesh_ranks(ProcessGroup(SelfCommunicator()), 1)
        [0]
    """
    import hashlib
    import socket

    import numpy as np

    from meshcomm.launch import detect_launch

    info = detect_launch(os.environ)
    local, count = info.local_rank, info.local_world_size
    place = -1
    if local is not None and count is not None and 0 <= local < count:
        links = topology().links
        if len(links) >= count:
            place = best_order([row[:count] for row in links[:count]], block).index(local)
        else:
            place = local
    host = socket.gethostname() + "|" + (os.environ.get("MESHCOMM_HOST_KEY") or "")
    digest = int.from_bytes(hashlib.blake2b(host.encode(), digest_size=7).digest(), "big")
    rows = group.all_gather(np.array([digest, place], dtype=np.int64))
    if (rows[:, 1] < 0).any():
        return list(group.ranks)
    hosts: dict[int, list[tuple[int, int]]] = {}
    for rank, (key, where) in zip(group.ranks, rows.tolist(), strict=True):
        hosts.setdefault(key, []).append((where, rank))
    return [rank for members in hosts.values() for _, rank in sorted(members)]
