"""GPU links and the mesh order that keeps the last axis on the best ones.

NVML needs an NVIDIA driver; here the links come from ``MESHCOMM_GPU_LINKS``, the same
matrix NVML would give, so the order rule and the mesh it makes run in every process of a
real world without a GPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from meshcomm.errors import InvalidArgument
from meshcomm.testing import run_ranks
from meshcomm.topology import LINKS_ENV, Link, Topology, best_order, parse_links, topology

# Four GPUs whose NVLinks join 0-2 and 1-3 (the rest across sockets).
CROSSED = "X,SYS,NV,SYS; SYS,X,SYS,NV; NV,SYS,X,SYS; SYS,NV,SYS,X"
# Two PCIe switches: 0-1 and 2-3 behind one each, the switches on two sockets.
SWITCHES = "X,PIX,SYS,SYS; PIX,X,SYS,SYS; SYS,SYS,X,PIX; SYS,SYS,PIX,X"


def _all(link: str, n: int) -> str:
    return ";".join(",".join("X" if i == j else link for j in range(n)) for i in range(n))


@pytest.mark.parametrize(
    ("links", "block", "order"),
    [
        (CROSSED, 2, [0, 2, 1, 3]),
        (CROSSED, 4, [0, 2, 1, 3]),  # one block: the same greedy walk
        (CROSSED, 3, [0, 1, 2, 3]),  # 3 does not divide 4: rank order
        (CROSSED, 1, [0, 1, 2, 3]),
        (SWITCHES, 2, [0, 1, 2, 3]),  # already best
        (_all("NV", 8), 4, list(range(8))),  # all alike: rank order
        # 8 GPUs, NVLink pairs (0,4) (1,5) (2,6) (3,7), PIX between 0-3 and between 4-7.
        (
            ";".join(
                ",".join(
                    "X" if i == j else "NV" if abs(i - j) == 4 else "PIX" if i // 4 == j // 4
                    else "SYS"
                    for j in range(8)
                )
                for i in range(8)
            ),
            2,
            [0, 4, 1, 5, 2, 6, 3, 7],
        ),
    ],
)  # fmt: skip
def test_each_block_gets_the_best_linked_gpus(links: str, block: int, order: list[int]) -> None:
    matrix = parse_links(links)
    got = best_order(matrix, block)
    assert got == order
    assert sorted(got) == list(range(len(matrix)))


def test_each_pair_starts_from_its_lowest_gpu_and_takes_its_best_partner() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = 8
        levels = rng.integers(1, 7, size=(n, n))
        levels = np.minimum(levels, levels.T)
        matrix = tuple(
            tuple(None if i == j else Link(int(levels[i, j])) for j in range(n)) for i in range(n)
        )
        order = best_order(matrix, 2)
        assert sorted(order) == list(range(n))
        for k in range(0, n, 2):
            first, partner = order[k], order[k + 1]
            rest = order[k + 1 :]
            assert first == min(order[k:])
            assert levels[first, partner] == min(levels[first, g] for g in rest)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("X,NV;NV", "row 1 has 1 entries, expected 2"),
        ("NV,X;X,NV", "X belongs on the diagonal only"),
        ("X,QPI;QPI,X", "unknown link 'QPI' in row 0; known: X, NV, PIX, PXB, PHB, NODE, SYS"),
        ("X,NV;PIX,X", "links 1-0 and 0-1 differ"),
    ],
)
def test_a_bad_link_matrix_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_links(text)


def test_the_matrix_prints_as_nvidia_smi_lays_it_out() -> None:
    text = Topology(("a", "b", "c"), parse_links("X,NV,SYS;NV,X,PHB;SYS,PHB,X")).describe()
    assert text.splitlines() == [
        "      GPU0  GPU1  GPU2",
        "GPU0  X     NV    SYS",
        "GPU1  NV    X     PHB",
        "GPU2  SYS   PHB   X",
    ]


def test_without_a_driver_or_package_topology_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LINKS_ENV, raising=False)
    found = topology()
    if found.gpus:
        pytest.skip("this machine has NVIDIA GPUs")
    assert found.links == ()
    if importlib.util.find_spec("pynvml") is None:
        assert found.reason == "pynvml is not installed (pip install nvidia-ml-py)"
    else:
        assert found.reason is not None and "NVML" in found.reason
    assert found.describe().startswith("no GPU topology: ")


def test_the_links_can_be_described_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LINKS_ENV, CROSSED)
    found = topology()
    assert found.gpus == ("gpu0", "gpu1", "gpu2", "gpu3")
    assert found.links[0][2] is Link.NV and found.links[0][1] is Link.SYS


# == in a world =============================================================================
def _mesh(group: Any, order: str) -> tuple[list[list[int]], float]:
    import meshcomm
    from meshcomm import ops

    mesh = meshcomm.init_device_mesh((2, 2), ("dp", "tp"), gpu_order=order)
    with mesh:
        total = float(ops.psum(np.array(float(group.rank)), "tp"))
    return mesh.mesh.tolist(), total


def test_a_topology_mesh_puts_the_tp_axis_on_nvlinked_gpus() -> None:
    results = run_ranks(_mesh, 4, args=("topology",), env={LINKS_ENV: CROSSED}, timeout=90)
    assert [grid for grid, _ in results] == [[[0, 2], [1, 3]]] * 4
    assert [total for _, total in results] == [2.0, 4.0, 2.0, 4.0]  # 0+2 and 1+3


def test_rank_order_is_the_default_and_unchanged() -> None:
    results = run_ranks(_mesh, 4, args=("rank",), env={LINKS_ENV: CROSSED}, timeout=90)
    assert [grid for grid, _ in results] == [[[0, 1], [2, 3]]] * 4
    assert [total for _, total in results] == [1.0, 1.0, 5.0, 5.0]


def test_a_bad_gpu_order_fails_before_joining_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    import meshcomm

    with pytest.raises(InvalidArgument, match="gpu_order must be 'rank' or 'topology', got 'nvl'"):
        meshcomm.init_device_mesh((1,), gpu_order="nvl")
    monkeypatch.setenv("MESHCOMM_GPU_ORDER", "fast")
    with pytest.raises(InvalidArgument, match="got 'fast' \\(from MESHCOMM_GPU_ORDER\\)"):
        meshcomm.init_device_mesh((1,))


def test_the_default_order_follows_the_links_only_with_a_device_backend() -> None:
    from meshcomm.topology import gpu_order_arg

    assert gpu_order_arg(None) == "rank"
    assert gpu_order_arg(None, default="topology") == "topology"
    assert gpu_order_arg("rank", default="topology") == "rank"  # the way to turn it off


def test_visualize_shows_this_hosts_gpu_links(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshcomm.mesh import DeviceMesh

    monkeypatch.setenv(LINKS_ENV, CROSSED)
    mesh = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    mesh.visualize(rank=0)
    assert "GPU links" not in capsys.readouterr().out  # no device backend: the grid only
    mesh.visualize(rank=0, gpus=True)
    shown = capsys.readouterr().out
    assert "GPU links on this host" in shown and "GPU0" in shown and "NV" in shown
