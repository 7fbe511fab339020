"""``axis_index`` and ``axis_size``: where this rank sits along an axis, and how long it is.

Both are plain ints computed from the mesh, without communicating.

Example:
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import init_device_mesh
    >>> mesh = init_device_mesh((1, 1), ("dp", "tp"))  # a world of one here
    >>> axis_index(("dp", "tp"), mesh=mesh), axis_size("tp", mesh=mesh)
    (0, 1)
    >>> world.shutdown()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshcomm.ops._resolve import AxisName, axis_dims, get_mesh, resolve

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["axis_index", "axis_size"]


def axis_index(axis_name: AxisName, *, mesh: DeviceMesh | None = None) -> int:
    """Return this rank's index along ``axis_name`` (``jax.lax.axis_index``).

    For a tuple of names the index is row-major over them in the order given: on a
    ``(2, 4)`` mesh ``("dp", "tp")``, rank ``(dp, tp)`` has index ``dp * 4 + tp``, and
    ``("tp", "dp")`` gives ``tp * 2 + dp``. It is this rank's rank in the axis' group.

    Args:
        axis_name: a mesh dim name, or a tuple of names.
        mesh: the mesh; default the ambient one.

    Returns:
        An int in ``[0, axis_size(axis_name))``.

    Raises:
        InvalidArgument: no mesh, unknown axis, or this rank is not in the mesh.

    Example:
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> with init_device_mesh((1,), ("x",)):
        ...     axis_index("x")
        0
        >>> world.shutdown()
    """
    return resolve(axis_name, mesh, "axis_index").index


def axis_size(axis_name: AxisName, *, mesh: DeviceMesh | None = None) -> int:
    """Return the number of ranks along ``axis_name`` (``jax.lax.axis_size``).

    Needs no world: the mesh's shape answers.

    Args:
        axis_name: a mesh dim name, or a tuple of names (the product of their sizes).
        mesh: the mesh; default the ambient one.

    Returns:
        An int >= 1.

    Raises:
        InvalidArgument: no mesh or an unknown axis.

    Example:
        >>> from meshcomm.mesh import DeviceMesh
        >>> axis_size(("dp", "tp"), mesh=DeviceMesh([[0, 1, 2], [3, 4, 5]], ("dp", "tp")))
        6
    """
    m = get_mesh(mesh, "axis_size")
    size = 1
    for d in axis_dims(axis_name, m, "axis_size"):
        size *= m.shape[d]
    return size
