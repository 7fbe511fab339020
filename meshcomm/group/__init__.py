"""The group core: :class:`ProcessGroup`, and the middle between its methods and a backend.

A collective called on a group is checked, admitted by the issuer (:mod:`.issuing`), lowered
onto flat buffers (:mod:`.lower`, :mod:`.device_lower`, cached as :mod:`.plans`) and run on the
group's communicator (:mod:`meshcomm.backends`).

Example:
    >>> from meshcomm.group import ProcessGroup
    >>> ProcessGroup.__module__
    'meshcomm.group.process_group'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshcomm.group.process_group import DEBUG_ENV_VARS, ProcessGroup, Work, new_group

__all__ = ["DEBUG_ENV_VARS", "ProcessGroup", "Work", "new_group"]


def __getattr__(name: str) -> Any:
    # Lazy, so that the layers below the group (arrays, lowering, diagnostics) can import
    # this package's leaf modules without pulling in ProcessGroup and everything above it.
    if name in __all__:
        from meshcomm.group import process_group

        return getattr(process_group, name)
    raise AttributeError(f"module 'meshcomm.group' has no attribute {name!r}")
