"""all_reduce with ``out=``: the result written into the caller's buffer (in place when it is
the input), synchronous and asynchronous, against a numpy oracle at world sizes 1-4 and 8, on
the world and on mesh axes; bad buffers refused before any I/O; the compat layer's in-place
all_reduce reducing the caller's memory where it lies."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm.backends.local import SelfCommunicator
from meshcomm.errors import InvalidArgument
from meshcomm.group import ProcessGroup
from meshcomm.group.arrays import SUPPORTED_DTYPES
from meshcomm.testing import run_ranks

# (op, factor): every reduce op the numpy oracle below knows, premul_sum with its scalar.
OPS: list[tuple[str, float | None]] = [
    ("sum", None),
    ("prod", None),
    ("min", None),
    ("max", None),
    ("avg", None),
    ("band", None),
    ("bor", None),
    ("bxor", None),
    ("premul_sum", 2.0),
]
FORMS = ("sync in place", "sync apart", "async in place", "async apart", "strided input")


def _defined(op: str, dtype: np.dtype) -> bool:
    if op in ("band", "bor", "bxor"):
        return dtype.kind in "biu"
    if op in ("min", "max"):
        return dtype.kind != "c"
    if op in ("avg", "premul_sum"):
        return dtype.kind in "fcV" or dtype == np.dtype(ml_dtypes.bfloat16)
    if op == "prod":
        return dtype.kind != "b"
    return True


def _values(dtype: np.dtype, rank: int, n: int = 7) -> np.ndarray:
    if dtype.kind == "b":
        return (np.arange(n) + rank) % 3 == 0
    base = (np.arange(n) % 3 + rank % 2 + 1).astype(np.float64)
    if dtype.kind == "c":
        return (base + 1j * base).astype(dtype)
    return base.astype(dtype)


def _oracle(op: str, factor: float | None, dtype: np.dtype, ranks: list[int]) -> np.ndarray:
    xs = [_values(dtype, r) for r in ranks]
    if op in ("sum", "avg", "premul_sum"):
        wide = [x.astype(np.complex128 if dtype.kind == "c" else np.float64) for x in xs]
        if op == "premul_sum":
            wide = [w * factor for w in wide]
        total = np.sum(wide, axis=0)
        if dtype.kind == "b":
            return total != 0
        return (total / len(xs) if op == "avg" else total).astype(dtype)
    logical = {"prod": np.logical_and, "min": np.logical_and, "max": np.logical_or,
               "band": np.logical_and, "bor": np.logical_or, "bxor": np.logical_xor}  # fmt: skip
    arithmetic = {"prod": np.multiply, "min": np.minimum, "max": np.maximum,
                  "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}  # fmt: skip
    reduce = (logical if dtype.kind == "b" else arithmetic)[op]
    out = xs[0].copy()
    for x in xs[1:]:
        out = reduce(out, x).astype(dtype)
    return out


def _call(group: ProcessGroup, form: str, op: str, factor: float | None, x: np.ndarray) -> Any:
    """Run one form of ``all_reduce(out=...)``; return (result, whether it is the buffer)."""
    if form == "strided input":
        wide = np.zeros((x.size, 2), x.dtype)
        wide[:, 0] = x
        out = np.empty_like(x)
        got = group.all_reduce(wide[:, 0], op, factor=factor, out=out)
        return got, got is out
    out = x if "in place" in form else np.empty_like(x)
    if form.startswith("async"):
        got = group.all_reduce(x, op, factor=factor, out=out, async_op=True).wait(timeout=60)
    else:
        got = group.all_reduce(x, op, factor=factor, out=out)
    return got, got is out


def reduce_into_every_form(world: ProcessGroup) -> list[str]:
    """Every supported dtype and op, every form, on the world and on the groups of even and
    odd ranks; returns what disagreed with the oracle (nothing, when all is well)."""
    wrong: list[str] = []
    size = world.size
    halves = world.split(world.rank % 2) if size > 1 else world
    odd_or_even = list(range(world.rank % 2, size, 2))
    for group, members in ((world, list(range(size))), (halves, odd_or_even)):
        for dtype in SUPPORTED_DTYPES:
            for op, factor in OPS:
                if not _defined(op, dtype):
                    continue
                want = _oracle(op, factor, dtype, members)
                for form in FORMS:
                    x = _values(dtype, world.rank)
                    got, same = _call(group, form, op, factor, x)
                    ok = same and got.dtype == dtype
                    if dtype.kind in "fc" or dtype == np.dtype(ml_dtypes.bfloat16):
                        wide = np.complex128
                        ok = ok and np.allclose(got.astype(wide), want.astype(wide))
                    else:
                        ok = ok and np.array_equal(got, want)
                    if not ok:
                        wrong.append(f"{group.name} {dtype} {op} {form}: {got} != {want}")
    return wrong


@pytest.mark.parametrize("size", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_all_reduce_into_matches_the_oracle(size: int) -> None:
    assert run_ranks(reduce_into_every_form, size, timeout=300) == [[]] * size


def _seq(group: ProcessGroup) -> int:
    return group._issuer.seq


def test_out_is_written_and_returned_in_every_form() -> None:
    g = ProcessGroup(SelfCommunicator())
    x = np.arange(4.0)
    assert g.all_reduce(x, out=x) is x
    out = np.full(4, -1.0)
    assert g.all_reduce(x, "avg", out=out) is out
    np.testing.assert_array_equal(out, x)
    assert g.all_reduce(x, "premul_sum", factor=3.0, out=out) is out
    np.testing.assert_array_equal(out, 3 * x)
    np.testing.assert_array_equal(x, np.arange(4.0))  # apart: the input is untouched
    work = g.all_reduce(x, out=x, async_op=True)
    assert work.wait(timeout=10) is x
    g.close()


@pytest.mark.parametrize(
    ("x", "out", "words"),
    [
        (np.ones(3), np.empty(2), "out has shape (2,) and dtype float64; x has shape (3,)"),
        (np.ones(3), np.empty(3, np.float32), "dtype float32; x has shape (3,) and dtype float64"),
        (np.ones(3), np.empty(6)[::2], "writeable and C-contiguous"),
        (np.ones(3, ">f8"), np.empty(3, ">f8"), "native byte order"),
        ([1.0, 2.0], np.empty(2), "got x of type list and out of type ndarray"),
        (np.ones(2), [0.0, 0.0], "out of type list"),
    ],
    ids=["shape", "dtype", "strided", "byte order", "list input", "list out"],
)
def test_bad_out_is_refused_before_any_io(x: Any, out: Any, words: str) -> None:
    g = ProcessGroup(SelfCommunicator())
    with pytest.raises(InvalidArgument, match="rank 0 in group 'world'") as info:
        g.all_reduce(x, out=out)
    assert words in str(info.value)
    assert _seq(g) == 0  # nothing was issued
    g.close()


def test_read_only_and_overlapping_out_are_refused() -> None:
    g = ProcessGroup(SelfCommunicator())
    frozen = np.ones(3)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="writeable=False"):
        g.all_reduce(np.ones(3), out=frozen)
    base = np.arange(6.0)
    with pytest.raises(InvalidArgument, match="overlaps x"):
        g.all_reduce(base[:4], out=base[2:])
    np.testing.assert_array_equal(base, np.arange(6.0))
    with pytest.raises(InvalidArgument, match="'premul_sum' needs factor="):
        g.all_reduce(base, "premul_sum", out=np.empty(6))
    assert _seq(g) == 0
    g.close()


def mesh_axis_out_errors(world: ProcessGroup) -> dict[str, Any]:
    """A bad ``out=`` on the groups of a (2, size / 2) mesh's axes: each error's words, then
    a good call on the same group (the check left it working)."""
    from meshcomm.mesh import DeviceMesh

    mesh = DeviceMesh(np.arange(world.size).reshape(2, world.size // 2), ("dp", "tp"))
    seen: dict[str, Any] = {}
    for axis in ("tp", "dp", ("tp", "dp")):
        group = mesh.get_group(axis)
        x = np.ones(3, np.float32)
        try:
            group.all_reduce(x, out=np.empty(2, np.float32))
        except InvalidArgument as exc:
            words = str(exc)
        else:
            words = "no error"
        out = np.empty(3, np.float32)
        group.all_reduce(x, out=out)
        seen[str(axis)] = (words, out.tolist())
    return seen


@pytest.mark.parametrize("size", [2, 4])
def test_out_errors_name_the_mesh_axes_the_group_was_made_for(size: int) -> None:
    """The group of a mesh axis is named by the axis and its slice (``world/tp (dp=1)``),
    and its calls say which axes (``over 'tp'``): no internal name such as ``axes(1):0``.
    An axis whose group is the world itself (the 'dp' of a 2x1 mesh) is named 'world'."""
    half = size // 2
    for rank, seen in enumerate(run_ranks(mesh_axis_out_errors, size, timeout=120)):
        expected = {
            "tp": f"in group 'world/tp (dp={rank // half})' over 'tp' (size {half})",
            "dp": f"in group 'world/dp (tp={rank % half})' over 'dp' (size 2)",
            "('tp', 'dp')": f"in group 'world/(tp,dp)' over ('tp', 'dp') (size {size})",
        }
        if size == 2:  # both the 'dp' axis and the tuple hold the world's ranks in order
            expected["dp"] = expected["('tp', 'dp')"] = "in group 'world' (size 2)"
        for axis, words in expected.items():
            text, values = seen[axis]
            assert text.startswith(f"all_reduce: rank {rank} {words}: out has shape (2,)"), text
            assert "axes(" not in text
            groups = {"tp": half, "dp": 2, "('tp', 'dp')": size}
            assert values == [float(groups[axis])] * 3, seen
