"""Group names for compiled code: a mesh and an axis name, as one string an operator carries.

A torch operator takes tensors, numbers and strings, not a :class:`~meshcomm.mesh.DeviceMesh`.
So, as torch's functional collectives name a process group, a call traced for
``torch.compile`` resolves its mesh and axis once, at trace time, into a name such as
``"mesh0:tp"`` (or ``"mesh0:(dp,tp)"`` for a tuple of axes), and the compiled program
looks the pair up again by that name each time it runs. The table holds the mesh weakly:
a name outliving its mesh is refused with an error that says so.

Example:
    >>> from meshcomm.mesh import DeviceMesh
    >>> mesh = DeviceMesh([[0, 1]], ("dp", "tp"))
    >>> name = group_name(mesh, ("dp", "tp"))
    >>> name.endswith(":(dp,tp)"), lookup(name) == (mesh, ("dp", "tp"))
    (True, True)
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

from meshcomm.errors import InvalidArgument

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["group_name", "lookup"]

_LABEL = "_torch_label"  # the mesh's label, in its own __dict__
_LABELS = itertools.count()
_NAMES: dict[str, tuple[weakref.ref[DeviceMesh], Any]] = {}


def group_name(mesh: DeviceMesh, axis_name: Any) -> str:
    """The name of ``axis_name`` on ``mesh`` (made once, then the same string).

    Example:
        >>> from meshcomm.mesh import DeviceMesh
        >>> mesh = DeviceMesh([0, 1], ("tp",))
        >>> group_name(mesh, "tp") == group_name(mesh, "tp")
        True
    """
    label = mesh.__dict__.get(_LABEL)
    if label is None:
        label = mesh.__dict__[_LABEL] = f"mesh{next(_LABELS)}"
    if isinstance(axis_name, str):
        axes: Any = axis_name
        name = f"{label}:{axis_name}"
    else:
        axes = tuple(axis_name)
        name = f"{label}:({','.join(str(a) for a in axes)})"
    if name not in _NAMES:
        _NAMES[name] = (weakref.ref(mesh), axes)
    return name


def lookup(name: str) -> tuple[DeviceMesh, Any]:
    """The mesh and axis name behind ``name``.

    Raises:
        InvalidArgument: an unknown name, or one whose mesh is gone.
    """
    found = _NAMES.get(name)
    mesh = found[0]() if found is not None else None
    if found is None or mesh is None:
        why = "unknown" if found is None else "its mesh no longer exists"
        raise InvalidArgument(
            f"meshcomm group {name!r}: {why}; a compiled function resolves its mesh when it "
            "is traced, so compile it again (torch._dynamo.reset()) after making a new mesh"
        )
    return mesh, found[1]
