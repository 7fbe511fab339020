"""Drawings of a :class:`~meshcomm.mesh.DeviceMesh`: text for terminals, HTML for Jupyter.

Pure functions of the grid and the rank to mark: no I/O, no groups made.

Example:
    >>> from meshcomm.mesh import DeviceMesh
    >>> print(render_text(DeviceMesh([0, 1, 2], "x"), rank=1))
    DeviceMesh 3 (x=3), 3 ranks; rank 1 at x=1
    <BLANKLINE>
        x=0  x=1  x=2
          0  [1]    2
    <BLANKLINE>
      x groups: *(0, 1, 2)
"""

from __future__ import annotations

import html
import itertools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["axis_groups", "render_html", "render_text"]

#: Groups listed per axis before the list is cut short.
MAX_GROUPS_SHOWN = 8


def axis_groups(grid: np.ndarray, dim: int) -> list[tuple[int, ...]]:
    """Return the groups along ``dim``: each one's ranks, ordered by the other coordinates.

    Example:
        >>> axis_groups(np.arange(4).reshape(2, 2), 0)
        [(0, 2), (1, 3)]
    """
    moved = np.moveaxis(grid, dim, -1).reshape(-1, grid.shape[dim])
    return [tuple(int(r) for r in row) for row in moved]


def _header(mesh: DeviceMesh, rank: int | None) -> str:
    dims = ", ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    text = f"DeviceMesh {' x '.join(map(str, mesh.shape))} ({dims}), {mesh.size()} ranks"
    if rank is None:
        return text
    coord = mesh._coordinate_of(rank)
    if coord is None:
        return f"{text}; rank {rank} is not in this mesh"
    where = ", ".join(f"{n}={c}" for n, c in zip(mesh.mesh_dim_names, coord, strict=True))
    return f"{text}; rank {rank} at {where}"


def _planes(mesh: DeviceMesh) -> list[tuple[str, np.ndarray]]:
    """Split the grid into 2-D tables (rows, cols), each with a title for leading indices."""
    grid = mesh.mesh
    if grid.ndim == 1:
        return [("", grid.reshape(1, -1))]
    lead = grid.shape[:-2]
    out = []
    for idx in itertools.product(*(range(n) for n in lead)):
        title = ", ".join(f"{mesh.mesh_dim_names[d]}={i}" for d, i in enumerate(idx))
        out.append((title, grid[idx]))
    return out


def _group_lines(mesh: DeviceMesh, rank: int | None) -> list[str]:
    lines = []
    width = max(len(n) for n in mesh.mesh_dim_names)
    for d, name in enumerate(mesh.mesh_dim_names):
        groups = axis_groups(mesh.mesh, d)
        shown = []
        for members in groups[:MAX_GROUPS_SHOWN]:
            mark = "*" if rank is not None and rank in members else ""
            shown.append(f"{mark}{_tuple(members)}")
        mine = [g for g in groups[MAX_GROUPS_SHOWN:] if rank is not None and rank in g]
        if mine:
            shown.append(f"... *{_tuple(mine[0])}")
        if len(groups) > MAX_GROUPS_SHOWN:
            shown.append(f"... ({len(groups)} groups)")
        lines.append(f"  {name:>{width}} groups: {'  '.join(shown)}")
    return lines


def _tuple(members: tuple[int, ...]) -> str:
    if len(members) > 16:
        return f"({', '.join(map(str, members[:8]))}, ..., {members[-1]})"
    return f"({', '.join(map(str, members))})"


def render_text(mesh: DeviceMesh, rank: int | None) -> str:
    """Draw ``mesh`` as text, marking ``rank`` (``[r]``) and its groups (``*``).

    Example:
        >>> from meshcomm.mesh import DeviceMesh
        >>> print(render_text(DeviceMesh([[[0], [1]], [[2], [3]]], ("pp", "dp", "tp")), None))
        DeviceMesh 2 x 2 x 1 (pp=2, dp=2, tp=1), 4 ranks
        <BLANKLINE>
          pp=0:
                  tp=0
            dp=0     0
            dp=1     1
          pp=1:
                  tp=0
            dp=0     2
            dp=1     3
        <BLANKLINE>
          pp groups: (0, 2)  (1, 3)
          dp groups: (0, 1)  (2, 3)
          tp groups: (0)  (1)  (2)  (3)
    """
    names = mesh.mesh_dim_names
    col_name = names[-1]
    row_name = names[-2] if mesh.ndim >= 2 else ""
    digits = len(str(int(mesh.mesh.max())))
    width = max(digits + 2, len(f"{col_name}={mesh.shape[-1] - 1}"))
    rows_n = 1 if mesh.ndim == 1 else mesh.shape[-2]
    label_w = 0 if mesh.ndim == 1 else len(f"{row_name}={rows_n - 1}")
    lines = [_header(mesh, rank), ""]
    for title, plane in _planes(mesh):
        indent = "  " if not title else "    "
        if title:
            lines.append(f"  {title}:")
        head = "".join(f"  {f'{col_name}={j}':>{width}}" for j in range(plane.shape[1]))
        lines.append(f"{indent}{'':>{label_w}}{head}")
        for i, row in enumerate(plane):
            label = f"{row_name}={i}" if mesh.ndim >= 2 else ""
            cells = []
            for r in row:
                text = f"[{int(r):>{width - 2}}]" if rank == int(r) else f"{int(r):>{width}}"
                cells.append(f"  {text}")
            lines.append(f"{indent}{label:>{label_w}}{''.join(cells)}")
    lines.append("")
    lines.extend(_group_lines(mesh, rank))
    return "\n".join(lines)


_ME = "background:#f4a261;font-weight:bold"
_MATE = "background:#fde7d3"
_CELL = "border:1px solid #999;padding:2px 8px;text-align:right"


def render_html(mesh: DeviceMesh, rank: int | None) -> str:
    """Draw ``mesh`` as HTML tables: ``rank`` highlighted, its group mates tinted.

    Example:
        >>> from meshcomm.mesh import DeviceMesh
        >>> "<table" in render_html(DeviceMesh([[0, 1]], ("dp", "tp")), rank=1)
        True
    """
    names = mesh.mesh_dim_names
    mates: set[int] = set()
    if rank is not None and mesh._coordinate_of(rank) is not None:
        for d in range(mesh.ndim):
            for members in axis_groups(mesh.mesh, d):
                if rank in members:
                    mates.update(members)
    parts = [f"<div><p><code>{html.escape(_header(mesh, rank))}</code></p>"]
    for title, plane in _planes(mesh):
        if title:
            parts.append(f"<p><code>{html.escape(title)}</code></p>")
        parts.append('<table style="border-collapse:collapse">')
        head = "".join(
            f'<th style="{_CELL}">{html.escape(names[-1])}={j}</th>' for j in range(plane.shape[1])
        )
        corner = "" if mesh.ndim == 1 else f'<th style="{_CELL}"></th>'
        parts.append(f"<tr>{corner}{head}</tr>")
        for i, row in enumerate(plane):
            cells = (
                [] if mesh.ndim == 1 else [f'<th style="{_CELL}">{html.escape(names[-2])}={i}</th>']
            )
            for value in row:
                r = int(value)
                style = _CELL + (";" + _ME if r == rank else ";" + _MATE if r in mates else "")
                cells.append(f'<td style="{style}">{r}</td>')
            parts.append(f"<tr>{''.join(cells)}</tr>")
        parts.append("</table>")
    groups = "\n".join(line.strip() for line in _group_lines(mesh, rank))
    parts.append(f"<pre>{html.escape(groups)}</pre></div>")
    return "\n".join(parts)
